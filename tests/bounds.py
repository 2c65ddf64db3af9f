"""How long a test waits on a process it started before it calls the process stuck.

A bound is a guard against a hang, never a speed test: on a busy or slow machine a test may be slow, never wrong.
Each bound is what a quiet 2-core machine needs with room to spare, times the machine's load when the wait
begins (runnable processes per core over the last minute, at least 1: a second job beside the suite doubles it),
times `GPT_TEST_TIME_SCALE` (default 1) for a machine known to be slower still.
"""

import os

__all__ = ["bound"]


def bound(seconds: float) -> float:
    """`seconds` scaled to this machine's load now and GPT_TEST_TIME_SCALE."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(1.0, load) * float(os.environ.get("GPT_TEST_TIME_SCALE", "1"))
