"""A profile of chosen training steps: JAX's profiler trace, and what a reader of it needs beside it.

`StepTrace(directory)` is started before the first chosen step is dispatched and stopped after the last
one has finished (the caller drains the device at both ends, so the trace holds those steps and nothing
else). It leaves in `directory`:

- `plugins/profile/<time>/*.trace.json.gz` (and the `.xplane.pb` that TensorBoard's profile plugin reads,
  and `perfetto_trace.json.gz` for ui.perfetto.dev): JAX's own trace;
- `step.hlo.txt`: the optimized HLO of the step (a training step, or a decode call: bench/decode_profile.py),
  whose op names the trace's events carry, each op with the named scope of the code it came from (`qkv`,
  `attention`, `mlp_up`, `optimizer`, ...);
- `profile.json`: how many steps were traced and their shapes (model, micro-batch, accumulation).

`bench/step_profile.py DIRECTORY` turns the three into a table of device time by category.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from gpt.errors import ConfigError

__all__ = ["StepTrace", "parse_step_range", "HLO_FILE", "META_FILE"]

HLO_FILE = "step.hlo.txt"
META_FILE = "profile.json"


def parse_step_range(text: str, name: str = "profile_steps") -> tuple[int, int] | None:
    """'A:B' -> (A, B), the steps A .. B-1 counted from 0 (a Python slice); '' -> None. ConfigError for
    anything else, naming `name`."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        steps = int(first), int(last)
    except ValueError:
        raise ConfigError(f"{name} must be 'A:B' (steps A to B-1, e.g. 10:13), got {text!r}") from None
    if not 0 <= steps[0] < steps[1]:
        raise ConfigError(f"{name}={text!r} must have 0 <= A < B")
    return steps


class StepTrace:
    """JAX's profiler over a run of steps, and the files `bench/step_profile.py` reads beside its trace."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.active = False

    def start(self) -> None:
        """Start tracing (the caller has drained the device: nothing earlier lands in the trace)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self.active = True

    def stop(self, steps: int, shapes: dict, hlo_text: str | None) -> Path:
        """Stop tracing after `steps` steps (drained by the caller) and write their description: `shapes` (the
        model's config as JSON, micro_batch, block_size, accumulation, ...) and the step's optimized HLO.
        Returns the directory."""
        jax.profiler.stop_trace()
        self.active = False
        if hlo_text is not None:
            (self.directory / HLO_FILE).write_text(hlo_text)
        meta = {"steps": steps, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                "device_count": jax.device_count(), **shapes}
        (self.directory / META_FILE).write_text(json.dumps(meta, indent=1))
        return self.directory

    def abandon(self) -> None:
        """Stop tracing without a description (a run that ended inside the traced steps)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
