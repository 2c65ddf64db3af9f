"""The training step: the train state on a mesh, one jitted update with donated state, and eval.

The step (forward, backward, gradient accumulation, the optimizer's update: `gpt.train.optimizer`) is one
`jax.jit` with the params and optimizer state donated and sharded by `gpt.model.sharding` over a mesh; the
same code runs on one CPU, one GPU, or many devices and hosts. It also reports, as one fused reduction, whether the step's loss,
gradient norm and updated parameters are all finite: the loop never saves a step that is not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gpt.hardware import chip_of
from gpt.model.backend import choices
from gpt.model.config import GPTConfig
from gpt.model.sharding import abstract, param_shardings, replicated
from gpt.model.transformer import GPT, flops_per_token, in_compute_dtype
from gpt.train.optimizer import OptimizerConfig, learning_rates, make_optimizer

__all__ = ["loss_fn", "init_train_state", "abstract_train_state", "make_train_step", "make_eval_step", "all_finite",
           "flops_per_token", "peak_flops", "TrainStep"]


def loss_fn(model: GPT, batch_BT1: jax.Array, dropout_key: jax.Array | None = None,
            label_smoothing: float = 0.0, scored_only: bool = False) -> jax.Array:
    """Mean next-token cross-entropy (nats, float32) of int32 windows [B, T + 1] (against smoothed targets
    with `label_smoothing` > 0). With `scored_only` (conversations: `gpt.data.conversations`), an entry e < 0 is
    the token ~e, which the model reads but is not taught to predict; the mean is over the others."""
    tokens_BT1 = jnp.where(batch_BT1 < 0, ~batch_BT1, batch_BT1) if scored_only else batch_BT1
    return model.loss(tokens_BT1[:, :-1], batch_BT1[:, 1:], dropout_key=dropout_key, label_smoothing=label_smoothing,
                      scored_only=scored_only)


def init_train_state(model: GPT, optimizer: OptimizerConfig, mesh: jax.sharding.Mesh):
    """Place the model's params on `mesh` as `gpt.model.sharding.RULES` say and create `optimizer`'s state
    beside them: each Adam moment sharded like its parameter, scalars (the step count) replicated.

    Returns (graphdef, params, opt_state, (param_shardings, opt_shardings)); params and param_shardings
    are pure dicts shaped like `nnx.to_pure_dict(nnx.state(model))`.
    """
    graphdef, state = nnx.split(model)
    shardings = param_shardings(model, mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    init = _optimizer_of(optimizer.without_schedule()).init  # the schedule's numbers are not in the state
    opt_shardings = _optimizer_shardings(init, params, shardings, mesh)
    # Pinned: left to propagation, XLA may replicate the zeros that the moments start from.
    opt_state = jax.jit(init, out_shardings=opt_shardings)(params)
    return graphdef, params, opt_state, (shardings, opt_shardings)


def abstract_train_state(config: GPTConfig, optimizer: OptimizerConfig, mesh: jax.sharding.Mesh):
    """`init_train_state`'s results as shapes alone (`jax.ShapeDtypeStruct`s carrying their shardings), for a
    model of `config`: nothing is allocated, so `mesh` may be of devices this machine lacks (a TPU topology)."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    shardings = param_shardings(model, mesh)
    params = abstract(nnx.to_pure_dict(state), shardings)
    init = _optimizer_of(optimizer.without_schedule()).init
    opt_shardings = _optimizer_shardings(init, params, shardings, mesh)
    opt_state = abstract(jax.eval_shape(init, params), opt_shardings)
    return graphdef, params, opt_state, (shardings, opt_shardings)


@functools.cache
def _optimizer_of(config: OptimizerConfig) -> optax.GradientTransformation:
    """One optimizer per config, so that its init compiles once a process for equal configs."""
    return make_optimizer(config)[0]


def _optimizer_shardings(init, params, shardings, mesh):
    """The optimizer state's shardings: a leaf whose path ends with a parameter's path (mu/.../fc_kernel)
    and has its shape is sharded like it; anything else is replicated."""
    by_path = {tuple(path): (sharding, leaf.shape) for (path, sharding), leaf in
               zip(jax.tree_util.tree_leaves_with_path(shardings), jax.tree.leaves(params))}

    def pick(path, leaf):
        for start in range(len(path)):
            sharding, shape = by_path.get(tuple(path[start:]), (None, None))
            if sharding is not None and shape == leaf.shape:
                return sharding
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(init, params))


def all_finite(*trees) -> jax.Array:
    """bool []: every element of every array is finite (one fused reduction per array, no overflow).
    Traceable; integer arrays count as finite."""
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(trees)]).all()


