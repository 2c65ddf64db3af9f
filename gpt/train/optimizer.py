"""The optimizer: AdamW over every parameter, or Muon over the blocks' matrices beside AdamW, each after
global-norm clipping and on a warmup + cosine or warmup-stable-decay schedule (`OptimizerConfig`: a run's
`TrainConfig.optim`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from gpt.errors import ConfigError
from gpt.model.parameters import KERNELS

__all__ = ["OptimizerConfig", "make_optimizer", "make_schedule", "learning_rates", "muon_axes", "muon_or_adamw"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its schedule: `TrainConfig.optim`, whose flags are train.py's own (`--lr`, not
    `--optim.lr`). Checked when made: a bad value is a ConfigError naming it and its bound."""

    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Muon (momentum orthogonalized by Newton-Schulz) for the
    blocks' matrices, AdamW for the embeddings, the head, norms and biases."""
    lr: float = 1e-3
    """Peak learning rate (AdamW's)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay (Muon's ends at the same fraction of muon_lr)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (--optimizer muon)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the warmup: a cosine decay over the whole run, or wsd (warmup-stable-decay): the peak held,
    then a linear decay over the last decay_fraction of the steps."""
    decay_fraction: float = 0.2
    """wsd: the share of max_steps spent decaying (at least one step)."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: 30, or a tenth of max_steps when that is fewer)."""
    max_steps: int = 300
    """Optimizer steps; the schedule spans them."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not biases, LayerNorms)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this (0 disables)."""

    def __post_init__(self):
        name = type(self).__name__
        if self.max_steps < 1:
            raise ConfigError(f"{name}.max_steps must be >= 1, got {self.max_steps}")
        if not 0 <= self.warmup < self.max_steps:  # the cosine decay needs at least one step after the warmup
            raise ConfigError(f"{name}.warmup_steps={self.warmup} must be in [0, max_steps={self.max_steps})")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"{name}.optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ConfigError(f"{name}.schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{name}.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.schedule == "wsd" and self.warmup + self.decay_steps > self.max_steps:
            raise ConfigError(f"{name}.warmup_steps={self.warmup} and the decay's {self.decay_steps} steps "
                              f"(decay_fraction={self.decay_fraction}) are more than max_steps={self.max_steps}")
        for field in ("lr", "muon_lr"):
            if not 0 < getattr(self, field) < math.inf:
                raise ConfigError(f"{name}.{field} must be positive and finite, got {getattr(self, field)}")
        if not 0 < self.min_lr <= self.lr:
            raise ConfigError(f"{name}.min_lr={self.min_lr} must be in (0, lr={self.lr}]")
        for field in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, field) < 1:
                raise ConfigError(f"{name}.{field} must be in [0, 1), got {getattr(self, field)}")
        for field in ("weight_decay", "grad_clip"):
            if not 0 <= getattr(self, field) < math.inf:
                raise ConfigError(f"{name}.{field} must be >= 0 and finite, got {getattr(self, field)}")

    @property
    def warmup(self) -> int:
        """warmup_steps, or its default: 30, at most a tenth of max_steps."""
        return self.warmup_steps if self.warmup_steps is not None else min(30, self.max_steps // 10)

    @property
    def decay_steps(self) -> int:
        """wsd: the steps of the final decay, decay_fraction of max_steps (at least 1)."""
        return max(1, round(self.decay_fraction * self.max_steps))

    def without_schedule(self) -> OptimizerConfig:
        """This config with the schedule's numbers (the learning rates, the warmup, decay and total steps) at
        their defaults: what a compiled train step is specialized on. It takes each step's learning rates
        as arguments (`learning_rates`), so that runs that differ only in those numbers (a sweep over lr, a
        longer max_steps) share one compiled step."""
        defaults = OptimizerConfig()
        return dataclasses.replace(self, **{name: getattr(defaults, name) for name in _SCHEDULE_NUMBERS})


_SCHEDULE_NUMBERS = ("lr", "min_lr", "warmup_steps", "max_steps", "decay_fraction", "muon_lr")


def make_schedule(config: OptimizerConfig, peak: float) -> optax.Schedule:
    """The learning rate at each step, rising linearly from 0 to `peak` over the warmup, then either a cosine
    to min_lr x peak / lr at max_steps (`cosine`) or held at `peak` until the last `decay_steps`, which fall
    linearly to it (`wsd`, warmup-stable-decay: the decay can start whenever the run is to end)."""
    end = config.min_lr * peak / config.lr
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=config.warmup,
                                                  decay_steps=config.max_steps, end_value=end)
    stable = config.max_steps - config.warmup - config.decay_steps
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, config.warmup), optax.constant_schedule(peak),
         optax.linear_schedule(peak, end, config.decay_steps)],
        boundaries=[config.warmup, config.warmup + stable])


