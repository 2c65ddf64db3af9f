"""SIGTERM and SIGINT, caught for a while: a trainer saves before it exits, a CLI stops at once and cleanly.

Outside a `StopSignals` block Python's own handling applies (SIGINT raises KeyboardInterrupt, SIGTERM ends
the process at once).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

__all__ = ["StopSignals"]


class _Stopped(KeyboardInterrupt):
    """Raised by an `at_once` handler. A KeyboardInterrupt, so that no `except Exception` on the way swallows
    it, and so that an event loop's callback it lands in (Orbax's asyncio, during a checkpoint's read) lets it
    through rather than logging its traceback; the block that raised it absorbs it."""


class StopSignals:
    """While open, SIGTERM and SIGINT set `received` (the first signal's number) instead of ending the
    process. With `at_once`, each also ends the block: it raises inside whatever the block is running
    (after the C call under way, such as a compile, returns), and the block's exit absorbs it. Otherwise
    the block checks `received` when it can stop cleanly. On leaving, the previous handlers return.

    A signal that lands in a finalizer or a callback raises there, where Python prints the error and carries
    on: so until an `at_once` block ends, the first signal is raised again every `REPEAT_S` seconds, until
    one lands where it ends the block (and such a lost raise prints nothing). Check `received` after the
    block all the same.

    An `at_once` block given `end_process` (which must not return) ends the process after a signal: it is
    called with the first signal's number at the block's exit, while the block's handlers still hold the
    signals (a later one then changes nothing, where a restored handler would raise it as a traceback), or
    at once at a second signal (sent, not a repeat), or `GRACE_S` after the first, since some work does not
    end on a raise: a thread pool's exit waits for every task queued on it, a C call runs to its end.
    Without it, a second signal changes nothing.

    Entering and leaving the block is never cut short: a signal there is recorded, and raised (if the block
    is still open) by the next repeat.

    Python takes signals only on its main thread; elsewhere the block catches none. A signal the process
    was started ignoring (SIGINT in a shell's background job) stays ignored.
    """

    REPEAT_S = 0.25
    GRACE_S = 5.0

    def __init__(self, at_once: bool = False, end_process: Callable[[int], NoReturn] | None = None):
        self.at_once = at_once
        self.end_process = end_process if at_once else None
        self.received: int | None = None
        self._previous = {}
        self._closing = threading.Event()
        self._repeater: threading.Thread | None = None
        self._repeat_sent = False  # set by the repeater just before it raises the signal again

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        if self.at_once:  # only an at_once block raises, and so has lost raises to drop
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        return self

    def _unraisable(self, unraisable) -> None:
        """Drops a raise of ours that a finalizer or callback swallowed (a repeat follows); passes on the rest."""
        if not isinstance(unraisable.exc_value, _Stopped):
            self._previous_hook(unraisable)

    def _handle(self, signum, frame) -> None:
        repeat, self._repeat_sent = self._repeat_sent, False
        first = self.received is None
        if first:  # without at_once a second signal changes nothing: the first is acted on
            self.received = signum
            if self.at_once:
                self._repeater = threading.Thread(target=self._repeat, name="StopSignals", daemon=True)
                self._repeater.start()
        if self._closing.is_set():  # the block is ending: its exit acts on the first signal
            return
        if self.end_process is not None and not first and not repeat:
            self.end_process(self.received)
        if self.at_once and not _entering_or_leaving(frame):
            raise _Stopped

    def _repeat(self) -> None:
        """Raise the first signal again in the main thread, as if it came again, until the block ends; past
        GRACE_S, end the process from this thread (with `end_process`): the main thread is stuck where no
        raise ends it."""
        deadline = time.monotonic() + self.GRACE_S
        while not self._closing.wait(self.REPEAT_S):
            if self.end_process is not None and time.monotonic() > deadline:
                self.end_process(self.received)
            self._repeat_sent = True
            _thread.interrupt_main(self.received)

    def __exit__(self, kind, error, traceback) -> bool:
        self._closing.set()
        if self._repeater is not None:
            # Joined while the handler is still ours (and raises no more): a repeat the thread made just
            # before it saw the block end is handled here, not by the handler restored below.
            self._repeater.join()
        if self.received is not None and self.end_process is not None:
            self.end_process(self.received)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.at_once:
            sys.unraisablehook = self._previous_hook
        return kind is _Stopped


def _entering_or_leaving(frame) -> bool:
    """Whether `frame` (where a signal's handler interrupted the main thread) runs inside a StopSignals'
    `__enter__` or `__exit__`: a raise there would escape the block that absorbs it."""
    while frame is not None:
        if frame.f_code in (StopSignals.__enter__.__code__, StopSignals.__exit__.__code__):
            return True
        frame = frame.f_back
    return False