def make_train_step(graphdef, optimizer: OptimizerConfig, dropout: bool, mesh: jax.sharding.Mesh, shardings: tuple,
                    label_smoothing: float = 0.0, scored_only: bool = False):
    """step(params, opt_state, batch [A, B, T+1], key) -> (params, opt_state, {loss, grad_norm, finite}),
    compiled for `mesh` (the activations' sharding constraints refer to it); the new params and optimizer
    state keep `shardings` (param_shardings, opt_shardings), so donation reuses their buffers step after
    step. `finite` (bool) is False when the loss, the gradient norm or any updated parameter is not.
    The loss trained on (and reported) uses `label_smoothing`, and `scored_only` (`loss_fn`).

    The step's learning rates come from a small program of their own (the schedule, at the optimizer
    state's step count), so that the step is compiled for `optimizer.without_schedule()`: it is made once
    per process for equal arguments otherwise, and a second run in the process (a resumed one, or one with
    another lr or max_steps) reuses the first one's compiled step, as a later process does through the
    persistent compilation cache. The numbers come out as they would with the schedule inside the step."""
    leaves, treedef = jax.tree.flatten(shardings)
    jitted = _train_step(graphdef, optimizer.without_schedule(), dropout, mesh, tuple(leaves), treedef,
                         label_smoothing, scored_only)
    return TrainStep(jitted, _rates_at_step(optimizer), mesh)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """`make_train_step`'s step: call it as step(params, opt_state, batch [A, B, T+1], key)."""

    jitted: Callable
    """The jitted step, which also takes the step's learning rates."""
    rates: Callable
    """opt_state -> the learning rates of the step it is about to take."""
    mesh: jax.sharding.Mesh
    program: jax.stages.Compiled | None = None
    """`lower(...).compile()` of the arguments every call passes, which calls then run (`with_program`)."""

    def __call__(self, params, opt_state, batch_ABT1, key):
        with jax.set_mesh(self.mesh):
            step = self.program if self.program is not None else self.jitted
            return step(params, opt_state, batch_ABT1, key, self.rates(opt_state))

    def with_program(self, program: jax.stages.Compiled) -> TrainStep:
        """This step, its calls running `program`: compiled once, ahead of the first call (which can then be
        checked against the device's memory), where the jitted step would compile it again."""
        return dataclasses.replace(self, program=program)

    def lower(self, params, opt_state, batch_ABT1, key) -> jax.stages.Lowered:
        """The step's program for these arguments (arrays, or `jax.ShapeDtypeStruct`s with their shardings)."""
        with jax.set_mesh(self.mesh):
            rates = jax.eval_shape(self.rates, opt_state)
            return self.jitted.lower(params, opt_state, batch_ABT1, key, rates)

    def compiled_text(self, params, opt_state, batch_ABT1, key) -> str:
        """The optimized HLO of the program a call with these arguments runs (XLA's names for its ops, which
        a profile's events carry, with the named scopes of the code each came from): that of `program` when the
        step has one (compiled for the arguments every call passes), else compiled for these."""
        program = self.program or self.lower(params, opt_state, batch_ABT1, key).compile()
        return program.as_text()


@functools.lru_cache(maxsize=16)
def _rates_at_step(optimizer: OptimizerConfig):
    """opt_state -> float32 [2]: the learning rates of the step that `opt_state` is about to take."""
    def rates(opt_state):
        steps_taken = optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]  # every count agrees
        return learning_rates(optimizer, steps_taken)

    return jax.jit(rates)  # called on the step's mesh (`TrainStep.__call__`)


@functools.lru_cache(maxsize=16)
def _train_step(graphdef, optimizer_without_schedule, dropout, mesh, sharding_leaves, sharding_tree, label_smoothing,
                scored_only):
    shardings = jax.tree.unflatten(sharding_tree, sharding_leaves)

    def step(params, opt_state, batch_ABT1, key, rates):
        optimizer, _ = make_optimizer(optimizer_without_schedule, rates)
        forward_params = _as_forward_reads(graphdef, params)

        def micro(grad_sum, xs):
            batch, micro_key = xs
            loss_and_grad = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch,
                                                                 micro_key if dropout else None, label_smoothing,
                                                                 scored_only))
            loss, grads = loss_and_grad(forward_params)
            with jax.named_scope("accumulate"):  # a gradient of a cast weight is in its compute dtype: summed in
                return jax.tree.map(lambda total, g: total + g.astype(total.dtype), grad_sum, grads), loss  # float32

        accum = batch_ABT1.shape[0]
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro, zeros, (batch_ABT1, jax.random.split(key, accum)))
        with jax.named_scope("optimizer"):  # the scopes sort a profile's time (bench/step_profile.py)
            grads = jax.tree.map(lambda g: g / accum, grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            loss, grad_norm = losses.mean(), optax.tree.norm(grads)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm,
                                   "finite": all_finite(loss, grad_norm, params)}

    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, replicated(mesh)))


def _as_forward_reads(graphdef, params: dict) -> dict:
    """`params`, with the blocks' weights already in the compute dtype where the backend casts them once a step
    (`params_cast_once`) rather than in each micro-batch's forward. The gradients are the same numbers: a
    cast's gradient is the cotangent cast back, which the accumulation does."""
    if not choices().params_cast_once:
        return params
    config = nnx.merge(graphdef, params).config
    return {**params, "blocks": in_compute_dtype(config, params["blocks"])}


@functools.lru_cache(maxsize=16)
def make_eval_step(graphdef, mesh: jax.sharding.Mesh, scored_only: bool = False):
    """eval(params, batch [B, T+1]) -> mean loss (float32 [], `loss_fn`'s); made once per process for equal
    arguments."""

    def eval_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch, scored_only=scored_only)

    return _on_mesh(jax.jit(eval_loss), mesh)


def _on_mesh(function, mesh: jax.sharding.Mesh):
    def call(*args):
        with jax.set_mesh(mesh):
            return function(*args)

    return call


def peak_flops(given: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `given`, else its chip's rating (`gpt.hardware.CHIPS`; None when unknown,
    e.g. CPUs)."""
    if given:
        return given
    chip = chip_of(jax.devices()[0].device_kind)
    return None if chip is None else chip.bf16_flops
