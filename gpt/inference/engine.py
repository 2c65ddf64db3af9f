"""The decoding engine: a fixed number of slots over one KV cache, fed from a bounded queue.

Each round (`step`), on the thread that owns the engine:
  1. cancelled requests give up their slots;
  2. waiting requests enter free slots, first come first served: their prompts run shortest first
     (`gpt.inference.decoding.prefill`, prompt lengths in buckets: `prompt_buckets`) and each gets its first token;
     a prompt longer than `prefill_chunk` tokens takes its slot but runs one chunk per round instead
     (`gpt.inference.decoding.extend`), so that the other slots go on decoding between its chunks; with a prefix
     pool (`prefix_cache_tokens`), a scored prompt takes that path too, starting after what the pool
     holds of its beginning;
  3. one call of `gpt.inference.decoding.decode` runs up to `steps_per_call` steps for every live slot (over the
     fewest compiled rows that hold them: `decode_widths`);
  4. new tokens go to their requests; finished slots become free.
Requests come and go between rounds, so a short request never waits for a long one to end (continuous
batching). Every sampling knob is a per-slot array, so no request's settings compile anything; `warmup`
compiles every shape the engine can run before it serves.

`generate` runs an engine on the caller's thread (`run`); `serve.py` runs one on a thread of its own
(`start` / `stop`) and submits requests from the HTTP handlers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from gpt.errors import ConfigError
from gpt.inference.decoding import (
    NO_TOKEN,
    PREFIX_BLOCK,
    Admission,
    Decoder,
    Prefix,
    Settings,
    compiled_decode,
    compiled_extend,
    compiled_init_pool,
    compiled_init_prefix,
    compiled_init_slots,
    compiled_load_prefix,
    compiled_prefill,
    compiled_programs,
    compiled_save_blocks,
)
from gpt.inference.prefix_cache import PrefixIndex
from gpt.inference.request import Request, check_request, is_int
from gpt.inference.sampling import SamplingParams
from gpt.inference.text_stream import TextStream
from gpt.model.backend import choices
from gpt.model.sharding import data_parallel_size
from gpt.model.transformer import GPT
from gpt.tokenizer import get_tokenizer

__all__ = ["Engine", "Completion", "QueueFull", "EngineStopped", "MIN_PROMPT_BUCKET", "prompt_buckets", "decode_widths"]

MIN_PROMPT_BUCKET = 16


class QueueFull(Exception):
    """The engine's queue holds `max_queue` waiting requests already (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


# A prefill's row that goes nowhere: over a mesh's data axis a prefill runs rows_per_prefill rows.
_PADDING = Request([0], 1, temperature=0.0)


