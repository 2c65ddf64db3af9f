"""SIGTERM and SIGINT, caught for a while: a trainer saves before it exits, a CLI stops at once and cleanly.

Outside a `StopSignals` block Python's own handling applies (SIGINT raises KeyboardInterrupt, SIGTERM ends
the process at once).
"""

from __future__ import annotations

import _thread
import os
import select
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
    Without it, a second signal changes nothing. A watcher thread learns of each signal from the signal
    module's wakeup file descriptor, so that the grace and a second signal end the process even while the
    main thread, where Python runs the handlers, waits in a long C call (a whole decode on the device).

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
        self._wakeup: tuple[int, int] | None = None  # the pipe the signal module writes each signal's number to
        self._previous_wakeup = -1

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        if self.at_once:  # only an at_once block raises, and so has lost raises to drop
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            if self._previous:  # the handlers are ours: watch for the signals from a thread
                self._wakeup = os.pipe()
                os.set_blocking(self._wakeup[1], False)
                self._previous_wakeup = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
                self._repeater = threading.Thread(target=self._watch, name="StopSignals", daemon=True)
                self._repeater.start()
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
            self._wake_watcher()  # should the wakeup pipe not be ours now (an event loop's), it learns here
        if self._closing.is_set():  # the block is ending: its exit acts on the first signal
            return
        if self.end_process is not None and not first and not repeat:
            self.end_process(self.received)
        if self.at_once and not _entering_or_leaving(frame):
            raise _Stopped

    def _wake_watcher(self) -> None:
        if self._wakeup is not None:
            try:
                os.write(self._wakeup[1], b"\0")  # no signal's number
            except BlockingIOError:  # the pipe is full: the watcher is awake already
                pass

    def _watch(self) -> None:
        """Until the block ends: read each signal's number from the wakeup pipe (the main thread's handler may
        not run for as long as a C call lasts); after the first, raise it again in the main thread every
        REPEAT_S, as if it came again; with `end_process`, end the process at a second signal sent (not a
        repeat of ours, each of which the pipe also carries) or GRACE_S after the first."""
        first, deadline, next_repeat, repeats = None, None, None, 0
        while not self._closing.is_set():
            wait = self.REPEAT_S if first is None else max(0.0, next_repeat - time.monotonic())
            if select.select([self._wakeup[0]], [], [], wait)[0]:
                for signum in os.read(self._wakeup[0], 512):
                    if signum not in self._previous or signal.getsignal(signum) != self._handle:
                        continue  # not a signal of ours, or one a block inside this one holds (a trainer's)
                    if repeats:  # one of ours (the same count of bytes, in whatever order they came)
                        repeats -= 1
                    elif first is None:
                        first, deadline, next_repeat = signum, *self._deadlines()
                    elif self.end_process is not None and not self._closing.is_set():
                        self.end_process(first)
            if first is None and self.received is not None:  # the handler's word, where the pipe was not ours
                first, deadline, next_repeat = self.received, *self._deadlines()
            if first is None or self._closing.is_set() or time.monotonic() < next_repeat:
                continue
            if self.end_process is not None and time.monotonic() > deadline:
                self.end_process(first)
            next_repeat = time.monotonic() + self.REPEAT_S
            repeats += 1
            self._repeat_sent = True
            _thread.interrupt_main(first)

    def _deadlines(self) -> tuple[float, float]:
        """From a first signal now: (when the grace ends, when the first repeat is due)."""
        now = time.monotonic()
        return now + self.GRACE_S, now + self.REPEAT_S

    def __exit__(self, kind, error, traceback) -> bool:
        self._closing.set()
        self._wake_watcher()
        if self._repeater is not None:
            # Joined while the handler is still ours (and raises no more): a repeat the thread made just
            # before it saw the block end is handled here, not by the handler restored below.
            self._repeater.join()
            signal.set_wakeup_fd(self._previous_wakeup)
            for fd in self._wakeup:
                os.close(fd)
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
