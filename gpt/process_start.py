"""What every command line does first, before its imports (JAX's among them): a signal from then on ends it
with one line, and JAX is kept to the platforms the host has.

Imports nothing heavy: `gpt`'s own names load on first use, so that this runs within a fraction of a
second of the interpreter's start.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from gpt.errors import exit_on_signals

__all__ = ["start_command_line"]

# Device files of the accelerators JAX drives: TPU chips (VFIO on v5 and later, accel on earlier ones),
# NVIDIA's and AMD's GPUs.
_ACCELERATOR_FILES = ("/dev/vfio/[0-9]*", "/dev/accel*", "/dev/nvidia[0-9]*", "/dev/kfd")


def start_command_line(argv: list[str] | None = None) -> None:
    """Signals end the process with one line from now on (`gpt.errors.exit_on_signals`); JAX looks only at
    the CPU when the command compiles for devices it never runs on (`--compile_only`), or when libtpu is
    installed (the `tpu` extra, for those compiles) on a host with no accelerator at all: started there,
    libtpu prints a page of warnings on every run, finding no TPU. JAX_PLATFORMS, when set, is kept."""
    exit_on_signals()
    argv = sys.argv[1:] if argv is None else argv
    compile_only = any(arg == "--compile_only" or arg.startswith("--compile_only=") for arg in argv)
    if compile_only or (importlib.util.find_spec("libtpu") is not None and not _has_accelerator()):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_FILES)