class Completion:
    """A request's progress, written by the engine's thread and read by anyone.

    tokens, logprobs: the emitted tokens and their log-probabilities; top_logprobs: per token, a list of
    (id, logprob) for the request's `logprobs` most likely alternatives. prompt_logprobs,
    prompt_top_logprobs: the same for the prompt's tokens when the request asked (`Request.prompt_logprobs`),
    None for its first token (nothing comes before it); complete once the first token is (or, with
    max_tokens 0, once the request is done). stop_token: (id, logprob, alternatives) of the stop token
    that ended it, which is in neither `tokens` nor `text`; else None. text: a `TextStream` of the
    output (stop strings applied). finish_reason: None while running, then "stop" (a stop token or
    string), "length" (max_tokens reached) or "cancelled". `done` is set when it ends. `on_update`,
    when given, is called on the engine's thread after each batch of new tokens and at the end.
    """

    def __init__(self, request: Request, on_update: Callable[[Completion], None] | None = None,
                 settings: Settings | None = None):
        self.request, self.on_update = request, on_update
        self.settings = settings  # the request's knobs as host values (`Engine.check`)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.stop_token: tuple[int, float, list[tuple[int, float]]] | None = None
        self.prompt_logprobs: list[float | None] = [None] if request.prompt_logprobs else []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None] if request.prompt_logprobs else []
        self.text = TextStream(request.stop_strings)
        self.finish_reason: str | None = None
        self.done = threading.Event()
        self.cancel_requested = False

    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the engine's next round."""
        self.cancel_requested = True

    def _add(self, token: int, logprob: float, top: list[tuple[int, float]]) -> bool:
        """Record one token; True if it completed a stop string."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.request.logprobs:
            self.top_logprobs.append(top[: self.request.logprobs])
        return self.text.push(token) and bool(self.request.stop_strings)

    def _score_prompt(self, start: int, logprob_P: np.ndarray, top_ids_PJ: np.ndarray | None,
                      top_logprobs_PJ: np.ndarray | None) -> None:
        """Record the scores of the prompt's tokens start+1 .. (a piece of `PromptScores`, from position
        `start` on: position p scored the token after it)."""
        end = min(len(self.request.prompt), start + 1 + len(logprob_P))
        for p in range(end - start - 1):
            self.prompt_logprobs.append(float(logprob_P[p]))
            if self.request.logprobs:
                top = zip(top_ids_PJ[p, : self.request.logprobs], top_logprobs_PJ[p, : self.request.logprobs])
                self.prompt_top_logprobs.append([(int(t), float(lp)) for t, lp in top])
            else:
                self.prompt_top_logprobs.append([])

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.done.set()


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


@dataclasses.dataclass
class _Chunked:
    """Requests whose prompts run a chunk per round before they enter their slots (`Engine._advance`).

    entries: (slot, completion) per row; prefix: their prompts' cache so far (None for a pooled group
    until its turn: `Engine._load`); done: how many tokens of each prompt have run (of a shorter one,
    all); pooled: one scored prompt, loaded from the prefix pool and its blocks put there."""

    entries: list[tuple[int, Completion]]
    prefix: Prefix | None
    done: int = 0
    pooled: bool = False


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
        self._owners: list[Completion | None] = [None] * slots
        self._queue: collections.deque[Completion] = collections.deque()
        self._chunked: collections.deque[_Chunked] = collections.deque()  # the oldest runs its next chunk
        self._lock = threading.Condition()
        self._stopping = self._exit = False
        self._thread: threading.Thread | None = None
        self._cancel_S = np.zeros((slots,), np.bool_)  # slots to stop at the next decode call
        get_tokenizer()  # each Completion's text stream needs it: load it now, not on a request's clock
        self.tokens_emitted = 0  # a running total, for tokens/s
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
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue={self.max_queue})")
            self._queue.append(completion)
            self._lock.notify()
        return completion

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def live_slots(self) -> int:
        return sum(owner is not None for owner in self._owners)

    # -------------------------------------------------------------------------- the engine's own thread

    def step(self) -> bool:
        """One round (cancel, admit, decode, deliver). False when there was nothing to do."""
        for slot, owner in enumerate(self._owners):
            if owner is not None and owner.cancel_requested:
                self._release(slot, "cancelled")
        admitted = self._admit()
        advanced = self._advance()
        decoding = self._decoding()
        if not decoding:
            return admitted or advanced
        stop_at_finish = bool(self._queue)  # someone waits for a slot: come back as soon as one frees
        cancel_S, self._cancel_S = self._cancel_S, np.zeros((self.num_slots,), np.bool_)
        width = next(w for w in self.decode_widths if w >= len(decoding))
        emitted = self._decode(cancel_S, self.steps_per_call, stop_at_finish, width, decoding)
        self._deliver(list(range(self.num_slots)), emitted)
        return True

    def run(self, completions: Sequence[Completion]) -> None:
        """Run rounds on this thread until every one of `completions` has ended."""
        while not all(c.done.is_set() for c in completions):
            if not self.step():
                raise RuntimeError("the engine is idle but some completions never ended")

    def warmup(self, log: Callable[[str], None] = print) -> None:
        """Compile and run once every shape the engine runs (each prompt bucket's prefill, a chunked
        prompt's two, and the decode over each of `decode_widths` rows), with a progress line.

        Each shape runs for real, not only compiles: XLA's CPU runtime readies an op on its first run
        (~0.2 s over a GPT-2 124M decode step), and decode's loop runs no step while every slot is free.
        So a placeholder request (asking for logprobs and its prompt's, which take branches of their own) enters slot 0
        at every bucket, steps once at every width, and is cancelled: the slots end as they began, free.
        """
        if self._thread is not None or any(self._owners):
            raise RuntimeError("warmup runs before the engine serves: its placeholder borrows slot 0")
        buckets, chunk = self.prompt_buckets, self.prefill_chunk
        chunked = self.cache_length > chunk + 1  # a prompt of chunk + 1 tokens and one more fit
        # The last pieces that run over a prefix (prefix length, piece length): a chunked prompt's (at most
        # what follows its first chunk: the one of chunk + 1 tokens below runs the shortest), a pooled one's
        # (any, over either length its prefix may have).
        last = [(self.cache_length, b) for b in buckets[1: buckets.index(
            self._bucket(min(chunk, self.cache_length - chunk))) + 1]] if chunked else []
        pooled = sorted({self._pooled_length(1), self._pooled_length(self.cache_length)}) if self._index else []
        last += [(length, b) for length in pooled for b in buckets
                 if (length, b) not in last and not (chunked and (length, b) == (self.cache_length, buckets[0]))]
        shapes = [("prefill", f"prompts up to {length} tokens") for length in buckets]
        shapes += [("prefill", f"a longer prompt's chunks of {chunk} tokens")] * chunked
        shapes += [("prefill", f"last pieces of up to {b} tokens after {length}") for length, b in last]
        shapes += [("prefix pool", f"loading and keeping {length} positions") for length in pooled]
        shapes += [("decode", f"{width} of {self.num_slots} slots") for width in self.decode_widths]
        progress = iter(f"warm-up: compiling {kind} {i + 1}/{len(shapes)} ({what})"
                        for i, (kind, what) in enumerate(shapes))
        start = time.perf_counter()

        def placeholder(prompt_length: int) -> Completion:
            steps = max(1, min(len(self.decode_widths) + 1, self.cache_length - prompt_length))  # within the cache
            request = Request([0] * prompt_length, steps, temperature=0.0, logprobs=1, prompt_logprobs=True)
            return Completion(request, settings=self.check(request))

        for length in buckets:
            log(next(progress))
            self._prefill([(0, placeholder(1))], length)
        if chunked:
            log(next(progress))
            self._chunked.append(self._chunk_group([(0, placeholder(chunk + 1))]))  # its last piece: 1 token
            while self._chunked:
                self._advance(warmup=True)
        for length, b in last:
            log(next(progress))
            self._chunked.append(self._chunk_group([(0, placeholder(b))], length))  # one piece, the last
            self._advance(warmup=True)
        for length in pooled:
            log(next(progress))
            blocks = _blocks(length)
            with self._on_mesh():
                prefix = compiled_load_prefix(self.config, self._pool, np.zeros((blocks,), np.int32),
                                              np.zeros((length,), np.int32), np.int32(1))
                self._pool = compiled_save_blocks(self._pool, prefix, np.zeros((blocks,), np.int32),
                                                  np.full((blocks,), self._index.blocks, np.int32))  # skips them all
        for width in self.decode_widths:
            log(next(progress))
            jax.block_until_ready(self._decode(np.zeros((self.num_slots,), np.bool_), 1, False, width, []))
        self._cancel_S[0] = True  # the next decode call ends the placeholder, unless a request takes slot 0 first
        log(f"warm-up: done in {time.perf_counter() - start:.1f} s")

    def compiled_shapes(self) -> int:
        """How many programs the engine's jitted functions hold (for tests: no compile after warm-up)."""
        return compiled_programs()

    def start(self) -> None:
        """Run rounds on a background thread until `stop`."""
        self._thread = threading.Thread(target=self._serve_forever, name="engine", daemon=True)
        self._thread.start()

    def stop(self, deadline_s: float = 10.0) -> None:
        """Admit nothing new; let running and waiting requests finish for up to `deadline_s`, cancel the
        rest, and end the background thread."""
        with self._lock:
            self._stopping = True
        end = time.monotonic() + deadline_s
        while (self._queue or any(self._owners)) and time.monotonic() < end and self._thread is not None:
            time.sleep(0.01)
        with self._lock:
            for completion in self._queue:
                completion._finish("cancelled")
                self._notify(completion)
            self._queue.clear()
            for owner in self._owners:
                if owner is not None:
                    owner.cancel()
            self._exit = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def _serve_forever(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not any(self._owners) and not self._exit:
                    self._lock.wait()
                if self._exit and not self._queue and not any(self._owners):
                    return
            try:
                self.step()
            except Exception:  # a bug must not leave clients waiting forever: end what is running
                logging.getLogger(__name__).exception("engine round failed; ending the running requests")
                for slot, owner in enumerate(self._owners):
                    if owner is not None:
                        self._release(slot, "error")

    # ----------------------------------------------------------------------------------------- internals

    def _on_mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _admit(self) -> bool:
        """Move waiting requests into free slots, first come first served, and run their prompts shortest
        first, `rows_per_prefill` at a time. The round's last first token comes when it would in any
        order, and every other one sooner: a short prompt never waits behind a long one that came with
        it."""
        admitted = False
        while True:
            free = [slot for slot, owner in enumerate(self._owners) if owner is None]
            with self._lock:
                entering = []
                while self._queue and len(entering) < len(free):
                    completion = self._queue.popleft()
                    if completion.cancel_requested:
                        completion._finish("cancelled")
                        self._notify(completion)
                    else:
                        entering.append(completion)
            if not entering:
                return admitted
            entering.sort(key=lambda c: len(c.request.prompt))
            for slot, completion in zip(free, entering):
                self._owners[slot] = completion
            entries = list(zip(free, entering))
            for i in range(0, len(entries), self.rows_per_prefill):
                group = entries[i: i + self.rows_per_prefill]
                longest = max(len(c.request.prompt) for _, c in group)
                if self._index is not None and group[0][1].request.prompt_logprobs:  # one row: no mesh
                    self._chunked.append(_Chunked(group, None, pooled=True))  # loaded at its turn: `_advance`
                    continue
                if longest > self.prefill_chunk:  # its slots wait, owned, until its last chunk (`_advance`)
                    self._chunked.append(self._chunk_group(group))
                    continue
                self._deliver([slot for slot, _ in group], self._prefill(group, self._bucket(longest))[0])
            admitted = True

    def _decode(self, cancel_S: np.ndarray, num_steps: int, stop_at_finish: bool, width: int, decoding: list[int]):
        """One decode call over `width` rows (one of `decode_widths`) that hold the `decoding` slots."""
        rows_R = None
        if width < self.num_slots:  # the decoding slots, then others: distinct rows
            rows_R = np.asarray((decoding + [s for s in range(self.num_slots) if s not in decoding])[:width], np.int32)
        with self._on_mesh():
            self._slots, emitted = compiled_decode(
                self.config, self.weights, self._slots, cancel_S, np.int32(num_steps), np.bool_(stop_at_finish),
                max_steps=self.steps_per_call, rows_R=rows_R)
        return emitted

    def _prefilling(self) -> set[int]:
        """The slots whose requests' prompts are still running their chunks."""
        return {slot for group in self._chunked for slot, c in group.entries if self._owners[slot] is c}

    def _decoding(self) -> list[int]:
        """The slots whose requests decode: owned, and past their prompts."""
        prefilling = self._prefilling()
        return [slot for slot, owner in enumerate(self._owners) if owner is not None and slot not in prefilling]

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

    def _prefill(self, entries: list[tuple[int, Completion]], length: int, prefix: Prefix | None = None,
                 start: int = 0):
        """One prefill of `rows_per_prefill` rows (entries, then padding rows that go nowhere): their
        prompts from token `start` on (all of them, after `prefix`), in `length` positions. An entry whose
        slot is None goes nowhere too (a chunked request cancelled: its row of `prefix` stays in place),
        and so does one that asked for at most one token (it never decodes). Returns the Emitted and the rows'
        Prefix; the prompt scores go to the entries that asked."""
        b = self.rows_per_prefill
        requests = self._rows(entries)
        settings = [c.settings for _, c in entries]
        if len(entries) < b:  # only over a mesh's data axis
            settings += [self._settings(_PADDING, ())] * (b - len(entries))
        tokens, lengths = self._piece(entries, start, length)
        # A request of at most one token ends with this prefill: it never decodes, so it enters no slot.
        entering = [None if slot is None or c.request.max_tokens <= 1 else slot for slot, c in entries]
        self._cancel_S[[slot for slot in entering if slot is not None]] = False  # their device state is new
        slots = [self.num_slots if slot is None else slot for slot in entering]
        slots += [self.num_slots] * (b - len(entries))  # past the end: dropped
        admission = Admission(
            tokens=tokens, lengths=lengths, targets=self._piece(entries, start + 1, length)[0],
            score=np.asarray([r.prompt_logprobs for r in requests], np.bool_), slots=np.asarray(slots, np.int32),
            max_tokens=np.asarray([r.max_tokens for r in requests], np.int32),
            settings=jax.tree.map(lambda *rows: np.stack(rows), *settings))
        with self._on_mesh():
            self._slots, emitted, scores, prefix = compiled_prefill(self.config, self.weights, self._slots, admission,
                                                                    prefix)
        self._deliver_scores(entries, start, scores)
        return emitted, prefix

    def _extend(self, group: _Chunked) -> None:
        """Run the next chunk of a group's prompts into its prefix, and deliver its prompt scores."""
        entries, start, chunk = group.entries, group.done, self.prefill_chunk
        requests = self._rows(entries)
        with self._on_mesh():
            group.prefix, scores = compiled_extend(
                self.config, self.weights, group.prefix, *self._piece(entries, start, chunk),
                self._piece(entries, start + 1, chunk)[0], np.asarray([r.prompt_logprobs for r in requests], np.bool_),
                np.asarray([r.logprobs > 0 for r in requests], np.bool_))
        group.done += chunk
        self._deliver_scores(entries, start, scores)

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

    def _load(self, group: _Chunked) -> None:
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
        with self._on_mesh():
            if done <= 0:
                group.prefix = compiled_init_prefix(self.config, 1, length)
                return
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

    def _chunk_group(self, entries: list[tuple[int, Completion]], length: int | None = None) -> _Chunked:
        """A group whose prompts run after a fresh prefix of `length` positions (default: the cache's)."""
        length = self.cache_length if length is None else length
        with self._on_mesh():
            return _Chunked(entries, compiled_init_prefix(self.config, self.rows_per_prefill, length))

    def _advance(self, warmup: bool = False) -> bool:
        """Run the next chunk of the oldest chunked prompts; with their last, they enter their slots and
        get their first tokens. False when no prompt was waiting on chunks."""
        while self._chunked:
            group = self._chunked[0]
            # A request cancelled (and released) meanwhile goes nowhere, its slot perhaps another's already;
            # its row still runs, so that each other row stays where its cache is.
            entries = [(slot if warmup or self._owners[slot] is c else None, c) for slot, c in group.entries]
            if any(slot is not None for slot, _ in entries):
                break
            self._chunked.popleft()
        else:
            return False
        if group.prefix is None:
            self._load(group)
        chunk, longest = self.prefill_chunk, max(len(c.request.prompt) for _, c in group.entries)
        if group.done + chunk < longest:
            self._extend(group)
            return True
        self._chunked.popleft()
        emitted, prefix = self._prefill(entries, self._bucket(longest - group.done), group.prefix, group.done)
        if group.pooled and entries[0][0] is not None and not warmup:
            self._keep(entries[0][1], prefix)
        if not warmup:
            self._deliver([slot for slot, _ in entries], emitted)
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

    def _deliver(self, slots: list[int | None], emitted) -> None:
        """Hand each slot's new tokens to its request (row i of `emitted` is slot slots[i], or nowhere for
        None); free the slots whose request ended. Slots whose prompts are still running their chunks are
        left alone."""
        token, stop_token = np.asarray(emitted.token), np.asarray(emitted.stopped)
        steps = int(emitted.steps)
        logprob, live = np.asarray(emitted.logprob), np.asarray(emitted.live)
        prefilling = self._prefilling()
        owners = [None if slot is None or slot in prefilling else self._owners[slot] for slot in slots]
        wants_top = any(owner is not None and owner.request.logprobs for owner in owners)
        top_ids, top_lps = (np.asarray(emitted.top_ids), np.asarray(emitted.top_logprobs)) if wants_top else (None, None)
        for row, (slot, owner) in enumerate(zip(slots, owners)):
            if owner is None:
                continue
            before = len(owner.tokens)
            stopped = False
            for i in range(steps):
                if token[i, row] == NO_TOKEN:
                    break
                top = ([(int(t), float(lp)) for t, lp in zip(top_ids[i, row], top_lps[i, row])]
                       if top_ids is not None else [])
                if stop_token[i, row]:  # it ends the request unemitted; the device's slot is free already
                    owner.stop_token = (int(token[i, row]), float(logprob[i, row]), top[: owner.request.logprobs])
                    break
                if owner._add(int(token[i, row]), float(logprob[i, row]), top):
                    stopped = True
                    break
            self.tokens_emitted += len(owner.tokens) - before
            if stopped:
                owner.cancel()  # the device slot is still live: stop it at the next round
                owner._finish("stop")
                self._notify(owner)
            elif not live[row]:
                self._release(slot, "length" if len(owner.tokens) >= owner.request.max_tokens else "stop")
            elif len(owner.tokens) > before:
                self._notify(owner)

    def _release(self, slot: int, reason: str) -> None:
        owner = self._owners[slot]
        self._owners[slot] = None
        self._cancel_S[slot] = True  # the device may still count it live (a stop string, a cancel)
        if not owner.done.is_set():
            owner._finish(reason)
            self._notify(owner)

    @staticmethod
    def _notify(completion: Completion) -> None:
        if completion.on_update is not None:
            completion.on_update(completion)
