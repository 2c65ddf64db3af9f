"""How an engine runs, declared once: `Engine` takes these (as an `EngineSettings` or as keywords), and
serve.py's `ServeConfig` holds one beside its own settings, each a flag."""

from __future__ import annotations

import dataclasses

from gpt.errors import ConfigError
from gpt.hardware import device_memory_bytes
from gpt.inference.request import is_int
from gpt.inference.shapes import MIN_PROMPT_BUCKET
from gpt.inference.speculation import DEFAULT_DRAFT_TOKENS, Draft, check_draft
from gpt.model.config import GPTConfig

__all__ = ["DraftChoice", "EngineSettings"]


@dataclasses.dataclass(frozen=True)
class DraftChoice:
    """Whether and how decoding guesses ahead: the engine's and sample.py's, each a flag."""

    draft: Draft | str = "none"
    """Guess each request's next tokens and verify them a few at once (the same tokens, sooner where the
    guesses stand), at the widths where that has measured faster: ngram from its prompt and output, int8
    by the model's own weights in int8, or a smaller GPT with the same tokenizer: serve.py and sample.py
    load it from this INIT_FROM (a training out_dir, an HF directory, a hub name), the library takes the
    GPT (or its Decoder, or a Drafter made before) itself (`gpt.inference.drafters`)."""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """The most guessed tokens one step verifies (each call verifies as many of these as pays:
    `gpt.inference.draft_policy`)."""


@dataclasses.dataclass(frozen=True)
class EngineSettings(DraftChoice):
    """An engine's slots, queue, shapes and draft (`DraftChoice`)."""

    slots: int = 8
    """Requests decoded together (rounded up to a multiple of the mesh's data-parallel size)."""
    max_queue: int = 64
    """Requests that may wait for a slot; more are refused (`QueueFull`; serve.py answers HTTP 429)."""
    cache_length: int | None = None
    """Positions per slot (prompt + output); default and bound: the model's context."""
    steps_per_call: int = 1
    """Decode steps per device call: more amortize dispatch, fewer admit and stream sooner."""
    prefill_chunk: int = 256
    """A longer prompt runs in chunks of this many tokens, one per round, the other slots decoding between
    them (so a long prompt holds up the streams at most one chunk's time, and no longer prefill is
    compiled); >= 16; the cache length or more turns it off."""
    prefix_cache_tokens: int = 0
    """Positions of scored prompts (echo + logprobs) to keep after their prefills, so that one that begins
    like an earlier one (a multiple-choice item's choices) runs only the rest; 0 keeps none. GPT-2 124M keeps
    72 KB a position in float32: 32768 (2.4 GB) held the contexts of bench/eval_bench.py's 200-item
    multiple-choice task. Not over a mesh's data axis."""
    max_stop_tokens: int = 8
    """The most stop tokens a request may give."""

    def state_bytes(self, config: GPTConfig) -> int:
        """The bytes of keys and values these (checked) settings hold for a model of `config`: every slot's cache
        of `cache_length` positions and the prefix cache's positions, each position its layers x 2 x key heads x
        head size in the compute dtype (the weights, and a draft's own cache, beside them)."""
        position = config.n_layer * 2 * config.kv_heads * config.head_dim * config.compute_dtype.itemsize
        return position * (self.slots * self.cache_length + self.prefix_cache_tokens)

    def check_state_fits(self, config: GPTConfig, devices: list, advice: str) -> None:
        """ConfigError naming the slots, the cache length and the prefix cache, the GiB a device would hold and
        `advice`, when their keys and values (`state_bytes`) are over the devices' memory (the CPU's devices share
        the host's; other devices each hold their share): from the arithmetic, before anything is allocated or
        compiled, in the form of the compiled programs' check (`gpt.program_report.check_compiled_fits`)."""
        limit = device_memory_bytes(devices[0])
        held = self.state_bytes(config) // (1 if devices[0].platform == "cpu" else len(devices))
        if limit is None or held <= limit:
            return
        prefix = f" and {self.prefix_cache_tokens} prefix-cache positions" if self.prefix_cache_tokens else ""
        raise ConfigError(f"{self.slots} slots of {self.cache_length} positions{prefix}: the decoding slots' cache "
                          f"needs {held / 2**30:,.2f} GiB per device (their keys and values), over the "
                          f"{devices[0].device_kind}'s {limit / 2**30:,.2f} GiB: {advice}"
                          f"{', or fewer --prefix_cache_tokens' if prefix else ''}")

    def checked(self, config: GPTConfig | None = None) -> EngineSettings:
        """These settings with their integers as ints, `cache_length` filled in (None: the model's context)
        and `draft_tokens` 0 without a draft; ConfigError naming the first outside its bound. Without the
        model's `config` (before a model is loaded), cache_length's upper bound is not checked, and a `draft`
        that is no kind of draft names a model to load. A draft model's fit is checked where the engine makes
        its drafter (`gpt.inference.drafters.make_drafter`)."""
        block_size = None if config is None else config.block_size
        cache_length = block_size if self.cache_length is None else self.cache_length
        if block_size is not None and (not is_int(cache_length) or not 1 <= cache_length <= block_size):
            raise ConfigError(f"cache_length must be in [1, {block_size}] (the model's context), got {cache_length}")
        if cache_length is not None and (not is_int(cache_length) or cache_length < 1):
            raise ConfigError(f"Engine cache_length must be an integer >= 1, got {cache_length!r}")
        lowest = dict(prefix_cache_tokens=0, prefill_chunk=MIN_PROMPT_BUCKET)
        numbers = ("slots", "max_queue", "steps_per_call", "prefill_chunk", "prefix_cache_tokens", "max_stop_tokens")
        for name in numbers:
            value = getattr(self, name)
            if not is_int(value) or value < lowest.get(name, 1):
                raise ConfigError(f"Engine {name} must be an integer >= {lowest.get(name, 1)}, got {value!r}")
        draft_tokens = check_draft(self.draft, self.draft_tokens, names_a_model=config is None)
        return EngineSettings(**{name: int(getattr(self, name)) for name in numbers},
                              cache_length=None if cache_length is None else int(cache_length),
                              draft=self.draft if draft_tokens else "none", draft_tokens=draft_tokens)
