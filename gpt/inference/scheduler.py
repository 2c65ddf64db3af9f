"""The engine's host side, with no JAX: which requests wait, which slot each holds, how the requests
entering together are grouped and which way each group's prompts run, which chunked prompts run next,
and what a decode's tokens do to their requests. `gpt.inference.engine` runs the device programs it
asks for; tests/test_scheduler.py runs it with no model and nothing compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from gpt.inference.completion import Completion

__all__ = ["Scheduler", "Chunked", "QueueFull", "EngineStopped"]


class QueueFull(Exception):
    """The engine's queue holds `max_queue` waiting requests already (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


@dataclasses.dataclass
class Chunked:
    """Requests whose prompts run a chunk per round before they enter their slots.

    entries: (slot, completion) per row; prefix: their prompts' cache so far, a device object the
    scheduler never reads (None for a prefix-cached group until its turn); done: how many tokens of each prompt
    have run (of a shorter one, all); prefix_cached: one scored prompt, loaded from the prefix cache and its
    blocks put there."""

    entries: list[tuple[int, Completion]]
    prefix: object | None
    done: int = 0
    prefix_cached: bool = False

    def ran(self, prefix: object, tokens: int) -> None:
        """Its prompts ran `tokens` more tokens each (a chunk, or what the prefix cache held), into `prefix`."""
        self.prefix, self.done = prefix, self.done + tokens


