"""On a multi-process run, notice a process that died, and end the others with one line that says so.

When a process dies, the survivors' next collective fails (gloo: "Connection closed by peer"), and a
plain exit would then wait in JAX's shutdown barrier until the coordination service misses the dead
process's heartbeats (100 s by default) and aborts from C++ (exit 134, a stack trace). Instead:

- each process bumps a counter in the coordination service's key-value store every second, from a
  thread, and watches the others' counters;
- `train` turns a failed collective into `PeerLost`, naming the processes whose counters stopped
  (`silent_peers`); the CLI prints that one line and leaves with `os._exit(1)`, skipping the barrier;
- a counter that stops moving for `timeout_s` while this process is blocked somewhere that never fails
  ends this process the same way.

The checkpoints on disk are whole (Orbax renames a step into place only when complete), so restarting
every process with the same flags resumes from the newest one.

Beside the watch, the few things the processes of a run settle together: a barrier with a timeout
(`wait_for_all`), the signal they all stop on (`agree_on_signal`), and telling a failed collective
from other errors (`is_collective_failure`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from gpt.errors import RunFailed, first_line

__all__ = ["PeerWatch", "PeerLost", "is_collective_failure", "root_cause", "wait_for_all", "agree_on_signal"]


class PeerLost(RunFailed):
    """Another process of the run died; the CLI exits at once (a clean exit would wait for it)."""

    exit_now = True


class PeerWatch:
    """`with PeerWatch(describe_restart):` watches the other processes of this run (a no-op on one).

    `describe_restart()` -> str completes the message (e.g. which checkpoint a restart resumes from).
    """

    def __init__(self, describe_restart: Callable[[], str], timeout_s: float = 20.0, interval_s: float = 1.0):
        self.describe_restart, self.timeout_s, self.interval_s = describe_restart, timeout_s, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_change: dict[int, float] = {}
        self._coordinator_lost_at: float | None = None

    def __enter__(self) -> PeerWatch:
        if jax.process_count() > 1:
            self._thread = threading.Thread(target=self._watch, name="gpt-peer-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)

    def _watch(self) -> None:
        # The coordination service's client: jax.distributed keeps it in its (internal) global state.
        from jax._src.distributed import global_state

        client, me, count = global_state.client, jax.process_index(), jax.process_count()
        others = [p for p in range(count) if p != me]
        last_value = {p: None for p in others}
        last_change = self._last_change
        last_change.update({p: time.monotonic() for p in others})
        beat = 0
        while not self._stop.wait(self.interval_s):
            beat += 1
            try:
                client.key_value_set(f"gpt/alive/{me}", str(beat), allow_overwrite=True)
                values = {}
                for p in others:
                    try:
                        values[p] = client.key_value_try_get(f"gpt/alive/{p}")
                    except Exception:  # not written yet: that process has not started watching
                        values[p] = None
            except Exception:  # the coordinator (process 0) is gone
                self._coordinator_lost_at = self._coordinator_lost_at or time.monotonic()
                if time.monotonic() - self._coordinator_lost_at > self.timeout_s:
                    self._end("process 0 (the coordinator)")
                continue
            now = time.monotonic()
            for p, value in values.items():
                if value != last_value[p]:
                    last_value[p], last_change[p] = value, now
                elif now - last_change[p] > self.timeout_s:
                    self._end(f"process {p}")

    def silent_peers(self, wait_s: float = 3.0) -> str:
        """Which processes stopped bumping their counters, after watching for `wait_s` (call it when a
        collective has failed): e.g. 'process 1', or 'another process' when none can be told apart."""
        if self._thread is None:
            return "another process"
        time.sleep(wait_s)
        if self._coordinator_lost_at is not None:
            return "process 0 (the coordinator)"
        now = time.monotonic()
        silent = [p for p, t in sorted(self._last_change.items()) if now - t >= wait_s - self.interval_s]
        return ", ".join(f"process {p}" for p in silent) if silent else "another process"

    @contextlib.contextmanager
    def collective_failures_named(self):
        """Inside the block, a failed cross-process collective becomes PeerLost, one line naming the
        processes that went silent and how to restart."""
        try:
            yield
        except Exception as error:
            if jax.process_count() > 1 and is_collective_failure(error):
                raise PeerLost(f"{self.silent_peers()} died (a collective failed: "
                               f"{first_line(root_cause(error), 200)}); process "
                               f"{jax.process_index()} stops too; {self.describe_restart()}") from error
            raise

    def _end(self, who: str) -> None:
        if self._stop.is_set():  # the run ended normally while this thread looked
            return
        print(f"error: {who} stopped answering for {self.timeout_s:.0f} s (it probably died), so process "
              f"{jax.process_index()} stops too; {self.describe_restart()}", file=sys.stderr, flush=True)
        os._exit(1)  # the main thread may be blocked in a collective that will never finish


def root_cause(error: BaseException) -> BaseException:
    """The last exception in `error`'s chain of causes."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def is_collective_failure(error: BaseException) -> bool:
    """Did a cross-process collective fail (the sign, on CPU and GPU alike, that another process died)?"""
    text = " ".join(str(e) for e in (error, root_cause(error)))
    return any(sign in text for sign in ("Gloo", "Connection closed by peer", "Connection reset by peer",
                                         "NCCL", "coordination service", "heartbeat"))


def wait_for_all(name: str, timeout_s: float, message: str) -> None:
    """A barrier of every process, through JAX's coordination service, that gives up after `timeout_s`
    with RunFailed(`message` and the cause)."""
    from jax._src.distributed import global_state  # jax.distributed's client (no public barrier with a timeout)

    try:
        global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as error:
        raise RunFailed(f"{message} ({first_line(error, 200)})") from error


def agree_on_signal(received: int | None) -> int | None:
    """The signal to stop on, the same on every process: processes that receive a signal on different
    steps must still stop (and save) on the same one, or one would wait in the save's barrier while
    another runs the next step's collectives. On several processes this is a blocking collective: call it
    at the same steps on every process, where the loop reads the device anyway."""
    local = received or 0
    if jax.process_count() > 1:
        local = int(multihost_utils.process_allgather(np.int32(local)).max())
    return local or None
