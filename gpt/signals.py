"""SIGTERM and SIGINT, caught for a while: a trainer saves before it exits, a CLI stops at once and cleanly.

Outside a `StopSignals` block Python's own handling applies (SIGINT raises KeyboardInterrupt, SIGTERM ends
the process at once).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading

__all__ = ["StopSignals"]


class _Stopped(BaseException):
    """Raised by an `at_once` handler. A BaseException, as KeyboardInterrupt is, so that no `except
    Exception` on the way swallows it; the block that raised it absorbs it."""


class StopSignals:
    """While open, SIGTERM and SIGINT set `received` (the first signal's number) instead of ending the
    process. With `at_once`, each also ends the block: it raises inside whatever the block is running
    (after the C call under way, such as a compile, returns), and the block's exit absorbs it. Otherwise
    the block checks `received` when it can stop cleanly. On leaving, the previous handlers return.

    A signal that lands in a finalizer or a callback raises there, where Python prints the error and carries
    on: so until an `at_once` block ends, the first signal is raised again every `REPEAT_S` seconds, until
    one lands where it ends the block (and such a lost raise prints nothing). Check `received` after the
    block all the same.

    Python takes signals only on its main thread; elsewhere the block catches none. A signal the process
    was started ignoring (SIGINT in a shell's background job) stays ignored.
    """

    REPEAT_S = 0.25

    def __init__(self, at_once: bool = False):
        self.at_once = at_once
        self.received: int | None = None
        self._previous = {}
        self._closing = threading.Event()
        self._repeater: threading.Thread | None = None

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
        if self.received is None:  # without at_once a second signal changes nothing: the first is acted on
            self.received = signum
            if self.at_once:
                self._repeater = threading.Thread(target=self._repeat, name="StopSignals", daemon=True)
                self._repeater.start()
        if self.at_once and not self._closing.is_set():
            raise _Stopped

    def _repeat(self) -> None:
        """Raise the first signal again in the main thread, as if it came again, until the block ends."""
        while not self._closing.wait(self.REPEAT_S):
            _thread.interrupt_main(self.received)

    def __exit__(self, kind, error, traceback) -> bool:
        self._closing.set()
        if self._repeater is not None:
            # Joined while the handler is still ours (and raises no more): a repeat the thread made just
            # before it saw the block end is handled here, not by the handler restored below.
            self._repeater.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.at_once:
            sys.unraisablehook = self._previous_hook
        return kind is _Stopped
