"""The engine's slots on the device, and the four verbs over them taking the host's requests.

`gpt.inference.decoding` holds the verbs as pure jitted functions of arrays. `DeviceSlots` keeps what
they run over (the weights, the slots' state, the mesh) and turns the host's side of a call into those
arrays: requests into padded prompt pieces, each request's knobs into a row of settings, a slot number (or
None, for a row that enters no slot) into an insert's target. It decides nothing: which request runs,
where and when is the scheduler's (`gpt.inference.scheduler`), and the engine joins the two.

Over a mesh's data axis a prefill and an insert run `rows_per_prefill` rows: the requests', then padding
rows that go nowhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpt.inference.decoder import Decoder
from gpt.inference.decoding import (
    Admission,
    Emitted,
    Prefix,
    PromptScores,
    Settings,
    compiled_choose_first,
    compiled_place,
    decode,
    free,
    init_prefix,
    init_slots,
    insert,
    prefill,
)
from gpt.inference.drafters import Drafter
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY, SamplingParams
from gpt.model.sharding import data_parallel_size, devices_of
from gpt.program_report import check_compiled_fits, sharded_bytes

__all__ = ["DeviceSlots", "FIT_ADVICE", "COMPILED", "compiled_decode", "compiled_init_slots", "compiled_prefill",
           "lower_largest", "slots_over"]

# One compiled program per shape; the config is static, the weights, slots and knobs are traced. The slots and a
# prefix that runs on are donated: their caches are updated in place.
compiled_prefill = jax.jit(prefill, static_argnames="config", donate_argnames="prefix")
compiled_decode = jax.jit(decode, static_argnames=("config", "max_steps", "draft_tokens"),
                          donate_argnames="slots")
compiled_free = jax.jit(free, donate_argnames="slots")
compiled_init_prefix = jax.jit(init_prefix, static_argnums=(0, 1, 2))
compiled_init_slots = jax.jit(init_slots, static_argnums=(0, 1, 2, 3, 4, 5, 6))
# The programs that serve requests (`gpt.inference.engine.compiled_programs` counts what they hold).
COMPILED = (compiled_prefill, compiled_choose_first, compiled_place, compiled_decode, compiled_free,
            compiled_init_prefix)

# A prefill's row that goes nowhere (over a mesh's data axis a prefill and an insert run rows_per_prefill rows).
PADDING = Request([0], 1, GREEDY)


def lower_largest(config, weights, slots, rows: int, prefill_length: int, max_steps: int, draft_tokens: int,
                  drafter: Drafter | None) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The largest programs an engine runs, lowered: a prefill of `prefill_length` tokens for `rows` rows, and a
    decode of `max_steps` steps over every slot verifying `draft_tokens` of `drafter`'s guesses (none without
    one). `weights`, `slots` and `drafter` may be arrays or their shapes (`jax.ShapeDtypeStruct`s, for a
    topology with no devices here)."""
    tokens = jax.ShapeDtypeStruct((rows, prefill_length), jnp.int32)
    positions, flags = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.bool_)
    prefill_program = compiled_prefill.lower(config, weights, None, tokens, positions, tokens, flags, flags)
    decode_program = compiled_decode.lower(config, weights, slots, jax.ShapeDtypeStruct((), jnp.int32),
                                           jax.ShapeDtypeStruct((), jnp.bool_), max_steps=max_steps, rows_R=None,
                                           draft_tokens=draft_tokens, drafter=drafter if draft_tokens else None)
    return prefill_program, decode_program


# What to change when the slots and the weights do not fit the devices' memory.
FIT_ADVICE = ("use fewer --slots, a shorter --cache_length or --prefill_chunk, or split the weights and the cache "
              "over more devices (--mesh tensor=N)")


