"""The optimizers and schedules of the training step against optax's own, on small arrays; one compiled step
for runs that differ only in their schedule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpt.model import backend
from gpt.model.config import GPTConfig
from gpt.model.sharding import make_mesh
from gpt.model.transformer import GPT
from gpt.train import step as step_module
from gpt.train.optimizer import OptimizerConfig, make_optimizer, make_schedule, muon_or_adamw
from gpt.train.step import init_train_state, make_train_step

from jaxprs import walk

L, D, N, H, F, V = 2, 8, 2, 4, 12, 10
SHAPES = {"q_kernel": (L, D, N, H), "kv_kernel": (L, D, 2, N, H), "out_kernel": (L, N, H, D), "fc_kernel": (L, D, F),
          "proj_kernel": (L, F, D), "ln1_scale": (L, D)}
MUON = OptimizerConfig(optimizer="muon", lr=1e-2, muon_lr=0.05, warmup_steps=0, max_steps=10, schedule="wsd",
                       decay_fraction=0.2, grad_clip=0.0, weight_decay=0.1)


def as_matrices(name: str, a: np.ndarray) -> list[np.ndarray]:
    """The separate [inputs, outputs] matrices Muon orthogonalizes in a stacked kernel: one per layer
    (and per k and v)."""
    if name == "q_kernel":
        return [a[layer].reshape(D, N * H) for layer in range(L)]
    if name == "kv_kernel":
        return [a[layer, :, part].reshape(D, N * H) for layer in range(L) for part in range(2)]
    if name == "out_kernel":
        return [a[layer].reshape(N * H, D) for layer in range(L)]
    return [a[layer] for layer in range(L)]


def params_and_grads(seed: int):
    rng = np.random.default_rng(seed)
    params = {"wte": rng.normal(size=(V, D)).astype(np.float32),
              "blocks": {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}}
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(2)]
    return params, grads


def updates_of(optimizer, params, grads) -> list:
    """The updates of two steps from `params` with gradients `grads` (the second uses the momentum), each
    step compiled once a shape (run op by op, the dozen matrices' Newton-Schulz iterations take seconds)."""
    state, out = optimizer.init(params), []
    for grad in grads:
        update, state = jax.jit(optimizer.update)(grad, state, params)
        params = optax.apply_updates(params, update)
        out.append(update)
    return out


def test_muon_updates_each_matrix_as_optax_muon_does_and_adamw_the_rest():
    params, grads = params_and_grads(0)
    ours = updates_of(make_optimizer(MUON)[0], params, grads)
    assert muon_or_adamw(params) == {"wte": "adamw", "blocks": {"q_kernel": "muon", "kv_kernel": "muon", "out_kernel": "muon",
                                                                "fc_kernel": "muon", "proj_kernel": "muon",
                                                                "ln1_scale": "adamw"}}
    reference_muon = optax.contrib.muon(MUON.muon_lr, beta=MUON.muon_momentum, weight_decay=MUON.weight_decay)
    for name in ("q_kernel", "kv_kernel", "out_kernel", "fc_kernel", "proj_kernel"):
        matrices = zip(*(as_matrices(name, g["blocks"][name]) for g in grads))
        for index, (matrix, (grad0, grad1)) in enumerate(zip(as_matrices(name, params["blocks"][name]), matrices)):
            want = updates_of(reference_muon, matrix, [grad0, grad1])
            for step in range(2):
                got = as_matrices(name, np.asarray(ours[step]["blocks"][name]))[index]
                np.testing.assert_allclose(got, want[step], atol=2e-6, err_msg=f"{name} #{index}, step {step}")
    reference_adamw = optax.adamw(MUON.lr, b1=MUON.beta1, b2=MUON.beta2, weight_decay=MUON.weight_decay,
                                  mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p))
    others = {"wte": params["wte"], "ln1_scale": params["blocks"]["ln1_scale"]}
    want = updates_of(reference_adamw, others, [{"wte": g["wte"], "ln1_scale": g["blocks"]["ln1_scale"]} for g in grads])
    for step in range(2):
        np.testing.assert_allclose(ours[step]["wte"], want[step]["wte"], atol=1e-7)
        np.testing.assert_allclose(ours[step]["blocks"]["ln1_scale"], want[step]["ln1_scale"], atol=1e-7)


