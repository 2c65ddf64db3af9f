"""The errors a user can act on, and how the command-line entry points report them.

Two kinds of failure are told apart from bugs:

- `UserError`: the input is wrong (a flag, a path, a corpus, a mesh, a sampling knob). Raised before any
  compile. The CLIs print its message alone, with no traceback, and exit 2 (argparse's code for usage).
  `DiskFull` is one too: the disk (or a quota) filled while writing, the user's to make room on.
- `RunFailed`: the run itself went wrong in a way the user must know about (a non-finite step, a failed
  save, a checkpoint written by a different run). One message, exit 1; what was saved is intact.

Anything else is a bug and keeps its traceback. `MissingInput` also subclasses `FileNotFoundError`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import signal
import sys
import threading
from typing import NoReturn

from gpt.signals import StopSignals

__all__ = ["UserError", "ConfigError", "MissingInput", "DiskFull", "RunFailed", "causes", "write_failed",
           "cli_main", "exit_on_signals", "check_fits_in_memory", "host_memory_bytes"]


class UserError(Exception):
    """Bad input: the CLIs print the message alone and exit 2."""


class ConfigError(UserError):
    """A setting, a mesh, a corpus or a checkpoint that cannot be used as given.

    Deliberately not a ValueError: tyro reports a ValueError raised while it builds a config as a box of
    its own, and Python's own ValueErrors (bugs) should never be mistaken for bad input."""


class MissingInput(UserError, FileNotFoundError):
    """A path the user named does not exist or holds nothing usable."""


class DiskFull(UserError):
    """The disk, or the user's quota, filled while something was written: the CLIs print this line and exit 2.
    Whatever wrote is left as it was before the write (no temporary behind, the last checkpoint intact)."""


class RunFailed(RuntimeError):
    """The run stopped on purpose (a non-finite step, a failed save): the CLIs print this line and exit 1."""


_FULL = (errno.ENOSPC, errno.EDQUOT)
# How a full disk reads where it reaches us as text: Rust's io::Error (safetensors), tensorstore's (Orbax).
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def causes(error: BaseException) -> list[BaseException]:
    """`error` and the errors behind it (each one's cause, else its context), outermost first."""
    chain = []
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def first_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s text as one line for a one-line message: its first non-blank line, at most `limit` characters;
    its type's name where it has no text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(error).__name__


def write_failed(error: BaseException, message: str, otherwise: type[Exception] = RunFailed) -> Exception:
    """`message` as the error a failed write is: `DiskFull` when `error`, or any error behind it (`causes`), is
    a full disk or quota; else `otherwise`."""
    for cause in causes(error):
        if (isinstance(cause, OSError) and cause.errno in _FULL) or any(t in str(cause) for t in _FULL_TEXTS):
            return DiskFull(message)
    return otherwise(message)


def host_memory_bytes() -> int | None:
    """This machine's physical memory; None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def check_fits_in_memory(setting: str, nbytes: int, what: str, advice: str) -> None:
    """ConfigError naming `setting` when `nbytes` (what it asks the host to hold) is over half this machine's
    memory: an error now, where allocating it would fail (or swap) after the work began."""
    memory = host_memory_bytes()
    if memory is not None and nbytes > memory // 2:
        raise ConfigError(f"{setting} needs about {nbytes / 2**30:,.1f} GiB for {what}, over half this machine's "
                          f"{memory / 2**30:,.1f} GiB of memory: {advice}")


class _DropOrbaxErrors(logging.Filter):
    """Drops the ERROR records that a failed background save leaves: Orbax logs it from each of its
    threads, and asyncio logs each of its unretrieved write tasks, all with tracebacks, before the failure
    reaches the caller. The CLI reports it once, as RunFailed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and ("orbax" in record.pathname or "orbax" in record.getMessage()))


def _quiet_closed_loop(previous):
    """An unraisable-exception hook that drops tensorstore's callbacks into Orbax's closed event loop (the
    writes of a failed save that finish after it gave up) and hands anything else to `previous`."""

    def hook(unraisable):
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    return hook


def _stdout_closed() -> bool:
    """Whether the reader of stdout's pipe has gone (`sample.py | head`): the pipe reports an error."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor behind stdout
        return False


_stopping = threading.Lock()  # taken by the first call of _stopped_by


def _stopped_by(signum: int) -> NoReturn:
    """Ends the process after a signal: one line, status 128 + its number. At once, without the interpreter's
    teardown: that crashed (SIGSEGV, in 3 of 6 tries of serve.py and 5 of 7 of sample.py) while XLA's threads
    still ran what the signal cut short. Another call meanwhile (a signal landing inside it, or a thread
    ending the process too) returns at once."""
    if not _stopping.acquire(blocking=False):
        return  # type: ignore[return-value]
    print(f"\nstopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a reader gone, or stdout closed: nothing more to give it
        pass
    os._exit(128 + signum)


def exit_on_signals() -> None:
    """From now until a `cli_main` block takes them (and again after it), SIGTERM and SIGINT end the process
    at once with one line and status 128 + the signal's number. A command line's first call, before its
    imports and flags, where Python would print a KeyboardInterrupt's traceback. A signal the process was
    started ignoring stays ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: _stopped_by(signum))


# What to change when a program's memory runs out as it runs (the checks before it compare the compiled programs
# with the device's memory; an allocation can still fail beside them).
OUT_OF_MEMORY_ADVICE = ("ask for less at once: a smaller --batch_size (with --grad_accum), --model.remat or an fsdp "
                        "mesh to train; fewer --slots, a shorter --cache_length or --num_samples to sample or serve")


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's failure to allocate device (or host) memory for a running program."""
    return type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(error)


def cli_main(function):
    """Wrap a CLI's `main` so that a UserError or RunFailed ends it with one line on stderr, exit 2 or 1 (and
    XLA's failure to allocate a running program's memory, exit 2, with what to change), and SIGINT or SIGTERM
    (where the CLI does not catch them itself, as training does to save) with one line and status 128 + the
    signal's number (a second signal ends it then, if what ran does not stop on the first: `StopSignals`).
    Output piped to a reader that stops early (`| head`) ends it quietly with SIGPIPE's status, 141, as it
    ends other Unix tools.

    It also keeps a failed checkpoint save from printing dozens of tracebacks before that line."""

    @functools.wraps(function)
    def main(*args, **kwargs):
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_DropOrbaxErrors())
        sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
        try:
            with StopSignals(at_once=True, end_process=_stopped_by):
                return function(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        except RunFailed as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            if getattr(error, "exit_now", False):  # a clean exit would wait for a process that died
                sys.stdout.flush()
                os._exit(1)
            sys.exit(1)
        except BrokenPipeError:
            if not _stdout_closed():  # another pipe (a worker's): a failure to see
                raise
            # At once, as after a signal: a normal exit would flush stdout into another BrokenPipeError, and
            # its teardown could meet XLA's threads still running what was cut short.
            sys.stderr.flush()
            os._exit(128 + signal.SIGPIPE)
        except Exception as error:
            out_of_memory = next((cause for cause in causes(error) if _out_of_memory(cause)), None)
            if out_of_memory is None:
                raise
            print(f"error: the memory ran out ({first_line(out_of_memory)}); {OUT_OF_MEMORY_ADVICE}", file=sys.stderr)
            sys.exit(2)

    return main