class Scheduler:
    """Slots and their owners, the bounded queue, and the chunked prompts' order.

    Args:
      num_slots: the engine's slots.
      max_queue: the most requests waiting for a slot (`submit` raises QueueFull beyond it).
      rows_per_prefill: rows of one prefill (a mesh's data-parallel size; 1 without a mesh).
      prefill_chunk: the longest prompt that runs whole; a longer one runs in chunks.
      prefix_cached: scored prompts go through the prefix cache (they run as chunked groups of one row).
    """

    def __init__(self, num_slots: int, max_queue: int, rows_per_prefill: int = 1, prefill_chunk: int = 256,
                 prefix_cached: bool = False):
        self.num_slots, self.max_queue, self.rows_per_prefill = num_slots, max_queue, rows_per_prefill
        self.prefill_chunk, self.prefix_cached = prefill_chunk, prefix_cached
        self.owners: list[Completion | None] = [None] * num_slots
        self.queue: collections.deque[Completion] = collections.deque()
        self.chunked: collections.deque[Chunked] = collections.deque()  # the oldest runs its next chunk
        self.lock = threading.Condition()
        self.stopping = self.exit = False
        self.free_S = np.zeros((num_slots,), np.bool_)  # slots for the device to free at the next round
        self.tokens_emitted = 0  # a running total, for tokens/s

    # ------------------------------------------------------------------------------ clients (any thread)

    def submit(self, completion: Completion) -> None:
        """Queue a checked request. Raises QueueFull or EngineStopped."""
        with self.lock:
            if self.stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are waiting already (max_queue={self.max_queue})")
            self.queue.append(completion)
            completion.waits_in(self._withdraw)
            self.lock.notify()

    def _withdraw(self, completion: Completion) -> None:
        """A cancelled request leaves the queue at once (a client gone while it waited holds no place that a
        new one could have), ending with its reason."""
        with self.lock:
            try:
                self.queue.remove(completion)
            except ValueError:  # admitted already (the engine frees its slot) or gone
                return
        completion.end(completion.cancel_reason)

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def live_slots(self) -> int:
        return sum(owner is not None for owner in self.owners)

    @property
    def idle(self) -> bool:
        return not self.queue and not any(self.owners)

    def drain(self) -> None:
        """Take nothing new (`submit` raises EngineStopped); what runs or waits goes on."""
        with self.lock:
            self.stopping = True

    def wait_for_work(self) -> bool:
        """Block until there is a round to run (True), or until `cancel_everything` ended it all (False)."""
        with self.lock:
            while self.idle and not self.exit:
                self.lock.wait()
            return not (self.exit and self.idle)

    # -------------------------------------------------------------------------- the engine's own thread

    def release_cancelled(self) -> None:
        """Free the slots whose requests were cancelled."""
        for slot, owner in enumerate(self.owners):
            if owner is not None and owner.cancel_requested:
                self.release(slot, owner.cancel_reason)

    def admit(self) -> list[tuple[str, list[tuple[int, Completion]]]]:
        """Move waiting requests into free slots, first come first served (a request cancelled while it
        waited ends here), and group them for their prefills, shortest prompts first, `rows_per_prefill`
        to a group: [(way, group)], way "whole" (one prefill), "chunked" (a chunk per round) or "prefix_cached"
        (through the prefix cache). The round's last first token comes when it would in any order, and
        every other one sooner: a short prompt never waits behind a long one that came with it."""
        free = [slot for slot, owner in enumerate(self.owners) if owner is None]
        with self.lock:
            entering = []
            while self.queue and len(entering) < len(free):
                completion = self.queue.popleft()
                completion.waits_in(None)  # from here on, a cancel frees its slot
                if completion.cancel_requested:
                    completion.end(completion.cancel_reason)
                else:
                    entering.append(completion)
        entering.sort(key=lambda c: len(c.request.prompt))
        for slot, completion in zip(free, entering):
            self.owners[slot] = completion
        entries = list(zip(free, entering))
        groups = []
        for i in range(0, len(entries), self.rows_per_prefill):
            group = entries[i: i + self.rows_per_prefill]
            request = group[0][1].request
            if self.prefix_cached and (request.prompt_logprobs or request.reuse_prefix):  # one row: no mesh
                groups.append(("prefix_cached", group))
            elif max(len(c.request.prompt) for _, c in group) > self.prefill_chunk:
                groups.append(("chunked", group))  # its slots wait, owned, until its last chunk
            else:
                groups.append(("whole", group))
        return groups

    def add_chunked(self, group: Chunked) -> None:
        """Queue a group whose prompts run a chunk per round (after those queued before it)."""
        self.chunked.append(group)

    def finish_chunked(self) -> None:
        """The oldest chunked group ran its last piece: its requests decode from now on."""
        self.chunked.popleft()

    def next_chunked(self) -> tuple[Chunked, list[tuple[int | None, Completion]]] | None:
        """The oldest chunked group that still has a request in its slots, and its entries with None for
        those that went (cancelled and released: the slot is perhaps another's already; its row still
        runs, so that each other row stays where its cache is); groups with none left are dropped. None
        when no prompt waits on chunks."""
        while self.chunked:
            group = self.chunked[0]
            entries = [(slot if self.owners[slot] is c else None, c) for slot, c in group.entries]
            if any(slot is not None for slot, _ in entries):
                return group, entries
            self.chunked.popleft()
        return None

    def prefilling(self) -> set[int]:
        """The slots whose requests' prompts are still running their chunks."""
        return {slot for group in self.chunked for slot, c in group.entries if self.owners[slot] is c}

    def decoding(self) -> list[int]:
        """The slots whose requests decode: owned, and past their prompts."""
        prefilling = self.prefilling()
        return [slot for slot, owner in enumerate(self.owners) if owner is not None and slot not in prefilling]

    def entering(self, slots: list[int | None], completions: list[Completion]) -> list[int | None]:
        """Of an insert's entries, the slots that start decoding (None: none, for a slot that is None or a
        request that asked for at most one token: it ends with its prefill); their marks to free clear."""
        entering = [None if slot is None or c.request.max_tokens <= 1 else slot for slot, c in zip(slots, completions)]
        self.free_S[[slot for slot in entering if slot is not None]] = False  # their device state is new
        return entering

    def take_frees(self) -> np.ndarray:
        """bool [num_slots]: the slots the device must free (then cleared)."""
        free_S, self.free_S = self.free_S, np.zeros((self.num_slots,), np.bool_)
        return free_S

    def deliver(self, slots: list[int | None], emitted) -> None:
        """Hand each slot's new tokens to its request (row i of `emitted` is slot slots[i], or nowhere for
        None); free the slots whose request ended. Slots whose prompts are still running their chunks are
        left alone. `emitted`: a decoding `Emitted` (arrays [entries, rows], row r's first count[r] its own;
        read here as numpy)."""
        token, stop_token = np.asarray(emitted.token), np.asarray(emitted.stopped)
        count = np.asarray(emitted.count)
        logprob, live = np.asarray(emitted.logprob), np.asarray(emitted.live)
        prefilling = self.prefilling()
        owners = [None if slot is None or slot in prefilling else self.owners[slot] for slot in slots]
        wants_top = any(owner is not None and owner.request.logprobs for owner in owners)
        top_ids, top_lps = (np.asarray(emitted.top_ids), np.asarray(emitted.top_logprobs)) if wants_top else (None, None)
        for row, (slot, owner) in enumerate(zip(slots, owners)):
            if owner is None:
                continue
            before = len(owner.tokens)
            stopped = False
            for i in range(int(count[row])):
                top = ([(int(t), float(lp)) for t, lp in zip(top_ids[i, row], top_lps[i, row])]
                       if top_ids is not None else [])
                if stop_token[i, row]:  # it ends the request unemitted; the device's slot is free already
                    owner.stopped_by(int(token[i, row]), float(logprob[i, row]), top)
                    break
                if owner.add(int(token[i, row]), float(logprob[i, row]), top):
                    stopped = True
                    break
            self.tokens_emitted += len(owner.tokens) - before
            if stopped:
                owner.cancel()  # the device slot is still live: stop it at the next round
                owner.end("stop")
            elif not live[row]:
                self.release(slot, "length" if len(owner.tokens) >= owner.request.max_tokens else "stop")
            elif len(owner.tokens) > before:
                owner.notify()

    def release(self, slot: int, reason: str) -> None:
        """Free a slot; its request ends with `reason` unless it has ended already."""
        owner = self.owners[slot]
        self.owners[slot] = None
        self.free_S[slot] = True  # the device may still count it live (a stop string, a cancel)
        if not owner.done.is_set():
            owner.end(reason)

    def release_all(self, reason: str) -> None:
        """Free every slot (a round that failed)."""
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                self.release(slot, reason)

    def cancel_everything(self, reason: str = "abort") -> None:
        """At shutdown's deadline: the waiting requests end with `reason`, the running ones are asked to."""
        with self.lock:
            waiting = list(self.queue)
            self.queue.clear()
            for owner in self.owners:
                if owner is not None:
                    owner.cancel(reason)
            self.exit = True
            self.lock.notify()
        for completion in waiting:
            completion.waits_in(None)
            completion.end(reason)
