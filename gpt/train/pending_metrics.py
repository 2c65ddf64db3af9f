"""The metrics of training steps in flight: kept on the device until the loop must know them, then read
together; the first non-finite step among them stops the run, unsaved."""

from __future__ import annotations

import time

import jax
import numpy as np

from gpt.errors import RunFailed
from gpt.train.checkpoint import CheckpointManager
from gpt.train.step import flops_per_token, peak_flops

__all__ = ["NonFiniteStep", "PendingMetrics", "STEPS_IN_FLIGHT"]


class NonFiniteStep(RunFailed):
    """A step's loss, gradient norm or updated parameters were not finite; it was not saved."""


STEPS_IN_FLIGHT = 2


class PendingMetrics:
    """The metrics of steps dispatched but not yet read: they stay on the device until the loop must know
    them (a log record, a save, the end), then are read together, and the first non-finite step among
    them stops the run."""

    def __init__(self, run):
        self.run = run  # the loop's `gpt.train.trainer.Run`: its config, checkpoints and schedule
        self.steps: list[tuple[int, dict]] = []  # (step, device metrics), oldest first
        self.losses: list[float] = []  # read, not yet in a record
        self.grad_norm: float | None = None
        self.last_loss: float | None = None
        self.since, self.steps_timed = time.perf_counter(), 0
        c = run.config
        self.tokens_per_step = c.batch_size * c.grad_accum * c.block_size
        self.flops_per_step = flops_per_token(run.model_config, c.block_size) * self.tokens_per_step
        self.peak = peak_flops(c.peak_flops)

    def add(self, step: int, metrics: dict) -> None:
        """Keep `step`'s metrics, and wait (reading nothing) until at most `STEPS_IN_FLIGHT` steps are
        queued on the device: it always has the next one, and the batches queued for it stay few."""
        self.steps.append((step, metrics))
        if len(self.steps) > STEPS_IN_FLIGHT:
            self.steps[-STEPS_IN_FLIGHT - 1][1]["finite"].block_until_ready()

    def read(self, through: int) -> None:
        """Read the metrics of every pending step up to `through` (one transfer); raise NonFiniteStep
        naming the first that was not finite."""
        due = [(step, metrics) for step, metrics in self.steps if step <= through]
        self.steps = self.steps[len(due):]
        for step, values in zip([s for s, _ in due], jax.device_get([m for _, m in due])):
            if not values["finite"]:
                self.run.checkpoints.wait()  # a save in flight is of an earlier step, which was finite
                raise NonFiniteStep(_non_finite_message(step, values, self.run.checkpoints))
            self.losses.append(float(values["loss"]))
            self.grad_norm = float(values["grad_norm"])
        self.steps_timed += len(due)

    def record(self, step: int) -> dict:
        """The log record of `step`: the mean loss since the last record, the time a step took since then."""
        self.read(step)
        now = time.perf_counter()
        seconds = (now - self.since) / max(self.steps_timed, 1)
        record = {"step": step, "loss": float(np.mean(self.losses)), "lr": float(self.run.schedule(step - 1)),
                  "grad_norm": self.grad_norm, "tokens_per_s": self.tokens_per_step / seconds,
                  "mfu": self.flops_per_step / seconds / (self.peak * jax.device_count()) if self.peak else None}
        self.last_loss, self.losses, self.since, self.steps_timed = record["loss"], [], now, 0
        return record


def _non_finite_message(step: int, values: dict, checkpoints: CheckpointManager) -> str:
    named = {"loss": float(values["loss"]), "grad norm": float(values["grad_norm"])}
    bad = [f"{name} {value}" for name, value in named.items() if not np.isfinite(value)] or ["updated parameters"]
    last = checkpoints.latest_step()
    after = (f"The newest checkpoint, step {last} in {checkpoints.directory}, is finite: resume from it with a "
             f"lower --lr (and --resume_anyway)" if last is not None else
             "No checkpoint was saved before it: start again with a lower --lr")
    return f"step {step} gave a non-finite {', '.join(bad)}; it was not saved. {after}"
