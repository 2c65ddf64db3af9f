"""Generation: prefill the whole prompt batch in one call, then a `lax.while_loop` of decode steps, all in
one jitted function over a KV cache allocated once at the bucket's full length.

Shapes are bucketed so that new prompt lengths and new `max_new_tokens` inside a bucket reuse the
compiled loop: the batch is rounded up to a power of two, the prompt length to a power of two (>= 16),
and the cache to prompt bucket + a power of two >= max_new_tokens (capped at the model's context).
`max_new_tokens` and every sampling knob are traced values, never compile-time constants.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gpt.errors import ConfigError
from gpt.kv_cache import KVCache
from gpt.model import GPT
from gpt.sampling import SamplingParams, choose
from gpt.sharding import batch_sharding, data_parallel_size, shard_state
from gpt.tokenizer import get_tokenizer

__all__ = ["generate", "generate_text"]

_PAD = -1  # marks "no token" in the output buffer (finished rows, padding rows)
_MIN_PROMPT_BUCKET = 16
_MIN_NEW_BUCKET = 16


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


# ------------------------------------------------------------------------------------------ host side

class _HostStep:
    """Runs on the host once per decode step (through `io_callback`) when streaming or watching for stop
    strings: hands each live row's new token to `on_token` and says which rows produced a stop string."""

    def __init__(self, num_rows: int, on_token: Callable[[int, int], None] | None, stop_strings: Sequence[str]):
        self.num_rows, self.on_token, self.stop_strings = num_rows, on_token, tuple(stop_strings)
        self.tokens: list[list[int]] = [[] for _ in range(num_rows)]

    def __call__(self, tokens_B: np.ndarray, emitted_B: np.ndarray) -> np.ndarray:
        stopped = np.zeros(tokens_B.shape, np.bool_)
        for row in range(self.num_rows):
            if not emitted_B[row]:
                continue
            token = int(tokens_B[row])
            self.tokens[row].append(token)
            if self.on_token is not None:
                self.on_token(row, token)
            if self.stop_strings:
                text = get_tokenizer().decode(self.tokens[row])
                stopped[row] = any(stop in text for stop in self.stop_strings)
        return stopped


# The compiled loop calls one module-level function, so that a new callback never compiles again; the
# active _HostStep is swapped in for the duration of one generate call.
_host_step: _HostStep | None = None
_host_lock = threading.Lock()


def _dispatch_host_step(tokens_B, emitted_B):
    return _host_step(np.asarray(tokens_B), np.asarray(emitted_B))


# ------------------------------------------------------------------------------------------ device side

def _decode_loop(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    layers: list[dict],
    prompt_BP: jax.Array,
    start_B: jax.Array,
    live_B: jax.Array,
    max_new_tokens: jax.Array,
    params: SamplingParams,
    stop_tokens_K: jax.Array,
    key: jax.Array,
    *,
    cache_length: int,
    host_step: bool,
) -> tuple[jax.Array, jax.Array]:
    """Prefill + decode, the decode steps over `layers` (from `_decoding_layers`). Returns (tokens int32
    [B, cache_length - P] with _PAD after a row ends, steps)."""
    model = nnx.merge(graphdef, state)
    batch, prompt_length = prompt_BP.shape
    rows_B = jnp.arange(batch)
    cache = KVCache.init(model.config, start_B, cache_length)
    # The prefill is compute-bound: its scanned layers compile as one block and cost nothing extra there.
    logits_B1V, cache = model.prefill(prompt_BP, cache)

    real_BP = jnp.arange(prompt_length)[None, :] >= start_B[:, None]
    seen_BV = jnp.zeros((batch, model.config.vocab_size), jnp.bool_)
    seen_BV = seen_BV.at[rows_B[:, None], prompt_BP].max(real_BP)

    def pick(logits_B1V, seen_BV, done_B, step):
        token_B = choose(logits_B1V[:, 0], seen_BV, params, jax.random.fold_in(key, step))
        token_B = jnp.where(done_B, _PAD, token_B)
        is_stop_B = jnp.isin(token_B, stop_tokens_K)
        emitted_B = ~done_B & ~is_stop_B
        done_B = done_B | is_stop_B
        if host_step:
            stopped_B = io_callback(
                _dispatch_host_step, jax.ShapeDtypeStruct((batch,), jnp.bool_), token_B, emitted_B
            )
            done_B = done_B | stopped_B
        seen_BV = seen_BV.at[rows_B, jnp.maximum(token_B, 0)].max(emitted_B)
        return token_B, seen_BV, done_B

    out_BN = jnp.full((batch, cache_length - prompt_length), _PAD, jnp.int32)
    token_B, seen_BV, done_B = pick(logits_B1V, seen_BV, ~live_B, 0)
    out_BN = out_BN.at[:, 0].set(token_B)

    def keep_going(carry):
        step, _, cache, _, done_B, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done_B) & (cache.index < cache.length)

    def decode_step(carry):
        step, token_B, cache, out_BN, done_B, seen_BV = carry
        logits_B1V, cache = model(jnp.maximum(token_B, 0)[:, None], cache=cache, layers=layers)
        token_B, seen_BV, done_B = pick(logits_B1V, seen_BV, done_B, step)
        out_BN = jax.lax.dynamic_update_slice(out_BN, token_B[:, None], (0, step))
        return step + 1, token_B, cache, out_BN, done_B, seen_BV

    carry = (jnp.int32(1), token_B, cache, out_BN, done_B, seen_BV)
    step, _, _, out_BN, _, _ = jax.lax.while_loop(keep_going, decode_step, carry)
    return out_BN, step


