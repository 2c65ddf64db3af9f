"""Generation: a batch of prompts through one `gpt.inference.engine.Engine`, run on the caller's thread.

The engine is sized for the call: a slot per prompt (rounded up to a power of two) up to `max_batch`
slots, the other prompts waiting in its queue and entering as rows finish (each slot holds a cache row, its
next token and a row of its seen tokens, so the engine's memory does not grow past max_batch prompts), and a cache of prompt
bucket + a power of two >= max_new_tokens positions (capped at the model's context), so that new prompt
lengths and new `max_new_tokens` inside a bucket reuse the compiled programs. Every sampling knob is a
traced value. Each call has its own engine, so calls are re-entrant and thread-safe: an `on_token`
may itself call `generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from gpt.errors import ConfigError
from gpt.inference.decoder import Decoder
from gpt.inference.drafters import Drafter
from gpt.inference.engine import Engine
from gpt.inference.request import Request, check_prompts, check_stop_tokens, is_int
from gpt.inference.sampling import Sampling, check_sampling
from gpt.inference.shapes import bucket, power_of_two, prompt_buckets
from gpt.inference.speculation import DEFAULT_DRAFT_TOKENS
from gpt.inference.text_stream import TextStream
from gpt.model.transformer import GPT
from gpt.tokenizer import get_tokenizer

__all__ = ["generate", "generate_text", "new_tokens_that_fit", "cache_length_for"]

_MIN_NEW_BUCKET = 16

# What to change when a call's engine does not fit the devices' memory (in its arguments, and sample.py's flags).
FIT_ADVICE = ("decode fewer prompts at once (max_batch; sample.py: fewer --num_samples), fewer new tokens "
              "(--max_new_tokens), the weights in int8 (--quantize int8), or split the weights and the cache over "
              "more devices (--mesh tensor=N)")


def new_tokens_that_fit(config, prompt: str, wanted: int, tokenizer=None) -> int:
    """min(wanted, the tokens the model's context holds after `prompt`, encoded by `tokenizer`, GPT-2's by
    default); ConfigError when it holds none. For defaults that must work on any model (an explicit
    max_new_tokens must fit, or it is an error)."""
    prompt_tokens = len((tokenizer or get_tokenizer()).encode(prompt))
    if prompt_tokens >= config.block_size:
        raise ConfigError(f"the prompt has {prompt_tokens} tokens: the model's context of {config.block_size} "
                          "tokens leaves no room for new ones")
    return min(wanted, config.block_size - prompt_tokens)


def generate(
    model: GPT | Decoder,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    stop_tokens: int | Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    seed: int = 0,
    on_token: Callable[[int, int], None] | None = None,
    quantize: str | None = None,
    mesh: Mesh | None = None,
    max_batch: int = 64,
    draft: str | GPT | Decoder | Drafter | None = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    tokenizer=None,
    check_memory: bool = False,
) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
      model: a GPT, or a `gpt.inference.decoder.Decoder` of one (its weights laid out for decoding once, for
        every call; a GPT is laid out at each call).
      prompts: token-id lists, of any lengths (rows are independent: a row gives what it gives alone), or
        an integer array [B, T] of equal-length ones.
      max_new_tokens: the most tokens to add to each prompt.
      sampling: how each token is chosen (`gpt.inference.sampling.Sampling`; `GREEDY` takes the argmax).
      stop_tokens: ids that end a row (one id or a list); the stop token itself is not returned.
      stop_strings: texts that end a row (one string or a list) once its decoded output contains one; the
        row's tokens up to and including the one that completed the string are returned (`generate_text`
        cuts the text).
      seed: the PRNG seed (an integer, taken modulo 2**32); the same seed, prompts and settings give the
        same tokens.
      on_token: called as on_token(row, token) on the host for each new token while the loop runs.
      quantize: decode with the weights stored as "int8", "int4" or "bf16" (`gpt.inference.decoder.decoding_weights`);
        "none" (the default) keeps float32. A Decoder's own.
      mesh: run sharded over this mesh (`gpt.model.sharding.make_mesh`): rows over data and fsdp, heads and MLP
        over tensor, the cache like the attention. The batch is padded to a multiple of data x fsdp. A
        Decoder's own.
      max_batch: the most prompts decoded at once (the engine's slots); the rest wait and enter as rows
        finish. The results do not depend on it: a row gives what it gives alone.
      draft: what drafts each row's next tokens, up to `draft_tokens` of them verified a step
        (`gpt.inference.drafters`): "ngram", the row's own prompt and output (prompt lookup); "int8",
        the model's weights in int8; a smaller GPT with the same vocabulary and at least the context the
        rows need (or its Decoder, laid out once); or a Drafter made for `model` before (`make_drafter`,
        made once for many calls). The same tokens as without a draft, sooner where the
        draft guesses well. None (or "none") decodes without one.
      draft_tokens: the most drafted tokens a step verifies.
      tokenizer: what the stop strings are read through: GPT-2's (the default), or a model's own
        (`gpt.tokenizer_json.TokenizerJson`).
      check_memory: before anything runs, compile the call's largest prefill and its decode and check them
        against the devices' memory (`DeviceSlots.check_largest_fit`: ConfigError naming the GiB when over);
        the call then runs them compiled. A script's first call (sample.py's).
    Returns:
      One list of new token ids per prompt.
    """
    prompts, max_new_tokens, stop_tokens = _checked(model.config, prompts, max_new_tokens, stop_tokens, max_batch,
                                                    sampling)
    engine = _engine_for(model, prompts, max_new_tokens, len(stop_tokens), on_token is not None, max_batch,
                         quantize=quantize, mesh=mesh, draft=draft, draft_tokens=draft_tokens, tokenizer=tokenizer)
    if check_memory:  # the first piece of the longest prompt is the largest prefill
        longest = max(map(len, prompts))
        engine.device.check_largest_fit(bucket(engine.prompt_buckets, min(longest, engine.prefill_chunk)))
    completions = [engine.submit(Request(prompt, max_new_tokens, sampling, seed=seed, stream=row,
                                         stop_tokens=stop_tokens, stop_strings=stop_strings),
                                 None if on_token is None else _streamer(on_token, row))
                   for row, prompt in enumerate(prompts)]
    engine.run(completions)
    return [c.tokens for c in completions]


