"""The decoding engine: a fixed number of slots over one KV cache, fed from a bounded queue.

Each round (`step`), on the thread that owns the engine, through the device's four verbs
(`gpt.inference.decoding`: prefill, insert, decode, free):
  1. cancelled requests give up their slots (`free`);
  2. waiting requests enter free slots, first come first served: their prompts run shortest first
     (`prefill`, prompt lengths in buckets: `prompt_buckets`), then `insert` puts them in their slots,
     each with its first token; a prompt longer than `prefill_chunk` tokens takes its slot but runs one
     chunk per round instead, and is inserted after its last, so that the other slots go on decoding
     between its chunks; with a prefix pool (`prefix_cache_tokens`), a scored prompt takes that path
     too, starting after what the pool holds of its beginning;
  3. one `decode` runs up to `steps_per_call` steps for every live slot (over the fewest compiled rows
     that hold them: `decode_widths`);
  4. new tokens go to their requests; finished slots become free.
Requests come and go between rounds, so a short request never waits for a long one to end (continuous
batching). Every sampling knob is a per-slot array, so no request's settings compile anything; `warmup`
compiles every shape the engine can run before it serves.

The decisions of steps 1, 2 and 4 (which request enters which slot, which way its prompt runs, which
chunk runs next, what a decode's tokens do to their requests) are `gpt.inference.scheduler`'s, with no
JAX; the engine runs the device programs of `gpt.inference.decoding` they call for.

`generate` runs an engine on the caller's thread (`run`); `serve.py` runs one on a thread of its own
(`start` / `stop`) and submits requests from the HTTP handlers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from gpt.errors import ConfigError
from gpt.inference.completion import Completion
from gpt.inference.decoding import (
    PREFIX_BLOCK,
    Admission,
    Decoder,
    Prefix,
    Settings,
    compiled_decode,
    compiled_free,
    compiled_init_pool,
    compiled_init_prefix,
    compiled_init_slots,
    compiled_insert,
    compiled_load_prefix,
    compiled_prefill,
    compiled_programs,
    compiled_save_blocks,
)
from gpt.inference.prefix_cache import PrefixIndex
from gpt.inference.request import Request, check_request, is_int
from gpt.inference.sampling import SamplingParams
from gpt.inference.scheduler import Chunked, Scheduler
from gpt.model.backend import choices
from gpt.model.sharding import data_parallel_size
from gpt.model.transformer import GPT
from gpt.tokenizer import get_tokenizer

__all__ = ["Engine", "MIN_PROMPT_BUCKET", "prompt_buckets", "decode_widths"]

MIN_PROMPT_BUCKET = 16


# A prefill's row that goes nowhere: over a mesh's data axis a prefill (and an insert) runs
# rows_per_prefill rows.
_PADDING = Request([0], 1, temperature=0.0)


def decode_widths(num_slots: int, mesh: Mesh | None) -> list[int]:
    """The numbers of rows a decode call is compiled for: on a CPU, powers of two below the slot count
    and the slot count (a call runs the fewest that hold every live slot: a step over 8 rows costs about
    twice one over 1 there); elsewhere, or over a mesh, the slot count alone (a GPU's step costs about
    the same for 1 row as for 8)."""
    if mesh is not None or not choices().narrow_decodes:
        return [num_slots]
    return [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots] + [num_slots]


def prompt_buckets(longest: int) -> list[int]:
    """The prompt lengths a prefill is compiled for: 16, 32, then each power of two and one and a half
    times it (48, 64, 96, 128, 192, ...) below `longest` (the cache length, or the prefill chunk), and
    `longest`. A prompt runs in the smallest that holds it: at most a third of a prefill is padding
    (with powers of two alone, up to half), for a few more programs to compile."""
    buckets, n = [], MIN_PROMPT_BUCKET
    while n < longest:
        buckets += [n] + ([n * 3 // 2] if n >= 2 * MIN_PROMPT_BUCKET and n * 3 // 2 < longest else [])
        n *= 2
    return buckets + [longest]


def _blocks(length: int) -> int:
    """How many prefix-pool blocks cover `length` positions (a load or a save of a prefix that long)."""
    return -(-length // PREFIX_BLOCK)


class Engine:
    """Slots over one KV cache and a bounded queue; see the module docstring.

    Args:
      model: the GPT to decode with (its weights are laid out for decoding here), or a `Decoder` made once
        for many engines.
      slots: how many requests decode together (rounded up to a multiple of the mesh's data-parallel size).
      cache_length: positions per slot, prompt + output (default and bound: the model's context).
      max_queue: the most requests waiting for a slot; `submit` raises QueueFull beyond it.
      steps_per_call: decode steps per device call; more amortize dispatch, fewer admit sooner.
      prefill_chunk: the longest prompt that runs in one prefill; a longer one runs in chunks of this
        many tokens, one per round, so that the live slots wait at most one chunk's time for it (and
        no prefill longer than it is compiled). At least 16; the cache length or more turns it off.
      max_stop_tokens: the most stop tokens a request may give.
      prefix_cache_tokens: positions of scored prompts (`Request.prompt_logprobs`) kept after their
        prefills (`gpt.inference.prefix_cache`), so that one that begins like an earlier one runs only the rest;
        0 keeps none. Costs their keys and values (GPT-2 124M in float32: 72 KB a position), and scored
        prompts then run after a prefix of the prefill chunk's length (or the cache's, for a longer
        prompt). Not over a mesh's data axis.
      quantize: how the weights are stored for decoding: "none" (float32, the default), "int8" or "bf16"
        (`gpt.inference.decoding.decoding_weights`); a Decoder's own.
      mesh: run sharded over this mesh (`gpt.model.sharding.make_mesh`); a Decoder's own.
    """

    def __init__(self, model: GPT | Decoder, *, slots: int = 8, cache_length: int | None = None,
                 max_queue: int = 64, steps_per_call: int = 1, max_stop_tokens: int = 8,
                 prefill_chunk: int = 256, prefix_cache_tokens: int = 0, quantize: str | None = None,
                 mesh: Mesh | None = None):
        config = model.config
        cache_length = config.block_size if cache_length is None else cache_length
        if not is_int(cache_length) or not 1 <= cache_length <= config.block_size:
            raise ConfigError(
                f"cache_length must be in [1, {config.block_size}] (the model's context), got {cache_length}")
        for name, value in dict(slots=slots, max_queue=max_queue, steps_per_call=steps_per_call,
                                max_stop_tokens=max_stop_tokens).items():
            if not is_int(value) or value < 1:
                raise ConfigError(f"Engine {name} must be an integer >= 1, got {value!r}")
        if not is_int(prefix_cache_tokens) or prefix_cache_tokens < 0:
            raise ConfigError(f"Engine prefix_cache_tokens must be an integer >= 0, got {prefix_cache_tokens!r}")
        if not is_int(prefill_chunk) or prefill_chunk < MIN_PROMPT_BUCKET:
            raise ConfigError(
                f"Engine prefill_chunk must be an integer >= {MIN_PROMPT_BUCKET}, got {prefill_chunk!r}")
        slots, max_queue, steps_per_call, max_stop_tokens, cache_length, prefill_chunk = map(
            int, (slots, max_queue, steps_per_call, max_stop_tokens, cache_length, prefill_chunk))
        decoder = Decoder.of(model, quantize, mesh)
        mesh = decoder.mesh
        self.rows_per_prefill = data_parallel_size(mesh) if mesh is not None else 1
        slots = -(-slots // self.rows_per_prefill) * self.rows_per_prefill
        self.config, self.num_slots, self.cache_length = config, slots, cache_length
        self.max_queue, self.steps_per_call, self.max_stop_tokens = max_queue, steps_per_call, max_stop_tokens
        self.prefill_chunk = min(prefill_chunk, cache_length)
        self.prompt_buckets = prompt_buckets(self.prefill_chunk)
        self.mesh, self.weights = mesh, decoder.weights
        with self._on_mesh():
            self._slots = compiled_init_slots(config, slots, cache_length, max_stop_tokens)
        self.decode_widths = decode_widths(slots, mesh)
        blocks = int(prefix_cache_tokens) // PREFIX_BLOCK if self.rows_per_prefill == 1 else 0
        self._index = PrefixIndex(blocks, PREFIX_BLOCK) if blocks else None
        with self._on_mesh():
            self._pool = compiled_init_pool(config, blocks) if blocks else None
        self._scheduler = Scheduler(slots, max_queue, self.rows_per_prefill, self.prefill_chunk, self._index is not None)
        self._thread: threading.Thread | None = None
        get_tokenizer()  # each Completion's text stream needs it: load it now, not on a request's clock
        self.prompt_tokens_reused = 0  # prompt positions loaded from the prefix pool instead of run

    # ------------------------------------------------------------------------------ clients (any thread)

    def check(self, request: Request) -> Settings:
        """Raise ConfigError naming the first field of `request` outside its bound (nothing compiles);
        else return its knobs as host values (a row of an admission's settings). Whatever a client sends
        fails here, on its own thread, never in a round, where it would end every running request."""
        stops = check_request(request, self.config.vocab_size, self.cache_length, self.max_stop_tokens)
        return self._settings(request, stops)

    def submit(self, request: Request, on_update: Callable[[Completion], None] | None = None) -> Completion:
        """Queue a request (checked first); returns its Completion. Raises ConfigError, QueueFull or
        EngineStopped."""
        completion = Completion(request, on_update, self.check(request))
        self._scheduler.submit(completion)
        return completion

    @property
    def queue_depth(self) -> int:
        return self._scheduler.queue_depth

    @property
    def live_slots(self) -> int:
        return self._scheduler.live_slots

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
        width = next(w for w in self.decode_widths if w >= len(decoding))
        emitted = self._decode(self.steps_per_call, stop_at_finish, width, decoding)
        self._scheduler.deliver(list(range(self.num_slots)), emitted)
        return True

    def run(self, completions: Sequence[Completion]) -> None:
        """Run rounds on this thread until every one of `completions` has ended."""
        while not all(c.done.is_set() for c in completions):
            if not self.step():
                raise RuntimeError("the engine is idle but some completions never ended")

    def warmup(self, log: Callable[[str], None] = print) -> None:
        """Compile and run once every program the engine runs, through the four verbs, with a progress line:
        each prompt bucket's prefill, a chunked prompt's and a pooled one's pieces, the inserts after
        each prefix length, the prefix pool's loads and saves, the decode over each of `decode_widths` rows,
        and the free.

        Each runs for real, not only compiles: XLA's CPU runtime readies an op on its first run (~0.2 s over
        a GPT-2 124M decode step), and decode's loop runs no step while every slot is free. So a placeholder
        prompt (asking for its scores and logprobs, which take branches of their own) runs each piece and
        enters slot 0, decodes a step at each width, and slot 0 is freed: the slots end as they began.
        """
        if self._thread is not None or self._scheduler.live_slots:
            raise RuntimeError("warmup runs before the engine serves: its placeholder borrows slot 0")
        programs = self._warmup_programs()
        start = time.perf_counter()
        for i, (kind, what, run) in enumerate(programs):
            log(f"warm-up: compiling {kind} {i + 1}/{len(programs)} ({what})")
            run()
        jax.block_until_ready(self._slots)  # the time below includes the last program's run
        log(f"warm-up: done in {time.perf_counter() - start:.1f} s")

    def _warmup_programs(self) -> list[tuple[str, str, Callable[[], None]]]:
        """What `warmup` runs: (kind, what, a function that runs it once)."""
        buckets, chunk, length = self.prompt_buckets, self.prefill_chunk, self.cache_length
        steps = max(1, min(len(self.decode_widths) + 1, length - 1))  # a step at each width, within the cache
        request = Request([0], steps, temperature=0.0, logprobs=1, prompt_logprobs=True)
        entries = [(0, Completion(request, settings=self.check(request)))]

        def enter(prefix_length: int | None, piece: int) -> None:  # the placeholder into slot 0
            prefix = None if prefix_length is None else self._fresh_prefix(prefix_length)
            self._insert(entries, self._prefill(entries, prefix, 0, piece))

        # The pieces that run over a given prefix (its length, theirs): a chunked prompt's chunks, then its
        # last piece (at most what follows its first chunk); a pooled prompt's (any, over either length
        # its prefix may have).
        chunked = length > chunk + 1  # a prompt of chunk + 1 tokens and one more fit
        given = {(length, chunk)} | {(length, b) for b in buckets if b <= self._bucket(min(chunk, length - chunk))}
        given = given if chunked else set()
        pooled = sorted({self._pooled_length(1), self._pooled_length(length)}) if self._index else []
        given |= {(n, b) for n in pooled for b in buckets}
        programs = [("prefill", f"prompts up to {b} tokens", functools.partial(enter, None, b)) for b in buckets]
        programs += [("prefill", f"pieces of up to {b} tokens after {n}", functools.partial(enter, n, b))
                     for n, b in sorted(given)]
        programs += [("prefix pool", f"loading and keeping {n} positions", functools.partial(self._warm_pool, n))
                     for n in pooled]
        programs += [("decode", f"{width} of {self.num_slots} slots",
                      functools.partial(self._decode, 1, False, width, [0])) for width in self.decode_widths]
        programs += [("free", "slot 0", functools.partial(self._free_slots, np.arange(self.num_slots) == 0))]
        return programs

    def _warm_pool(self, length: int) -> None:
        """A load from the prefix pool and a save to it (of no block) of a prefix of `length` positions."""
        blocks = _blocks(length)
        with self._on_mesh():
            prefix = compiled_load_prefix(self.config, self._pool, np.zeros((blocks,), np.int32),
                                          np.zeros((length,), np.int32), np.int32(1))
            self._pool = compiled_save_blocks(self._pool, prefix, np.zeros((blocks,), np.int32),
                                              np.full((blocks,), self._index.blocks, np.int32))  # skips them all

    def compiled_shapes(self) -> int:
        """How many programs the engine's jitted functions hold (for tests: no compile after warm-up)."""
        return compiled_programs()

    def start(self) -> None:
        """Run rounds on a background thread until `stop`."""
        self._thread = threading.Thread(target=self._serve_forever, name="engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Admit nothing new (`submit` raises EngineStopped); what runs or waits goes on."""
        with self._scheduler.lock:
            self._scheduler.stopping = True

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
        scheduler = self._scheduler
        while True:
            with scheduler.lock:
                while scheduler.idle and not scheduler.exit:
                    scheduler.lock.wait()
                if scheduler.exit and scheduler.idle:
                    return
            try:
                self.step()
            except Exception:  # a bug must not leave clients waiting forever: end what is running
                logging.getLogger(__name__).exception("engine round failed; ending the running requests")
                scheduler.release_all("error")

    # ----------------------------------------------------------------------------------------- internals

    def _on_mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _admit(self) -> bool:
        """Move waiting requests into free slots and run their prompts (`Scheduler.admit`), again while
        requests that end with their prefills free slots for more."""
        admitted = False
        while groups := self._scheduler.admit():
            for way, group in groups:
                if way == "pooled":
                    self._scheduler.add_chunked(Chunked(group, None, pooled=True))  # loaded at its turn: `_advance`
                elif way == "chunked":
                    self._scheduler.add_chunked(Chunked(group, self._fresh_prefix(self.cache_length)))
                else:
                    longest = max(len(c.request.prompt) for _, c in group)
                    prefix = self._prefill(group, None, 0, self._bucket(longest))
                    self._scheduler.deliver([slot for slot, _ in group], self._insert(group, prefix))
            admitted = True
        return admitted

    def _free(self) -> None:
        """Stop on the device the slots the scheduler released since the last round."""
        free_S = self._scheduler.take_frees()
        if free_S.any():
            self._free_slots(free_S)

    def _free_slots(self, free_S: np.ndarray) -> None:
        with self._on_mesh():
            self._slots = compiled_free(self._slots, free_S)

    def _decode(self, num_steps: int, stop_at_finish: bool, width: int, decoding: list[int]):
        """One decode call over `width` rows (one of `decode_widths`) that hold the `decoding` slots."""
        rows_R = None
        if width < self.num_slots:  # the decoding slots, then others: distinct rows
            rows_R = np.asarray((decoding + [s for s in range(self.num_slots) if s not in decoding])[:width], np.int32)
        with self._on_mesh():
            self._slots, emitted = compiled_decode(
                self.config, self.weights, self._slots, np.int32(num_steps), np.bool_(stop_at_finish),
                max_steps=self.steps_per_call, rows_R=rows_R)
        return emitted

    def _rows(self, entries: list[tuple[int | None, Completion]]) -> list[Request]:
        """The requests of a prefill's `rows_per_prefill` rows: the entries', then padding."""
        return [c.request for _, c in entries] + [_PADDING] * (self.rows_per_prefill - len(entries))

    def _piece(self, entries: list[tuple[int | None, Completion]], start: int, length: int):
        """Tokens start..start+length-1 of each row's prompt (`_rows`): (int32 [b, length] right-padded,
        their real lengths int32 [b])."""
        pieces = [request.prompt[start: start + length] for request in self._rows(entries)]
        tokens = np.zeros((len(pieces), length), np.int32)
        for row, piece in enumerate(pieces):
            tokens[row, : len(piece)] = piece
        return tokens, np.asarray([len(piece) for piece in pieces], np.int32)

    def _prefill(self, entries: list[tuple[int | None, Completion]], prefix: Prefix | None, start: int,
                 length: int) -> Prefix:
        """Run tokens start..start+length-1 of each row's prompt (`_rows`: the entries', then padding) into
        `prefix` (None: a fresh one of `length` positions), and hand the prompt scores to the entries that
        asked. Returns the prefix."""
        requests = self._rows(entries)
        tokens, lengths = self._piece(entries, start, length)
        targets = self._piece(entries, start + 1, length)[0]
        score = np.asarray([r.prompt_logprobs for r in requests], np.bool_)
        top = np.asarray([r.logprobs > 0 for r in requests], np.bool_)
        with self._on_mesh():
            prefix, scores = compiled_prefill(self.config, self.weights, prefix, tokens, lengths, targets, score, top)
        self._deliver_scores(entries, start, scores)
        return prefix

    def _insert(self, entries: list[tuple[int | None, Completion]], prefix: Prefix):
        """Move the entries' prompts (rows of `prefix`, run to their ends) into their slots, each with its
        first token; returns the Emitted [1, rows]. A padding row goes nowhere, and so does an entry whose
        slot is None (a chunked request cancelled: its row of `prefix` ran anyway, so that each other row
        stays where its cache is) or that asked for at most one token (it never decodes)."""
        b = self.rows_per_prefill
        settings = [c.settings for _, c in entries] + [self._settings(_PADDING, ())] * (b - len(entries))
        entering = self._scheduler.entering([slot for slot, _ in entries], [c for _, c in entries])
        slots = [self.num_slots if slot is None else slot for slot in entering]
        slots += [self.num_slots] * (b - len(entries))  # past the end: dropped
        admission = Admission(slots=np.asarray(slots, np.int32),
                              max_tokens=np.asarray([r.max_tokens for r in self._rows(entries)], np.int32),
                              settings=jax.tree.map(lambda *rows: np.stack(rows), *settings))
        with self._on_mesh():
            self._slots, emitted = compiled_insert(self.config, self.weights, self._slots, prefix, admission)
        return emitted

    def _deliver_scores(self, entries: list[tuple[int | None, Completion]], start: int, scores) -> None:
        """Hand each entry that asked its prompt's `PromptScores` for the piece from token `start` on
        (row i is entries[i]); read from the device only when one asked."""
        asked = [(row, c) for row, (_, c) in enumerate(entries) if c.request.prompt_logprobs]
        if not asked:
            return
        logprob = np.asarray(scores.logprob)
        top = any(c.request.logprobs for _, c in asked)
        top_ids, top_lps = (np.asarray(scores.top_ids), np.asarray(scores.top_logprobs)) if top else (None, None)
        for row, c in asked:
            c._score_prompt(start, logprob[row], top_ids[row] if top else None, top_lps[row] if top else None)

    def _bucket(self, length: int) -> int:
        """The prefill length that a piece of `length` tokens runs in."""
        return next(b for b in self.prompt_buckets if b >= length)

    def _pooled_length(self, prompt_length: int) -> int:
        """The length of a pooled prompt's prefix: the prefill chunk for a prompt that fits one (a cache of
        the full length would cost each of them a copy of it), else the cache length."""
        return self.prefill_chunk if prompt_length <= self.prefill_chunk else self.cache_length

    def _load(self, group: Chunked) -> None:
        """A pooled group's prefix, at its turn (so that the choices of one item, admitted together, find
        the blocks the first of them leaves): loaded from the prefix pool as far as the pool holds the
        prompt's beginning (the last token held, or the prompt's last, runs again: what follows it needs
        its output); `_advance` runs the rest."""
        completion = group.entries[0][1]
        request = completion.request
        length = self._pooled_length(len(request.prompt))
        held = self._index.match(request.prompt, request.logprobs)
        group.done = min(len(held) * PREFIX_BLOCK - 1, len(request.prompt) - 1) if held else 0
        done = group.done
        if done <= 0:
            group.prefix = self._fresh_prefix(length)
            return
        with self._on_mesh():
            self.prompt_tokens_reused += done
            for logprob, top in [score for _, scores in held for score in scores][1: done + 1]:
                completion.prompt_logprobs.append(logprob)
                completion.prompt_top_logprobs.append(top)
            ids = np.zeros((_blocks(length),), np.int32)
            ids[: len(held)] = [block for block, _ in held]
            tokens = np.zeros((length,), np.int32)
            tokens[: len(request.prompt)] = request.prompt
            group.prefix = compiled_load_prefix(self.config, self._pool, ids, tokens, np.int32(done))

    def _keep(self, completion: Completion, prefix: Prefix) -> None:
        """Put a scored prompt's whole blocks (row 0 of `prefix`, run to its end) in the prefix pool."""
        request = completion.request
        scores = list(zip(completion.prompt_logprobs, completion.prompt_top_logprobs))
        added = self._index.add(request.prompt, request.logprobs, scores)
        if not added:
            return
        blocks = _blocks(prefix.cache.length)
        starts, ids = np.zeros((blocks,), np.int32), np.full((blocks,), self._index.blocks, np.int32)  # past the end: skipped
        starts[: len(added)], ids[: len(added)] = zip(*added)
        with self._on_mesh():
            self._pool = compiled_save_blocks(self._pool, prefix, starts, ids)

    def _fresh_prefix(self, length: int) -> Prefix:
        """An empty Prefix of `rows_per_prefill` rows and `length` positions, for pieces to run into."""
        with self._on_mesh():
            return compiled_init_prefix(self.config, self.rows_per_prefill, length)

    def _advance(self) -> bool:
        """Run the next chunk of the oldest chunked prompts; after their last, insert them into their slots
        with their first tokens. False when no prompt was waiting on chunks."""
        waiting = self._scheduler.next_chunked()
        if waiting is None:
            return False
        group, entries = waiting
        if group.prefix is None:
            self._load(group)
        chunk, longest = self.prefill_chunk, max(len(c.request.prompt) for _, c in group.entries)
        if group.done + chunk < longest:
            group.prefix = self._prefill(entries, group.prefix, group.done, chunk)
            group.done += chunk
            return True
        self._scheduler.finish_chunked()
        prefix = self._prefill(entries, group.prefix, group.done, self._bucket(longest - group.done))
        if group.pooled and entries[0][0] is not None:
            self._keep(entries[0][1], prefix)
        self._scheduler.deliver([slot for slot, _ in entries], self._insert(entries, prefix))
        return True

    def _settings(self, request: Request, stops: tuple[int, ...]) -> Settings:
        """A request's knobs as host scalars (one row of an Admission's settings); `stops`: its stop tokens,
        as `check_stop_tokens` returned them."""
        stop_tokens = np.full((self.max_stop_tokens,), -2, np.int32)
        stop_tokens[: len(stops)] = stops
        params = SamplingParams.create(request.temperature, request.top_k, request.top_p, request.min_p,
                                       request.repetition_penalty)
        seed, stream = (np.uint32(int(n) % 2**32) for n in (request.seed, request.stream))  # int(): a numpy seed too
        return Settings(params=params, seed=seed, stream=stream, stop_tokens=stop_tokens,
                        top_logprobs=np.bool_(request.logprobs > 0))
