"""The optimizer: AdamW over every parameter, or Muon over the blocks' matrices beside AdamW, each after
global-norm clipping and on a warmup + cosine or warmup-stable-decay schedule (`OptimizerConfig`, which
`TrainConfig.optimizer_config` makes from a run's flags)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from gpt.model.parameters import KERNELS

__all__ = ["OptimizerConfig", "make_optimizer", "make_schedule", "learning_rates", "muon_axes", "muon_or_adamw"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's own settings (`TrainConfig.optimizer_config` makes one from a run's flags)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    max_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    optimizer: Literal["adamw", "muon"] = "adamw"
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_steps: int = 0
    """wsd: the steps of the final linear decay to min_lr (the rest after warmup holds lr)."""
    muon_lr: float = 0.02
    muon_momentum: float = 0.95

    def without_schedule(self) -> OptimizerConfig:
        """This config with the schedule's numbers (the learning rates, the warmup, decay and total steps) at
        their defaults: what a compiled train step is specialized on. It takes each step's learning rates
        as arguments (`learning_rates`), so that runs that differ only in those numbers (a sweep over lr, a
        longer max_steps) share one compiled step."""
        defaults = OptimizerConfig()
        return dataclasses.replace(self, **{name: getattr(defaults, name) for name in _SCHEDULE_NUMBERS})


_SCHEDULE_NUMBERS = ("lr", "min_lr", "warmup_steps", "max_steps", "decay_steps", "muon_lr")


def make_schedule(config: OptimizerConfig, peak: float) -> optax.Schedule:
    """The learning rate at each step, rising linearly from 0 to `peak` over the warmup, then either a cosine
    to min_lr x peak / lr at max_steps (`cosine`) or held at `peak` until the last `decay_steps`, which fall
    linearly to it (`wsd`, warmup-stable-decay: the decay can start whenever the run is to end)."""
    end = config.min_lr * peak / config.lr
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=config.warmup_steps,
                                                  decay_steps=config.max_steps, end_value=end)
    stable = config.max_steps - config.warmup_steps - config.decay_steps
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, config.warmup_steps), optax.constant_schedule(peak),
         optax.linear_schedule(peak, end, config.decay_steps)],
        boundaries=[config.warmup_steps, config.warmup_steps + stable])


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