def test_warmup_stable_decay_holds_the_peak_then_falls_linearly_to_min_lr():
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=100, schedule="wsd", decay_fraction=0.2)
    schedule = make_schedule(config, config.lr)
    assert float(schedule(0)) == 0.0 and float(schedule(5)) == pytest.approx(5e-4)
    assert all(float(schedule(step)) == pytest.approx(1e-3) for step in (10, 50, 80))
    assert float(schedule(90)) == pytest.approx(5.5e-4) and float(schedule(100)) == pytest.approx(1e-4)
    muon = make_schedule(config, 0.02)  # Muon's has the same shape, ending at the same fraction of its peak
    assert float(muon(50)) == pytest.approx(0.02) and float(muon(100)) == pytest.approx(0.002)


def test_the_cosine_schedule_is_optax_warmup_cosine():
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=100)
    want = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100, 1e-4)
    for step in (0, 5, 10, 40, 99, 100):
        assert float(make_schedule(config, config.lr)(step)) == pytest.approx(float(want(step)))


@pytest.mark.slow
def test_runs_that_differ_in_their_schedule_share_one_compiled_step_and_each_keeps_its_own():
    # Two runs of one model with different learning rates, warmups and lengths: the second compiles no step
    # of its own, and its steps are bit for bit those it takes alone. (That a step is what it was with the
    # schedule inside it: test_train_loop resumes run directories of the code before, bit for bit.)
    mesh = make_mesh(devices=jax.devices()[:1])
    batches = np.random.default_rng(0).integers(0, 256, (3, 2, 4, 17), dtype=np.int32)  # [step, A, B, T + 1]
    first = OptimizerConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, max_steps=4, grad_clip=0.5)
    second = dataclasses.replace(first, lr=3e-2, min_lr=2e-2, warmup_steps=0, max_steps=50)
    compiled = []

    def steps(optimizer):
        """The params after `batches`, and how many times the train step compiled for them."""
        graphdef, params, opt_state, shardings = init_train_state(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)),
                                                                  optimizer, mesh)
        step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
        compiled.clear()
        for batch in batches:
            params, opt_state, _ = step(params, opt_state, batch, jax.random.key(0))
        return [np.asarray(leaf) for leaf in jax.tree.leaves(params)], compiled.count("jit(step)")

    def listener(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        alone, _ = steps(second)
        jax.clear_caches()
        (after_first, first_compiles), (after_second, second_compiles) = steps(first), steps(second)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert (first_compiles, second_compiles) == (1, 0)
    for got, want in zip(after_second, alone):
        np.testing.assert_array_equal(got, want)
    assert any(not np.array_equal(a, b) for a, b in zip(after_first, after_second))  # the schedules differ


@pytest.mark.slow  # a GPU lever, off by default: two full steps compiled each way
def test_casting_the_blocks_weights_once_a_step_changes_no_number(monkeypatch):
    # The backend's `params_cast_once`: the blocks' matrices cast to bfloat16 before the micro-batches' loop
    # rather than inside it, and every parameter, moment and loss after two steps bit for bit the same.
    mesh = make_mesh(devices=jax.devices()[:1])
    config = GPTConfig.preset("tiny", dtype="bfloat16")
    batches = np.random.default_rng(0).integers(0, 256, (2, 3, 2, 17), dtype=np.int32)  # [step, A, B, T + 1]
    optimizer = OptimizerConfig(lr=1e-2, warmup_steps=1, max_steps=4)

    def two_steps():
        """Every array after two steps, and how many matrices the micro-batches' loop casts to bfloat16."""
        step_module._train_step.cache_clear()
        jax.clear_caches()
        graphdef, params, opt_state, shardings = init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)
        train = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(train.jitted)(params, opt_state, batches[0], jax.random.key(0),
                                                 train.rates(opt_state))
        loops = [eqn.params["jaxpr"].jaxpr for eqn in walk(jaxpr.jaxpr) if eqn.primitive.name == "scan"]
        matrices = {shape for a in params["blocks"].values() if a.ndim > 2 for shape in (a.shape, a.shape[1:])}
        casts = sum(eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.bfloat16
                    and eqn.invars[0].aval.shape in matrices for loop in loops for eqn in walk(loop))
        for batch in batches:
            params, opt_state, metrics = train(params, opt_state, batch, jax.random.key(0))
        return [np.asarray(a) for a in jax.tree.leaves((params, opt_state, metrics["loss"]))], casts

    each_micro_batch, casts_in_loop = two_steps()
    monkeypatch.setenv(backend.OVERRIDE_ENV, '{"params_cast_once": true}')
    once, casts_in_loop_once = two_steps()
    assert casts_in_loop > 0 and casts_in_loop_once == 0
    assert len(once) == len(each_micro_batch)
    for got, want in zip(once, each_micro_batch):
        np.testing.assert_array_equal(got, want)
