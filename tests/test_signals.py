"""StopSignals: a signal ends an `at_once` block even where its first raise is swallowed, and leaves nothing
behind when the block ends. The signals are sent to this process while the block holds SIGTERM."""

import os
import signal
import sys
import threading
import time

import pytest

from gpt.signals import StopSignals


class _SignalledInFinalizer:
    """Sends SIGTERM from its finalizer, so that the handler runs (and raises) inside it, where Python prints
    the error and carries on. `finished` records a finalizer that the raise did not cut short."""

    finished = []

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        _spin(5)  # Python runs the handler here, inside the finalizer
        self.finished.append(True)


def _spin(seconds: float) -> float:
    """Runs Python code for up to `seconds`; returns how long it ran (shorter where a signal cut it)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        pass
    return time.monotonic() - start


def test_a_signal_swallowed_by_a_finalizer_still_ends_an_at_once_block(monkeypatch):
    reported = []  # what reaches the unraisable hook, which Python's own prints to stderr
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_type.__name__))
    previous, previous_hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    start = time.monotonic()
    with StopSignals(at_once=True) as stop:
        _SignalledInFinalizer()  # its first raise is lost: it had left serve.py warming up, then serving
        _spin(10)
    assert _SignalledInFinalizer.finished == []  # the first raise happened in the finalizer, and was lost
    assert stop.received == signal.SIGTERM
    assert time.monotonic() - start < 3 * StopSignals.REPEAT_S + 2
    # The block's end stops the repeats: none reaches the restored handler (which would end this process).
    assert signal.getsignal(signal.SIGTERM) is previous and sys.unraisablehook is previous_hook
    assert reported == []  # the lost raise was not reported: nothing printed
    assert _spin(4 * StopSignals.REPEAT_S) >= 4 * StopSignals.REPEAT_S


def test_without_at_once_a_signal_is_only_recorded():
    hook = sys.unraisablehook
    with StopSignals() as stop:
        assert sys.unraisablehook is hook  # it raises nothing, so it has no lost raise to drop
        os.kill(os.getpid(), signal.SIGTERM)
        ran = _spin(4 * StopSignals.REPEAT_S)  # not cut short, then or by a repeat
    assert stop.received == signal.SIGTERM
    assert ran >= 4 * StopSignals.REPEAT_S


class _SignalledWhileClosing(type(threading.Event())):
    """The block's closing event, whose `set` (the first thing its exit does) is where SIGTERM lands: as a
    repeat did in sample.py, between the block's end and the flag that stops its raises."""

    def set(self):
        os.kill(os.getpid(), signal.SIGTERM)
        _spin(3 * StopSignals.REPEAT_S)  # the handler runs here, inside __exit__
        super().set()


def test_a_signal_landing_in_the_blocks_own_exit_does_not_escape_it():
    stop = StopSignals(at_once=True)
    stop._closing = _SignalledWhileClosing()
    with stop:
        pass  # a raise inside __exit__ had escaped the block as a _Stopped traceback
    assert stop.received == signal.SIGTERM


def test_the_block_ends_the_process_through_end_process_while_it_still_holds_the_signals():
    seen = []

    def end_process(signum):  # a real one never returns; this one records what it saw and when
        seen.append((signum, signal.getsignal(signal.SIGTERM) == stop._handle))

    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals(at_once=True, end_process=end_process) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        _spin(5)
    assert seen == [(signal.SIGTERM, True)]  # called once, by the exit, before the handlers were restored
    assert signal.getsignal(signal.SIGTERM) is previous


_STUCK_IN_A_DEVICE_CALL = """
import signal, sys
import jax
from gpt.errors import cli_main

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (a background job ignores it)

@cli_main
def main():
    endless = jax.jit(lambda x: jax.lax.while_loop(lambda x: x >= 0.0, lambda x: x + 1.0, x))  # never ends
    endless.lower(0.0).compile()
    print("waiting", flush=True)
    endless(0.0).block_until_ready()  # Python's handlers run only when this returns: never

main()
"""


@pytest.mark.slow  # it starts processes
def test_a_signal_ends_a_command_whose_main_thread_waits_in_a_c_call_forever():
    """The main thread, where Python runs signal handlers, waits for a device computation (as sample.py for
    a whole decode): the first signal ends the command after the grace, a second at once, each with one line
    and 128 + the first's number, where the command had run on until the call returned."""
    import subprocess

    for signals, within in (([signal.SIGINT], StopSignals.GRACE_S + 4), ([signal.SIGTERM, signal.SIGINT], 3)):
        process = subprocess.Popen([sys.executable, "-c", _STUCK_IN_A_DEVICE_CALL], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            assert process.stdout.readline() == "waiting\n"
            time.sleep(0.5)
            start = time.monotonic()
            for sig in signals:
                process.send_signal(sig)
                time.sleep(0.2)
            status = process.wait(timeout=within + 30)
            took = time.monotonic() - start
        finally:
            process.kill()
            stderr = process.communicate()[1]
        assert status == 128 + signals[0] and took < within, (status, took, stderr[-2000:])
        assert stderr.strip().splitlines()[-1] == f"stopped by {signals[0].name}"
