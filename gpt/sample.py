"""Sampling from the command line: a SampleConfig, model loading from any source, and the run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import tyro

from gpt.chat import Conversation, converse
from gpt.chat_template import ChatTemplate
from gpt.compilation_cache import CompileCacheChoice
from gpt.errors import ConfigError, MissingInput, check_fits_in_memory
from gpt.generate import cache_length_for, generate_text, new_tokens_that_fit
from gpt.inference.decoder import Decoder
from gpt.inference.drafters import make_drafter
from gpt.inference.engine_settings import DraftChoice
from gpt.inference.request import check_prompts
from gpt.inference.sampling import Sampling
from gpt.inference.speculation import check_draft
from gpt.loading import ModelChoice, end_of_turn_of, load, load_draft, tokenizer_of
from gpt.model.sharding import make_mesh, parse_mesh
from gpt.model.transformer import GPT
from gpt.tokenizer import TextTokenizer

__all__ = ["SampleConfig", "sample", "talk"]

_DEFAULT_NEW_TOKENS = 200
# What a sample keeps for each of its tokens on the host: a Python int in a list (~36 bytes), a slot of the
# request's arrays and its text; rounded up.
_BYTES_A_TOKEN = 64


@dataclasses.dataclass(frozen=True)
class SampleConfig(DraftChoice, ModelChoice, CompileCacheChoice):
    """`python sample.py --help` lists these as flags (which model and how: `ModelChoice`; whether it
    guesses ahead: `DraftChoice`)."""

    start: str = "\n"
    """The prompt, or FILE:path to read it from a file."""
    num_samples: int = 3
    max_new_tokens: int | None = None
    """Tokens added to the prompt; default 200, or fewer when the model's context holds fewer after the
    prompt. A number given here must fit."""
    sampling: tyro.conf.OmitArgPrefixes[Sampling] = Sampling(temperature=0.8, top_k=200)
    """How each token is chosen (each knob a flag of its own: --temperature, --top_k, ...)."""
    seed: int = 1337
    stream: bool = False
    """Print each sample's text as it is produced (samples are then generated one after another)."""
    chat: bool = False
    """Hold a conversation in the terminal instead (`gpt.chat`): a model with a chat template (an instruct
    checkpoint's); --start and --num_samples do not apply."""
    system: str = ""
    """With --chat: the system message that opens the conversation (none by default)."""


def _prompt(start: str) -> str:
    """--start's text: itself, or the UTF-8 file that FILE:path names."""
    if not start.startswith("FILE:"):
        return start
    path = Path(start[5:])
    if not path.is_file():
        raise MissingInput(f"--start {start!r}: {'not a file' if path.exists() else 'no such file'}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--start {start!r} is not UTF-8 text: {e}") from None


def _check_knobs(config: SampleConfig, counts: tuple[str, ...]) -> None:
    """ConfigError naming the first setting out of its bound (the sampling knobs, the draft, the `counts`, each at
    least 1 where set): before the model is loaded or anything compiled."""
    config.sampling.check()  # raises ConfigError naming the knob and its bound
    check_draft(config.draft, config.draft_tokens, names_a_model=True)
    for name in counts:
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ConfigError(f"SampleConfig.{name} must be >= 1, got {getattr(config, name)}")


def _loaded(config: SampleConfig, tokenizer: TextTokenizer) -> tuple[GPT, Decoder, GPT | None]:
    """`config`'s model, its Decoder (laid out, quantized and placed on `--mesh` once) and its draft model."""
    mesh = make_mesh(**parse_mesh(config.mesh)) if config.mesh else None
    draft, model = load_draft(config.draft, config.dtype, tokenizer), load(config.init_from, config.dtype)
    return model, Decoder.of(model, config.quantize, mesh), draft


def sample(config: SampleConfig, out=sys.stdout) -> list[str]:
    """Print (and return) `config.num_samples` completions. Every setting is checked before the model is
    loaded or anything compiled."""
    _check_knobs(config, ("num_samples", "max_new_tokens"))
    start = _prompt(config.start)
    held = len(start) + (config.max_new_tokens or _DEFAULT_NEW_TOKENS)  # about a token a character, at most
    check_fits_in_memory(f"SampleConfig.num_samples={config.num_samples}", config.num_samples * held * _BYTES_A_TOKEN,
                         "the samples' prompts and tokens", "ask for fewer --num_samples")
    tokenizer = tokenizer_of(config.init_from)  # the model's own where it has one (Llama's, Qwen's), else GPT-2's
    model, decoder, draft = _loaded(config, tokenizer)  # laid out for decoding (and quantized) once, for every sample
    max_new_tokens = config.max_new_tokens
    prompt = tokenizer.encode(start)
    if max_new_tokens is None:
        max_new_tokens = new_tokens_that_fit(model.config, start, _DEFAULT_NEW_TOKENS, tokenizer)
    check_prompts([prompt], max_new_tokens, model.config.vocab_size, model.config.block_size)  # room for them
    # Made once, for every sample, over the positions the rows hold, as generate's engine makes it.
    draft = make_drafter(draft, decoder, cache_length_for(model.config, len(prompt), max_new_tokens))
    texts = []
    for i in range(config.num_samples if config.stream else 1):
        rows = 1 if config.stream else config.num_samples
        on_text = (lambda row, piece: (out.write(piece), out.flush())) if config.stream else None
        if config.stream:
            out.write(start)
        batch = generate_text(decoder, [start] * rows, max_new_tokens, seed=config.seed + i, on_text=on_text,
                              sampling=config.sampling, draft=draft, draft_tokens=config.draft_tokens,
                              tokenizer=tokenizer, check_memory=i == 0)
        texts.extend(batch)
        if config.stream:
            out.write("\n---------------\n")
    if not config.stream:
        for text in texts:
            out.write(start + text + "\n---------------\n")
    return texts


def talk(config: SampleConfig, read=input, out=sys.stdout) -> list[dict]:
    """`sample.py --chat`: a conversation with `config`'s model in the terminal (`gpt.chat.converse`), its lines read
    with `read`; ConfigError, before the model is loaded, where it has no chat template."""
    _check_knobs(config, ("max_new_tokens",))
    tokenizer = tokenizer_of(config.init_from)
    template = ChatTemplate.of(tokenizer)
    if template is None:
        raise ConfigError(f"--init_from {config.init_from!r} has no chat template (tokenizer_config.json's "
                          f"chat_template, or chat_template.jinja beside its tokenizer): sample.py without --chat "
                          f"continues a text instead")
    end_of_turn = tuple(dict.fromkeys([*([] if tokenizer.eot_id is None else [tokenizer.eot_id]),
                                       *end_of_turn_of(config.init_from)]))
    model, decoder, draft = _loaded(config, tokenizer)
    draft = make_drafter(draft, decoder, model.config.block_size)
    opening = [{"role": "system", "content": config.system}] if config.system else []
    return converse(Conversation(decoder, tokenizer, template, end_of_turn, config.sampling, config.seed,
                                 config.max_new_tokens, draft, config.draft_tokens, opening), read, out)