_compiled_decode_loop = jax.jit(_decode_loop, static_argnames=("graphdef", "cache_length", "host_step"))


@functools.partial(jax.jit, static_argnames="graphdef")
def _decoding_layers(graphdef: nnx.GraphDef, state: nnx.State) -> list[dict]:
    """Decoding is bound by streaming the weights: give the loop each layer's weights sliced and laid out
    for it (`Blocks.for_decoding`), in a jit of its own so that the layout is real."""
    return nnx.merge(graphdef, state).blocks.for_decoding()


# model -> (mesh, weak references to its block weights, their `_decoding_layers`). Laying the weights out
# writes a copy of every block weight into fresh memory (~0.3 s for GPT-2 on the 2-core CPU, a tenth of
# a 128-token call), so the copy is kept while the model's block weights are the same arrays. It costs
# the memory of that copy between calls; a call's peak is the same either way.
_decoding_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_decoding_layers(model: GPT, graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh | None) -> list[dict]:
    weights = jax.tree.leaves(nnx.state(model.blocks))
    entry = _decoding_cache.get(model)
    if entry is None or entry[0] != mesh or any(ref() is not w for ref, w in zip(entry[1], weights)):
        entry = (mesh, [weakref.ref(w) for w in weights], _decoding_layers(graphdef, state))
        _decoding_cache[model] = entry
    return entry[2]


# ------------------------------------------------------------------------------------------ public API

