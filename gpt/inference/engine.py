"""The decoding engine: a fixed number of slots over one KV cache, fed from a bounded queue.

Each round (`step`), on the thread that owns the engine, through the device's four verbs
(`gpt.inference.decoding`: prefill, insert, decode, free):
  1. cancelled requests give up their slots (`free`);
  2. waiting requests enter free slots, first come first served: their prompts run shortest first
     (`prefill`, prompt lengths in buckets: `prompt_buckets`), then `insert` puts them in their slots,
     each with its first token; a prompt longer than `prefill_chunk` tokens takes its slot but runs one
     chunk per round instead, and is inserted after its last, so that the other slots go on decoding
     between its chunks; with a prefix cache (`prefix_cache_tokens`), a scored prompt takes that path
     too, starting after what the cache holds of its beginning;
  3. one `decode` runs up to `steps_per_call` steps for every live slot (over the fewest compiled rows
     that hold them: `decode_widths`); with a draft, each step verifies K drafted tokens a slot and emits
     up to K + 1 (`gpt.inference.drafters`, `gpt.inference.speculation`), K up to `draft_tokens`, chosen
     per call from the slots' acceptance rates and the measured cost of each K at this width
     (`gpt.inference.draft_policy`);
  4. new tokens go to their requests; finished slots become free.
Requests come and go between rounds, so a short request never waits for a long one to end (continuous
batching). Every sampling knob is a per-slot array, so no request's settings compile anything; `warmup`
compiles every shape the engine can run before it serves.

The decisions of steps 1, 2 and 4 (which request enters which slot, which way its prompt runs, which
chunk runs next, what a decode's tokens do to their requests) are `gpt.inference.scheduler`'s, with no
JAX; the engine runs the device verbs they call for through `gpt.inference.device_slots` (which keeps
the slots' state and turns requests into arrays), over the shapes of `gpt.inference.shapes`, with the
prefix cache of `gpt.inference.prefix_cache`.

`generate` runs an engine on the caller's thread (`run`); `serve.py` runs one on a thread of its own
(`start` / `stop`) and submits requests from the HTTP handlers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from gpt.inference import device_slots, prefix_cache
from gpt.inference.completion import Completion, deliver_prompt_scores
from gpt.inference.decoder import Decoder
from gpt.inference.decoding import Prefix, Settings
from gpt.inference.device_slots import DeviceSlots
from gpt.inference.draft_policy import DraftPolicy
from gpt.inference.drafters import make_drafter
from gpt.inference.engine_settings import EngineSettings
from gpt.inference.prefix_cache import PREFIX_BLOCK, PrefixCache
from gpt.inference.request import Request, check_request
from gpt.inference.sampling import GREEDY
from gpt.inference.scheduler import Chunked, Scheduler
from gpt.inference.shapes import (
    bucket,
    cached_prefix_length,
    decode_widths,
    pieces_after_prefixes,
    prompt_buckets,
)
from gpt.model.sharding import devices_of
from gpt.model.transformer import GPT
from gpt.tokenizer import get_tokenizer

__all__ = ["Engine", "compiled_programs"]


def compiled_programs() -> int:
    """How many programs the jitted functions that serve requests hold (for tests: none compiles after an
    engine's warm-up)."""
    return sum(f._cache_size() for f in (*device_slots.COMPILED, *prefix_cache.COMPILED))

class Engine:
    """Slots over one KV cache and a bounded queue; see the module docstring.

    Args:
      model: the GPT to decode with (its weights are laid out for decoding here), or a `Decoder` made once
        for many engines.
      settings: its slots, queue, shapes and draft (`EngineSettings`: a `ServeConfig` holds one); `changes`,
        keywords of the same names, change some (`Engine(model, slots=2)`).
      quantize: how the weights are stored for decoding: "none" (float32, the default), "int8", "int4" or "bf16"
        (`gpt.inference.decoder.decoding_weights`); a Decoder's own.
      mesh: run sharded over this mesh (`gpt.model.sharding.make_mesh`); a Decoder's own.
      tokenizer: what decodes the completions' text and its stop strings: GPT-2's (`gpt.tokenizer`, the
        default), or a model's own (`gpt.tokenizer_json.TokenizerJson`).
      fit_advice: what the ConfigError of settings over the devices' memory says to change (default: serve.py's
        flags, `device_slots.FIT_ADVICE`).
    """

    def __init__(self, model: GPT | Decoder, settings: EngineSettings | None = None, *, quantize: str | None = None,
                 mesh: Mesh | None = None, tokenizer=None, fit_advice: str = device_slots.FIT_ADVICE, **changes):
        config = model.config
        self.settings = s = dataclasses.replace(settings or EngineSettings(), **changes).checked(config)
        mesh = model.mesh if isinstance(model, Decoder) and mesh is None else mesh
        s.check_state_fits(config, devices_of(mesh), fit_advice)
        decoder = Decoder.of(model, quantize, mesh)
        drafter = make_drafter(s.draft, decoder, s.cache_length)
        self.device = DeviceSlots(decoder, s.slots, s.cache_length, s.max_stop_tokens, s.steps_per_call, drafter,
                                  s.draft_tokens, fit_advice)
        # How many guesses each call verifies, and the drafts' counts.
        self.draft_policy = (DraftPolicy(s.draft_tokens, self.device.num_slots, catches_up=drafter.catches_up)
                             if drafter is not None else None)
        self.config, self.num_slots, self.cache_length = config, self.device.num_slots, s.cache_length
        self.max_queue, self.steps_per_call, self.max_stop_tokens = s.max_queue, s.steps_per_call, s.max_stop_tokens
        self.prefill_chunk = min(s.prefill_chunk, s.cache_length)
        self.prompt_buckets = prompt_buckets(self.prefill_chunk)
        self.decode_widths = decode_widths(self.num_slots, self.device.mesh)
        prefix_cached = s.prefix_cache_tokens >= PREFIX_BLOCK and self.device.rows_per_prefill == 1
        self._prefix_cache = PrefixCache(self.device, s.prefix_cache_tokens) if prefix_cached else None
        self._scheduler = Scheduler(self.num_slots, s.max_queue, self.device.rows_per_prefill, self.prefill_chunk,
                                    prefix_cached)
        self._thread: threading.Thread | None = None
        # Each Completion's text stream needs it: loaded now, not on a request's clock.
        self.tokenizer = tokenizer or get_tokenizer()

    # ------------------------------------------------------------------------------ clients (any thread)

    def check(self, request: Request) -> Settings:
        """Raise ConfigError naming the first field of `request` outside its bound (nothing compiles);
        else return its knobs as host values (a row of an admission's settings). Whatever a client sends
        fails here, on its own thread, never in a round, where it would end every running request."""
        stops = check_request(request, self.config.vocab_size, self.cache_length, self.max_stop_tokens)
        return self.device.settings(request, stops)

    def submit(self, request: Request, on_update: Callable[[Completion], None] | None = None) -> Completion:
        """Queue a request (checked first); returns its Completion. Raises ConfigError, QueueFull or
        EngineStopped."""
        completion = Completion(request, on_update, self.check(request), self.tokenizer)
        self._scheduler.submit(completion)
        return completion

    @property
    def queue_depth(self) -> int:
        return self._scheduler.queue_depth

    @property
    def live_slots(self) -> int:
        return self._scheduler.live_slots

    @property
    def prompt_tokens_reused(self) -> int:
        """Prompt positions loaded from the prefix cache instead of run (a running total)."""
        return self._prefix_cache.tokens_reused if self._prefix_cache is not None else 0

    @property
    def tokens_emitted(self) -> int:
        """Tokens handed to requests so far (a running total, for tokens/s)."""
        return self._scheduler.tokens_emitted

    # -------------------------------------------------------------------------- the engine's own thread

    def step(self) -> bool:
        """One round (cancel, admit, decode, deliver). False when there was nothing to do."""
        self._scheduler.release_cancelled()
        self._free()
        admitted = self._admit()
        advanced = self._advance()
        decoding = self._scheduler.decoding()
        if not decoding:
            return admitted or advanced
        stop_at_finish = bool(self._scheduler.queue)  # someone waits for a slot: come back as soon as one frees
        width = bucket(self.decode_widths, len(decoding))
        draft_tokens = self.draft_policy.choose(width, decoding) if self.draft_policy is not None else 0
        start, programs = time.perf_counter(), compiled_programs()
        emitted = self.device.decode(self.steps_per_call, stop_at_finish, width, decoding, draft_tokens)
        self._scheduler.deliver(list(range(self.num_slots)), emitted)
        if self.draft_policy is not None:  # what the call cost, and what became of its drafts
            self.draft_policy.record(width, draft_tokens, time.perf_counter() - start, int(emitted.steps),
                                     *(np.asarray(a) for a in (emitted.drafted, emitted.reached, emitted.stood)),
                                     compiled=compiled_programs() != programs)
        return True

    def run(self, completions: Sequence[Completion]) -> None:
        """Run rounds on this thread until every one of `completions` has ended."""
        while not all(c.done.is_set() for c in completions):
            if not self.step():
                raise RuntimeError("the engine is idle but some completions never ended")

    def warmup(self, log: Callable[[str], None] = print) -> None:
        """Compile and run once every program the engine runs, through the four verbs, with a progress line:
        each prompt bucket's prefill, a chunked prompt's and a prefix-cached one's pieces, the inserts after
        each prefix length, the prefix cache's loads and saves, the decode over each of `decode_widths` rows,
        and the free.

        Each runs for real, not only compiles: XLA's CPU runtime readies an op on its first run (~0.2 s over
        a GPT-2 124M decode step), and decode's loop runs no step while every slot is free. So a placeholder
        prompt (asking for its scores and logprobs, which take branches of their own) runs each piece and
        enters slot 0, decodes a step at each width, and slot 0 is freed: the slots end as they began.
        """
        if self._thread is not None or self._scheduler.live_slots:
            raise RuntimeError("warmup runs before the engine serves: its placeholder borrows slot 0")
        self.device.check_largest_fit(self.prefill_chunk)  # before anything runs; its two then run compiled
        programs = _warmup_programs(self)
        start = time.perf_counter()
        for i, (kind, what, run) in enumerate(programs):
            log(f"warm-up: compiling {kind} {i + 1}/{len(programs)} ({what})")
            run()
        jax.block_until_ready(self.device.slots)  # the time below includes the last program's run
        log(f"warm-up: done in {time.perf_counter() - start:.1f} s")

    def compiled_shapes(self) -> int:
        """How many programs the decoding verbs' jitted functions hold, for every engine of the process (they
        are shared: for tests, that nothing compiles after a warm-up)."""
        return compiled_programs()

    def start(self) -> None:
        """Run rounds on a background thread until `stop`."""
        self._thread = threading.Thread(target=self._serve_forever, name="engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Admit nothing new (`submit` raises EngineStopped); what runs or waits goes on."""
        self._scheduler.drain()

    def abort(self) -> None:
        """End every running and waiting request now, with finish_reason "abort", and the background
        thread after them."""
        self._scheduler.cancel_everything("abort")

    def stop(self, deadline_s: float = 10.0) -> None:
        """Admit nothing new; let running and waiting requests finish for up to `deadline_s`, abort the
        rest, and end the background thread."""
        self.drain()
        end = time.monotonic() + deadline_s
        while not self._scheduler.idle and time.monotonic() < end and self._thread is not None:
            time.sleep(0.01)
        self.abort()
        if self._thread is not None:
            self._thread.join()

    def _serve_forever(self) -> None:
        while self._scheduler.wait_for_work():
            try:
                self.step()
            except Exception:  # a bug must not leave clients waiting forever: end what is running
                logging.getLogger(__name__).exception("engine round failed; ending the running requests")
                self._scheduler.release_all("error")

    # ----------------------------------------------------------------------------------------- internals

    def _admit(self) -> bool:
        """Move waiting requests into free slots and run their prompts (`Scheduler.admit`), again while
        requests that end with their prefills free slots for more."""
        admitted = False
        while groups := self._scheduler.admit():
            for way, group in groups:
                if way == "prefix_cached":
                    # loaded at its turn: `_advance`
                    self._scheduler.add_chunked(Chunked(group, None, prefix_cached=True))
                elif way == "chunked":
                    self._scheduler.add_chunked(Chunked(group, self.device.fresh_prefix(self.cache_length)))
                else:
                    longest = max(len(c.request.prompt) for _, c in group)
                    prefix = self._prefill(group, None, 0, bucket(self.prompt_buckets, longest))
                    self._scheduler.deliver([slot for slot, _ in group], self._insert(group, prefix))
            admitted = True
        return admitted

    def _free(self) -> None:
        """Stop on the device the slots the scheduler released since the last round."""
        free_S = self._scheduler.take_frees()
        if free_S.any():
            self.device.free(free_S)

    def _prefill(self, entries: list[tuple[int | None, Completion]], prefix: Prefix | None, start: int,
                 length: int) -> Prefix:
        """Run tokens start..start+length-1 of the entries' prompts into `prefix` (None: a fresh one of
        `length` positions), and hand the prompt scores to the entries that asked. Returns the prefix."""
        prefix, scores = self.device.prefill([c.request for _, c in entries], prefix, start, length)
        deliver_prompt_scores([c for _, c in entries], start, scores)
        return prefix

    def _insert(self, entries: list[tuple[int | None, Completion]], prefix: Prefix):
        """Move the entries' prompts (rows of `prefix`, run to their ends) into their slots, each with its
        first token; returns the Emitted [1, rows]. An entry whose slot is None (a chunked request
        cancelled: its row of `prefix` ran anyway, so that each other row stays where its cache is) or that
        asked for at most one token (it never decodes) goes nowhere."""
        completions = [c for _, c in entries]
        slots = self._scheduler.entering([slot for slot, _ in entries], completions)
        if self.draft_policy is not None:
            self.draft_policy.enter(slots)
        return self.device.insert(slots, [c.request for c in completions], [c.settings for c in completions], prefix)

    def _advance(self) -> bool:
        """Run the next chunk of the oldest chunked prompts; after their last, insert them into their slots
        with their first tokens. False when no prompt was waiting on chunks."""
        waiting = self._scheduler.next_chunked()
        if waiting is None:
            return False
        group, entries = waiting
        if group.prefix is None:  # prefix-cached: loaded at its turn, so that the choices of one item, admitted
            first = group.entries[0][1]  # together, find the blocks the first of them leaves
            length = cached_prefix_length(self.prefill_chunk, self.cache_length, len(first.request.prompt))
            group.ran(*self._prefix_cache.load(first, length))
        chunk, longest = self.prefill_chunk, max(len(c.request.prompt) for _, c in group.entries)
        if group.done + chunk < longest:
            group.ran(self._prefill(entries, group.prefix, group.done, chunk), chunk)
            return True
        self._scheduler.finish_chunked()
        prefix = self._prefill(entries, group.prefix, group.done, bucket(self.prompt_buckets, longest - group.done))
        if group.prefix_cached and entries[0][0] is not None:
            self._prefix_cache.keep(entries[0][1], prefix)
        self._scheduler.deliver([slot for slot, _ in entries], self._insert(entries, prefix))
        return True


def _warmup_programs(engine: Engine) -> list[tuple[str, str, Callable[[], None]]]:
    """What `Engine.warmup` runs: (kind, what, a function that runs it once)."""
    buckets, chunk, length = engine.prompt_buckets, engine.prefill_chunk, engine.cache_length
    # A decode at each width and K (a step with a draft may emit K + 1 tokens), within the cache.
    ladder = engine.draft_policy.ladder if engine.draft_policy is not None else (0,)
    steps = max(1, min(len(engine.decode_widths) * sum(k + 1 for k in ladder) + 1, length - 1))
    request = Request([0], steps, GREEDY, logprobs=1, prompt_logprobs=True)
    entries = [(0, Completion(request, settings=engine.check(request)))]

    def enter(prefix_length: int | None, piece: int) -> None:  # the placeholder into slot 0
        prefix = None if prefix_length is None else engine.device.fresh_prefix(prefix_length)
        engine._insert(entries, engine._prefill(entries, prefix, 0, piece))

    prefix_cached = (sorted({cached_prefix_length(chunk, length, n) for n in (1, length)}) if engine._prefix_cache
                     else [])
    programs = [("prefill", f"prompts up to {b} tokens", functools.partial(enter, None, b)) for b in buckets]
    programs += [("prefill", f"pieces of up to {b} tokens after {n}", functools.partial(enter, n, b))
                 for n, b in pieces_after_prefixes(buckets, chunk, length, prefix_cached)]
    programs += [("prefix cache", f"loading and keeping {n} positions", functools.partial(engine._prefix_cache.warm, n))
                 for n in prefix_cached]
    programs += [("decode", f"{width} of {engine.num_slots} slots{f', {k} drafted tokens a step' * bool(k)}",
                  functools.partial(engine.device.decode, 1, False, width, [0], k))
                 for k in ladder for width in engine.decode_widths]
    programs += [("free", "slot 0", functools.partial(engine.device.free, np.arange(engine.num_slots) == 0))]
    return programs
