"""Work for the next steps done ahead, on a background thread: the loop takes it ready when it needs it.

The training loop uses it to read each step's batch from the memory-mapped shards and place it on the
mesh while the device runs the steps before it, so no step waits for the host's reading. At most `depth`
items are made ahead (a bounded queue), so memory stays flat however fast the producer is.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Prefetch"]

T = TypeVar("T")
_DONE = object()


class Prefetch(Generic[T]):
    """`with Prefetch(make, keys, depth) as ahead:` then `next(ahead)` is `make(key)` for each key in order.

    A background thread calls `make` up to `depth` keys ahead; with `depth=0` each `next` calls it on the
    caller's thread (no thread at all). An exception in `make` is raised by the `next` that would have
    returned its item. Leaving the block stops the thread (a call of `make` under way is let finish).
    """

    def __init__(self, make: Callable[[object], T], keys: Iterable, depth: int = 2):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.make, self.keys, self.depth = make, iter(keys), depth
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Prefetch[T]:
        if self.depth:
            self._thread = threading.Thread(target=self._produce, name="gpt-prefetch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():  # free a slot the producer may be waiting for
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()

    def __iter__(self) -> Prefetch[T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            return self.make(next(self.keys))
        item, error = self._queue.get()
        if error is not None:
            raise error
        if item is _DONE:
            raise StopIteration
        return item

    def _produce(self) -> None:
        try:
            for key in self.keys:
                if self._stop.is_set():
                    return
                self._put((self.make(key), None))
            self._put((_DONE, None))
        except BaseException as error:  # handed to the consumer, raised where it asks for the item
            self._put((None, error))

    def _put(self, entry) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return
            except queue.Full:
                continue