def _validate_prompts(prompts, max_new_tokens: int, config) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ConfigError("prompts must be a non-empty list of token-id lists")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    checked = []
    for row, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ConfigError(f"prompt {row} is empty: every prompt needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"prompt {row} must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ConfigError(f"prompt {row} has token id {bad} outside the vocabulary [0, {config.vocab_size})")
        if ids.size + max_new_tokens > config.block_size:
            raise ConfigError(
                f"prompt {row} has {ids.size} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{ids.size + max_new_tokens}, beyond the model's context of {config.block_size} tokens"
            )
        checked.append(ids.astype(np.int32).tolist())
    return checked


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    seed: int = 0,
    on_token: Callable[[int, int], None] | None = None,
    mesh: Mesh | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
      model: a GPT.
      prompts: token-id lists, of any lengths (rows are independent: a row gives what it gives alone).
      max_new_tokens: the most tokens to add to each prompt.
      temperature, top_k, top_p, min_p, repetition_penalty: see `gpt.sampling.SamplingParams`;
        temperature 0 is greedy.
      stop_tokens: ids that end a row; the stop token itself is not returned.
      stop_strings: texts that end a row once its decoded output contains one; the row's tokens up to
        and including the one that completed the string are returned (`generate_text` cuts the text).
      seed: the PRNG seed; the same seed, prompts and settings give the same tokens.
      on_token: called as on_token(row, token) on the host for each new token while the loop runs.
      mesh: run sharded over this mesh (`gpt.sharding.make_mesh`): rows over data and fsdp, heads and MLP
        over tensor, the cache like the attention. The batch is padded to a multiple of data x fsdp.
    Returns:
      One list of new token ids per prompt.
    """
    config = model.config
    prompts = _validate_prompts(prompts, max_new_tokens, config)
    params = SamplingParams.create(temperature, top_k, top_p, min_p, repetition_penalty)
    stop_tokens = [int(t) for t in stop_tokens]
    if any(not 0 <= t < config.vocab_size for t in stop_tokens):
        raise ConfigError(f"stop_tokens {stop_tokens} must be ids in [0, {config.vocab_size})")

    num_rows, longest = len(prompts), max(len(p) for p in prompts)
    batch = _bucket(num_rows, 1)
    if mesh is not None:
        ways = data_parallel_size(mesh)
        batch = -(-batch // ways) * ways
    cache_length = min(_bucket(longest, _MIN_PROMPT_BUCKET) + _bucket(max_new_tokens, _MIN_NEW_BUCKET),
                       config.block_size)
    prompt_length = min(_bucket(longest, _MIN_PROMPT_BUCKET), cache_length - max_new_tokens)

    prompt_BP = np.zeros((batch, prompt_length), np.int32)
    start_B = np.full((batch,), prompt_length - 1, np.int32)  # padding rows hold one dummy token
    for row, prompt in enumerate(prompts):
        prompt_BP[row, prompt_length - len(prompt):] = prompt
        start_B[row] = prompt_length - len(prompt)
    live_B = np.arange(batch) < num_rows
    stop_tokens_K = np.full((_bucket(len(stop_tokens) + 1, 4),), -2, np.int32)
    stop_tokens_K[: len(stop_tokens)] = stop_tokens

    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = shard_state(model, state, mesh)
        rows = batch_sharding(mesh, ("batch",))
        prompt_BP = jax.device_put(prompt_BP, batch_sharding(mesh, ("batch", None)))
        start_B, live_B = jax.device_put(start_B, rows), jax.device_put(live_B, rows)
    host_step = on_token is not None or bool(stop_strings)
    global _host_step
    with _host_lock:
        _host_step = _HostStep(num_rows, on_token, stop_strings) if host_step else None
        try:
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                layers = _cached_decoding_layers(model, graphdef, state, mesh)
                out_BN, _ = _compiled_decode_loop(
                    graphdef, state, layers, prompt_BP, start_B, live_B, jnp.int32(max_new_tokens), params,
                    stop_tokens_K, jax.random.key(seed), cache_length=cache_length, host_step=host_step,
                )
            out_BN = np.asarray(out_BN)
        finally:
            _host_step = None

    results = []
    for row in range(num_rows):
        tokens = out_BN[row, :max_new_tokens].tolist()
        ends = [i for i, t in enumerate(tokens) if t == _PAD or t in stop_tokens]
        results.append(tokens[: ends[0]] if ends else tokens)
    return results


def generate_text(
    model: GPT,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    stop_strings: Sequence[str] = (),
    on_text: Callable[[int, str], None] | None = None,
    **sampling,
) -> list[str]:
    """`generate` on strings: encodes each prompt with GPT-2's tokenizer and returns each continuation,
    cut before the first stop string. `on_text(row, piece)` streams decoded text as it is produced.
    Other keyword arguments are `generate`'s."""
    if isinstance(prompts, str):
        raise ConfigError("prompts must be a list of strings, got one string")
    tokenizer = get_tokenizer()
    on_token = None
    if on_text is not None:
        produced: dict[int, list[int]] = {}
        shown: dict[int, int] = {}

        def on_token(row: int, token: int) -> None:
            produced.setdefault(row, []).append(token)
            text = tokenizer.decode(produced[row])
            if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
                return
            on_text(row, text[shown.get(row, 0):])
            shown[row] = len(text)

    outputs = generate(model, tokenizer.encode_batch(prompts), max_new_tokens, stop_strings=stop_strings,
                       on_token=on_token, **sampling)
    texts = []
    for tokens in outputs:
        text = tokenizer.decode(tokens)
        cuts = [text.index(stop) for stop in stop_strings if stop in text]
        texts.append(text[: min(cuts)] if cuts else text)
    return texts