def slots_over(slots: int, rows: int) -> int:
    """The slots an engine keeps for `slots` asked over `rows` data-parallel rows: rounded up to a multiple of them,
    so that every row holds as many (here, and by `serve.py --compile_only`)."""
    return -(-slots // rows) * rows


class DeviceSlots:
    """`num_slots` slots of `cache_length` positions over `decoder`'s weights (and mesh, if any), decoded
`max_steps` steps a call at most (one compiled decode loop); with a `drafter` (`gpt.inference.drafters`:
the slots keep what it needs) a decode may verify up to `max_draft_tokens` of its guesses a step.

    Attributes:
      num_slots: the slots, `num_slots` rounded up to a multiple of rows_per_prefill.
      rows_per_prefill: the rows of every prefill and insert (the mesh's data-parallel size, else 1).
      slots: the device state (`gpt.inference.decoding.Slots`), replaced by each verb that changes it.
      keeps_history: the slots keep each one's tokens (`Slots.history`), for the drafter.
    """

    def __init__(self, decoder: Decoder, num_slots: int, cache_length: int, max_stop_tokens: int, max_steps: int,
                 drafter: Drafter | None = None, max_draft_tokens: int = 0, fit_advice: str = FIT_ADVICE):
        self.fit_advice = fit_advice  # what the ConfigError of a setting over the devices' memory says to change
        self.decoder, self.config, self.weights, self.mesh = decoder, decoder.config, decoder.weights, decoder.mesh
        self.rows_per_prefill = data_parallel_size(self.mesh) if self.mesh is not None else 1
        self.num_slots = slots_over(num_slots, self.rows_per_prefill)
        self.max_stop_tokens, self.max_steps = max_stop_tokens, max_steps
        self.drafter, self.max_draft_tokens = drafter, max_draft_tokens if drafter is not None else 0
        self.cache_length, self.keeps_history = cache_length, drafter is not None and drafter.keeps_history
        draft_config = None if drafter is None else drafter.cache_config
        with self.on_mesh():
            # The slots come from a program of their own: its output, with the weights beside it, is checked
            # against the devices' memory before anything is allocated.
            program = compiled_init_slots.lower(self.config, self.num_slots, cache_length, max_stop_tokens,
                                                self.keeps_history, draft_config, self.max_draft_tokens).compile()
            check_compiled_fits(program, self._devices(), "decoding slots' cache",
                                f"{self.num_slots} slots of {cache_length} positions", fit_advice,
                                held_already=sharded_bytes((self.weights, drafter)))
            self.slots = program()

    def on_mesh(self):
        """A context in which the verbs run over the mesh (none without one)."""
        return self.decoder.on_mesh()

    def check_largest_fit(self, prefill_length: int) -> None:
        """The largest programs the verbs run, a prefill of `prefill_length` positions for a prefill's rows and
        a decode over every slot verifying the most drafted tokens, compiled (the verbs then find them compiled)
        and checked against the devices' memory before either runs: their arguments, outputs and temporaries
        (`check_compiled_fits`); ConfigError naming the setting and what to change when one is over."""
        rows, devices = self.rows_per_prefill, self._devices()
        setting = f"{self.num_slots} slots of {self.cache_length} positions"
        with self.on_mesh():
            prefill, decode = (program.compile() for program in lower_largest(
                self.config, self.weights, self.slots, rows, prefill_length, self.max_steps, self.max_draft_tokens,
                self.drafter))
            check_compiled_fits(prefill, devices, f"prefill of {rows} x {prefill_length} tokens", setting,
                                self.fit_advice, held_already=sharded_bytes((self.slots, self.drafter)))
            check_compiled_fits(decode, devices, "decode", setting, self.fit_advice)

    def _devices(self) -> list:
        return devices_of(self.mesh)

    def settings(self, request: Request, stops: Sequence[int]) -> Settings:
        """A request's knobs as host scalars (one row of an Admission's settings); `stops`: its stop tokens,
        as `check_stop_tokens` returned them."""
        stop_tokens = np.full((self.max_stop_tokens,), -2, np.int32)
        stop_tokens[: len(stops)] = stops
        params = SamplingParams.of(request.sampling)
        seed, stream = (np.uint32(int(n) % 2**32) for n in (request.seed, request.stream))  # int(): a numpy seed too
        return Settings(params=params, seed=seed, stream=stream, stop_tokens=stop_tokens,
                        top_logprobs=np.bool_(request.logprobs > 0))

    def fresh_prefix(self, length: int) -> Prefix:
        """An empty Prefix of `rows_per_prefill` rows and `length` positions, for pieces to run into."""
        with self.on_mesh():
            return compiled_init_prefix(self.config, self.rows_per_prefill, length)

    def prefill(self, requests: Sequence[Request], prefix: Prefix | None, start: int,
                length: int) -> tuple[Prefix, PromptScores]:
        """Run tokens start..start+length-1 of each request's prompt (row i: requests[i], then padding) into
        `prefix` (None: a fresh one of `length` positions). Returns the prefix and the pieces' scores."""
        rows = self._rows(requests)
        tokens, lengths = _piece(rows, start, length)
        targets = _piece(rows, start + 1, length)[0]
        score = np.asarray([r.prompt_logprobs for r in rows], np.bool_)
        top = np.asarray([r.logprobs > 0 for r in rows], np.bool_)
        with self.on_mesh():
            return compiled_prefill(self.config, self.weights, prefix, tokens, lengths, targets, score, top)

    def insert(self, slots: Sequence[int | None], requests: Sequence[Request], settings: Sequence[Settings],
               prefix: Prefix) -> Emitted:
        """Move the requests' prompts (rows of `prefix`, run to their ends) into `slots`, each with its first
        token; returns the Emitted [1, rows]. A slot of None, and a padding row, go nowhere."""
        padding = self.rows_per_prefill - len(requests)
        past_the_end = self.num_slots  # dropped
        targets = [past_the_end if slot is None else slot for slot in slots] + [past_the_end] * padding
        settings = list(settings) + [self.settings(PADDING, ())] * padding
        rows = self._rows(requests)
        prompt = None
        if self.keeps_history:  # the slots' history begins with the prompt
            prompt = _piece(rows, 0, self.cache_length)[0]
        admission = Admission(slots=np.asarray(targets, np.int32),
                              max_tokens=np.asarray([r.max_tokens for r in rows], np.int32),
                              settings=jax.tree.map(lambda *rows: np.stack(rows), *settings), prompt=prompt)
        with self.on_mesh():
            self.slots, emitted = insert(self.weights, self.slots, prefix, admission)
        return emitted

    def decode(self, num_steps: int, stop_at_finish: bool, width: int, decoding: Sequence[int],
               draft_tokens: int = 0) -> Emitted:
        """Up to `num_steps` (<= max_steps) decode steps over `width` rows that hold the `decoding` slots
        (the slots' own order past them: distinct rows), each verifying `draft_tokens` (<=
        `max_draft_tokens`; 0: none) drafted tokens a row."""
        if not 0 <= draft_tokens <= self.max_draft_tokens:
            raise ValueError(f"draft_tokens must be in [0, {self.max_draft_tokens}], got {draft_tokens}")
        rows_R = None
        if width < self.num_slots:
            rest = [s for s in range(self.num_slots) if s not in decoding]
            rows_R = np.asarray((list(decoding) + rest)[:width], np.int32)
        with self.on_mesh():
            self.slots, emitted = compiled_decode(self.config, self.weights, self.slots, np.int32(num_steps),
                                                  np.bool_(stop_at_finish), max_steps=self.max_steps, rows_R=rows_R,
                                                  draft_tokens=draft_tokens,
                                                  drafter=self.drafter if draft_tokens else None)
        return emitted

    def free(self, free_S: np.ndarray) -> None:
        """Stop the slots in free_S (bool [S])."""
        with self.on_mesh():
            self.slots = compiled_free(self.slots, free_S)

    def _rows(self, requests: Sequence[Request]) -> list[Request]:
        """The requests of a prefill's `rows_per_prefill` rows: these, then padding."""
        return list(requests) + [PADDING] * (self.rows_per_prefill - len(requests))


def _piece(requests: Sequence[Request], start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens start..start+length-1 of each request's prompt: (int32 [b, length] right-padded, their real
    lengths int32 [b])."""
    pieces = [request.prompt[start: start + length] for request in requests]
    tokens = np.zeros((len(pieces), length), np.int32)
    for row, piece in enumerate(pieces):
        tokens[row, : len(piece)] = piece
    return tokens, np.asarray([len(piece) for piece in pieces], np.int32)