# Muon's matrices, by parameter name: which axes a matrix's inputs are (reduction) and which its outputs;
# every other axis is a batch of matrices orthogonalized one by one (the layers; q, k and v apart).
def _muon_dimensions(w) -> optax.contrib.MuonDimensionNumbers:
    """A block matrix's Muon axes (after the layer axis, which like `separate` ones holds separate matrices):
    its inputs reduced over, its outputs the rest."""
    one_or_all = lambda axes: axes[0] if len(axes) == 1 else axes  # noqa: E731
    first_output = 1 + w.inputs + w.separate
    return optax.contrib.MuonDimensionNumbers(reduction_axis=one_or_all(tuple(range(1, 1 + w.inputs))),
                                              output_axis=one_or_all(tuple(range(first_output, 1 + len(w.shape)))))


_MUON_AXES = {name: _muon_dimensions(w) for name, w in KERNELS.items()}


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def muon_axes(params) -> dict:
    """The `MuonDimensionNumbers` of each of the blocks' matrices in a params tree; None for the rest."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _MUON_AXES.get(_leaf_name(path)), params)


def muon_or_adamw(params) -> dict:
    """Each parameter's optimizer under `--optimizer muon`: "muon" for the blocks' matrices, else "adamw"."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "muon" if _leaf_name(path) in _MUON_AXES else "adamw",
                                            params)


def learning_rates(config: OptimizerConfig, count: jax.Array) -> jax.Array:
    """float32 [2]: AdamW's and Muon's learning rates at step `count` (the steps taken so far)."""
    rates = [make_schedule(config, peak)(count) for peak in (config.lr, config.muon_lr)]
    return jnp.asarray(rates, jnp.float32)  # never weakly typed (a constant schedule's is): one compiled step


def make_optimizer(config: OptimizerConfig, rates: jax.Array | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW (weight decay on matrices only) over every parameter (`adamw`), or
    Muon over the blocks' matrices and AdamW over the rest: embeddings, the head, norms and biases (`muon`).
    Returns (the optimizer, AdamW's learning-rate schedule); Muon's follows the same shape from muon_lr.

    rates: `learning_rates(config, count)` of the step being taken (traced, in a compiled step), in place of
    the schedules; the optimizer state is the same either way (the schedules' step counts stay in it)."""
    schedule = make_schedule(config, config.lr)
    adamw_lr, muon_lr = ((schedule, make_schedule(config, config.muon_lr)) if rates is None
                         else (lambda count: rates[0], lambda count: rates[1]))
    adamw = optax.adamw(adamw_lr, b1=config.beta1, b2=config.beta2, weight_decay=config.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if config.optimizer == "muon":
        muon = optax.contrib.muon(muon_lr, beta=config.muon_momentum,
                                  weight_decay=config.weight_decay, muon_weight_dimension_numbers=muon_axes)
        adamw = optax.partition({"muon": muon, "adamw": adamw}, muon_or_adamw)
    chain = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
    return optax.chain(*chain, adamw), schedule
