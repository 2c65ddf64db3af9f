"""A training run owns its `out_dir`: one writer at a time, and a resume only of the same run.

- `RunLock`: an exclusive `fcntl.flock` on `out_dir/.lock`, taken before anything is written. The kernel
  drops the lock when its process dies, however it dies, so a `kill -9`'d run never blocks its own resume;
  the file keeps the holder's pid and host only to name them in the refusal. (On a multi-host run,
  process 0 holds it. `flock` is advisory and may not work across hosts on some network filesystems.)
- `check_identity`: before a resume restores anything, or re-tokenizes the corpus, the run being started
  is compared with the newest checkpoint's record of the run that wrote it.
- `newest_step`, `has_checkpoint`: which steps a run directory holds, from its directory names alone (no
  Orbax: a sampler or server that reads GPT-2 weights never imports the trainer).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from gpt.errors import ConfigError

__all__ = ["RunLock", "RunLocked", "identity", "check_identity", "make_dir", "newest_step", "has_checkpoint",
           "RESUMABLE_FIELDS", "LOCK_NAME"]


def newest_step(out_dir: str | os.PathLike) -> int | None:
    """The newest complete step under `out_dir/checkpoints`, from the directory names alone (Orbax gives
    a step its plain number only once it is whole); None when there is none."""
    directory = Path(out_dir) / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return max(steps, default=None)


def has_checkpoint(out_dir: str | os.PathLike) -> bool:
    return newest_step(out_dir) is not None


def make_dir(path: Path, name: str = "out_dir") -> Path:
    """`path` as a directory, made with its parents if missing; ConfigError naming `name` when it is a file
    or cannot be made (a parent that is a file, a read-only or virtual filesystem)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name} '{path}' is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{name} '{path}' cannot be made: {e}") from None
    return path


class RunLocked(ConfigError):
    """Another process is training in this out_dir."""


LOCK_NAME = ".lock"
"""The lock file a run's out_dir and a prepared data directory hold from their first write: what marks a
directory as this package's (never read as a corpus)."""


class RunLock:
    """`with RunLock(out_dir):` holds `out_dir` for one run; a second holder gets RunLocked at once.

    The same lock guards a prepared data directory (`gpt.data.prepare`): a preparation holds it while it
    writes, a training run while it reads, so neither writes under the other. `role` says what the holder
    does, in the refusal a second one gets."""

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True, role: str = "training run",
                 advice: str = "or use another --out_dir"):
        self.path = Path(out_dir) / LOCK_NAME
        self.enabled, self.role, self.advice = enabled, role, advice
        self.file = None

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        make_dir(self.path.parent)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            self.file.close()
            role, _, who = holder.rpartition(": ")
            raise RunLocked(f"{self.path.parent} is in use by another {role or 'process'} ({who}); wait for it to "
                            f"finish, {self.advice}") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{self.role}: pid {os.getpid()} on host {socket.gethostname()}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.file.flush()
        return self

    def _holder(self, wait_s: float = 1.0) -> str:
        """Who holds the lock, as its file says. A holder that took the lock a moment ago may not have
        written its name yet (two runs started together): wait up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        while True:
            self.file.seek(0)
            holder = self.file.read().strip()
            if holder or time.monotonic() > deadline:
                return holder or "an unknown process"
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


# The settings that make a run this run. Model, optimizer and corpus can never change under a resume (another
# optimizer keeps other state); the training settings may, with --resume_anyway (a longer max_steps, a lower
# lr after a spike), at the cost of the exact-resume guarantee when the loader's settings (batch_size,
# block_size, seed) change.
RESUMABLE_FIELDS = ("lr", "min_lr", "warmup_steps", "max_steps", "weight_decay", "beta1", "beta2", "grad_clip",
                    "batch_size", "grad_accum", "block_size", "seed", "muon_lr", "muon_momentum", "schedule",
                    "decay_fraction", "label_smoothing")
_FIXED_GROUPS = ("model", "optimizer", "corpus")
# Fields of GPTConfig that change how it runs, not what it is.
_MODEL_RUNTIME_FIELDS = ("dropout", "dtype", "fp8", "remat", "scan_layers")


def identity(model_config: dict, training: dict, corpus: dict) -> dict:
    """The record stored with every checkpoint and compared at resume (JSON-ready dicts)."""
    return {
        "model": {k: v for k, v in model_config.items() if k not in _MODEL_RUNTIME_FIELDS},
        "optimizer": {"optimizer": training["optimizer"]},
        "training": {k: training[k] for k in RESUMABLE_FIELDS},
        "corpus": corpus,
    }


def _differences(saved: dict, current: dict, group: str, defaults: dict) -> list[str]:
    old, new, default = saved.get(group, {}), current[group], defaults.get(group, {})
    old = {**{key: default[key] for key in new if key in default}, **old}  # a record from before a field existed
    return [f"{group}.{key}: {old.get(key)!r} -> {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def check_identity(saved: dict | None, current: dict, out_dir: str | os.PathLike, step: int,
                   resume_anyway: bool, log=print, defaults: dict | None = None) -> None:
    """Raise ConfigError, listing every differing field, when `current` is not the run that wrote the
    checkpoint of `step` (whose identity record is `saved`). Differences in the training settings pass
    with `resume_anyway` (and are logged); the model, the optimizer and the corpus never do. `defaults`
    (an identity record of the default settings) stands in for fields a record written before they
    existed lacks."""
    if saved is None:
        raise ConfigError(
            f"{out_dir} holds checkpoint step {step} without a record of the run that wrote it (written by an "
            f"older version); use another --out_dir"
        )
    groups = (*_FIXED_GROUPS, "training")
    unreadable = "the record" if not isinstance(saved, dict) else next(
        (f"its {group!r}" for group in groups if not isinstance(saved.get(group, {}), dict)), None)
    if unreadable is not None:
        raise ConfigError(f"{out_dir} holds checkpoint step {step} whose record of the run that wrote it is "
                          f"unreadable ({unreadable} is not a JSON object); use another --out_dir")
    defaults = defaults or {}
    fixed = [line for group in _FIXED_GROUPS for line in _differences(saved, current, group, defaults)]
    adjustable = _differences(saved, current, "training", defaults)
    if not fixed and not adjustable:
        return
    if fixed or not resume_anyway:
        ways = "use another --out_dir to start a new run"
        if not fixed:
            ways += ", or pass --resume_anyway to continue this run with the new training settings"
        raise ConfigError(
            f"{out_dir} holds checkpoint step {step} of a different run; these settings differ from it: "
            f"{'; '.join(fixed + adjustable)}. To go on: {ways}."
        )
    log(f"resuming anyway with changed training settings: {'; '.join(adjustable)}")