def _checked(config, prompts, max_new_tokens, stop_tokens, max_batch: int, sampling: Sampling):
    """A `generate` call's arguments checked (ConfigError naming the first bad one) before anything is laid out or
    compiled: (the prompts as lists, max_new_tokens as an int, the stop tokens as a list)."""
    prompts = check_prompts(prompts, max_new_tokens, config.vocab_size, config.block_size)
    check_sampling(sampling)
    stop_tokens = check_stop_tokens(stop_tokens, config.vocab_size)
    if not is_int(max_batch) or max_batch < 1:
        raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    return prompts, int(max_new_tokens), stop_tokens  # a numpy integer too


def _streamer(on_token: Callable[[int, int], None], row: int) -> Callable:
    """A Completion's on_update that hands out, in order, the tokens of row `row` each round produced."""
    shown = 0

    def on_update(completion) -> None:
        nonlocal shown
        for token in completion.tokens[shown:]:
            on_token(row, token)
        shown = len(completion.tokens)
    return on_update


def cache_length_for(config, longest_prompt: int, max_new_tokens: int) -> int:
    """The positions each row of a `generate` call holds (the cache a draft model must cover): the bucket of
    its longest prompt (`longest_prompt` tokens) and of its new tokens, at most the model's context."""
    prompt_bucket = bucket(prompt_buckets(config.block_size), longest_prompt)
    return min(prompt_bucket + power_of_two(max_new_tokens, _MIN_NEW_BUCKET), config.block_size)


def _engine_for(model: GPT | Decoder, prompts: list[list[int]], max_new_tokens: int, stop_tokens: int,
                streaming: bool, max_batch: int, **settings) -> Engine:
    """An engine sized for one `generate` call (see the module docstring); `settings`: the Engine's
    quantize, mesh, draft, draft_tokens and tokenizer."""
    cache_length = cache_length_for(model.config, max(len(p) for p in prompts), max_new_tokens)
    # Streaming hands each token out as it is made (a device call per step, ~5% of the speed); otherwise one
    # call runs the whole decode.
    return Engine(model, slots=min(power_of_two(len(prompts)), int(max_batch)), cache_length=cache_length,
                  max_queue=len(prompts), steps_per_call=1 if streaming else cache_length,
                  max_stop_tokens=power_of_two(stop_tokens + 1, 4), fit_advice=FIT_ADVICE, **settings)


def generate_text(
    model: GPT | Decoder,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    stop_strings: Sequence[str] = (),
    on_text: Callable[[int, str], None] | None = None,
    tokenizer=None,
    **settings,
) -> list[str]:
    """`generate` on strings: encodes each prompt with `tokenizer` (GPT-2's by default, or a model's own:
    `gpt.tokenizer_json.TokenizerJson`) and returns each continuation, cut before the first stop string.
    `on_text(row, piece)` streams decoded text as it is produced. Other keyword arguments are `generate`'s."""
    if isinstance(prompts, str):
        raise ConfigError("prompts must be a list of strings, got one string")
    for row, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ConfigError(f"prompts must be a list of strings; prompt {row} is {type(prompt).__name__}")
    tokenizer = tokenizer or get_tokenizer()
    streams = [TextStream(stop_strings, tokenizer) for _ in prompts]  # each row's text, decoded once

    def stream_text(row: int, token: int) -> None:
        stream = streams[row]
        if not stream.stopped:
            stream.push(token)
            if piece := stream.take():  # the text before a stop string comes out as it appears
                on_text(row, piece)

    outputs = generate(model, tokenizer.encode_batch(prompts), max_new_tokens, stop_strings=stop_strings,
                       on_token=stream_text if on_text is not None else None, tokenizer=tokenizer, **settings)
    texts = []
    for row, (stream, tokens) in enumerate(zip(streams, outputs)):
        if on_text is None:
            for token in tokens:
                stream.push(token)
        if (piece := stream.finish()) and on_text is not None:
            on_text(row, piece)
        texts.append(stream.text)
    return texts
