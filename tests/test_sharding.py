"""Sharding: every mesh gives the single-device result; memory shrinks as the mesh says; bad meshes fail."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference.sampling import GREEDY
from gpt.model.config import GPTConfig
from gpt.model.sharding import bytes_per_device, make_mesh, param_shardings
from gpt.model.transformer import GPT
from gpt.train import TrainConfig, train
from gpt.train.checkpoint import load_model
from gpt.train.optimizer import OptimizerConfig
from gpt.train.step import init_train_state, make_train_step

from bounds import bound
from training import free_port

ROOT = Path(__file__).resolve().parents[1]
# (data, fsdp, tensor); the quick tier runs the one with all three axes.
MESHES = [pytest.param((8, 1, 1), marks=pytest.mark.slow), (2, 2, 2), pytest.param((1, 2, 4), marks=pytest.mark.slow),
          pytest.param((1, 1, 8), marks=pytest.mark.slow)]
# Every sharded dimension divides by every mesh above: 8 heads, width 64, MLP 256, vocabulary 256.
CONFIG = GPTConfig.preset("tiny", n_head=8, n_embd=64)


def mesh_of(data, fsdp, tensor):
    return make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])


LR = 1e-2
ADAMW = OptimizerConfig(lr=LR, warmup_steps=0, max_steps=10)  # the training optimizer: clipping, then AdamW


def one_step(mesh, optimizer=ADAMW, config=CONFIG):
    """Loss, grad norm and params after one step (2 accumulated micro-batches of 8 rows) on `mesh`, with the
    params and optimizer state as the step returns them (on the mesh)."""
    graphdef, params, opt_state, shardings = init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)
    batch = np.random.default_rng(0).integers(0, config.vocab_size, (2, 8, 17), dtype=np.int32)
    step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
    params, opt_state, metrics = step(params, opt_state, batch, jax.random.key(0))
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.tree.map(np.asarray, params), (params, opt_state)


@functools.cache
def adamw_step(shape):
    """`one_step` of CONFIG under the training optimizer on the mesh `shape` (data, fsdp, tensor): one
    compiled train step per mesh, shared by the tests that check what it computes and what it stores."""
    return one_step(mesh_of(*shape))


def gradient(grad_norm, opt_state):
    """The step's gradient, read back from AdamW's first moment: after one step mu = (1 - beta1) x the
    gradient clipped to norm grad_clip (both known), so this is the gradient itself, up to one rounding."""
    config = ADAMW
    scale = (1 - config.beta1) * min(1.0, config.grad_clip / grad_norm)
    return jax.tree.map(lambda mu: np.asarray(mu) / scale, optax.tree_utils.tree_get(opt_state, "mu"))


def assert_trees_close(got, want, atol, mask=None):
    masks = jax.tree.leaves(mask) if mask is not None else [None] * len(jax.tree.leaves(want))
    for (path, a), b, m in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), masks):
        np.testing.assert_allclose(a if m is None else a[m], b if m is None else b[m], rtol=0, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "data{}-fsdp{}-tensor{}".format(*s))
def test_train_step_matches_one_device(shape):
    loss, grad_norm, params, (_, opt_state) = adamw_step(shape)
    want_loss, want_grad_norm, want_params, (_, want_opt_state) = adamw_step((1, 1, 1))
    # The gradient agrees everywhere: the sharded forward, backward and accumulation compute the
    # single-device gradient up to float32 summation order (~5e-8 here).
    assert abs(loss - want_loss) < 1e-5 and abs(grad_norm - want_grad_norm) < 1e-5
    want_gradient = gradient(want_grad_norm, want_opt_state)
    assert_trees_close(gradient(grad_norm, opt_state), want_gradient, atol=1e-5)

    # AdamW's first update is lr * g / (|g| + 1e-8): where a gradient element is itself near 1e-8 (an
    # exactly-zero one, like the key bias's, or a near-cancelling sum) that summation-order noise is
    # divided by 1e-8, so the update there may differ by up to its bound, lr. Everywhere else: 1e-5.
    conditioned = jax.tree.map(lambda g: np.abs(g) > 1e-6, want_gradient)
    # (the exempt ~3%: mostly position rows 16-63, unused by 16-token windows, whose gradient is 0)
    assert np.mean(np.concatenate([m.ravel() for m in jax.tree.leaves(conditioned)])) > 0.95
    assert_trees_close(params, want_params, atol=1e-5, mask=conditioned)
    assert_trees_close(params, want_params, atol=2 * LR)


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_the_modern_recipe_trains_on_a_mesh_as_on_one_device():
    # Rotary positions, QK-norm, relu(x)^2, an untied head and no biases, stepped by Muon (the blocks'
    # matrices) and AdamW (the rest). Newton-Schulz normalizes each matrix's momentum as a whole, so its
    # updates agree to float32 noise; the AdamW ones, as above, within lr where a gradient is ~0.
    config = CONFIG.replace(position="rope", qk_norm=True, activation="relu2", tied_head=False, bias=False)
    muon = OptimizerConfig(lr=LR, warmup_steps=0, max_steps=10, optimizer="muon")
    loss, _, want, _ = one_step(mesh_of(1, 1, 1), muon, config)
    sharded_loss, _, got, _ = one_step(mesh_of(2, 2, 2), muon, config)
    assert abs(sharded_loss - loss) < 1e-5
    assert_trees_close(got["blocks"], want["blocks"], atol=1e-5)
    assert_trees_close(got, want, atol=2 * LR)
    initial = nnx.to_pure_dict(nnx.state(GPT(config, rngs=nnx.Rngs(0))))
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), initial, want)
    assert min(jax.tree.leaves(moved["blocks"])) > 1e-3  # every block's weights took a step


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "data{}-fsdp{}-tensor{}".format(*s))
def test_params_and_optimizer_state_shrink_with_fsdp_times_tensor(shape):
    # Every matrix (and its two Adam moments) is split over both fsdp and tensor: 1/(fsdp x tensor) of it
    # per device, exactly. Vectors (biases, LayerNorms: 1.5% of this model, 0.1% of GPT-2) split over one
    # of the two axes, and the step count not at all, so they add at most their own size on top; so does
    # the position table, whose rows are split over fsdp and not over tensor (positions are no vocabulary).
    mesh = mesh_of(*shape)
    ways = shape[1] * shape[2]
    initial = init_train_state(GPT(CONFIG, rngs=nnx.Rngs(0)), ADAMW, mesh)[1:3]
    *_, after_one_step = adamw_step(shape)
    for state in (initial, after_one_step):  # as created, and as the step returns it
        matrix_bytes = vector_bytes = 0
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            name = jax.tree_util.keystr(path)
            if leaf.ndim == 0 or name.endswith(("bias']", "scale']", "['wpe']")):
                vector_bytes += leaf.nbytes
            else:
                matrix_bytes += leaf.nbytes
                assert {shard.data.nbytes * ways for shard in leaf.addressable_shards} == {leaf.nbytes}, name
        per_device = bytes_per_device(state)
        assert len(per_device) == np.prod(shape)
        for device, stored in per_device.items():
            assert matrix_bytes / ways < stored <= matrix_bytes / ways + vector_bytes, device


def test_a_vocabulary_the_mesh_does_not_divide_is_replicated():
    model = GPT(GPTConfig.preset("tiny", vocab_size=257), rngs=nnx.Rngs(0))  # like GPT-2's 50257
    shardings = param_shardings(model, mesh_of(1, 1, 2))
    assert shardings["wte"].spec == jax.sharding.PartitionSpec(None, "fsdp")  # rows replicated
    assert shardings["blocks"]["fc_kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def test_a_dimension_the_mesh_cannot_split_is_an_error():
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))  # 4 heads
    with pytest.raises(ConfigError, match=r"heads=4\) cannot be split 8 ways"):
        param_shardings(model, mesh_of(1, 1, 8))
    with pytest.raises(ConfigError, match=r"embed=32\) cannot be split 3 ways"):
        param_shardings(model, make_mesh(1, 3, 1, devices=jax.devices()[:3]))


def test_a_mesh_that_does_not_match_the_devices_is_an_error():
    with pytest.raises(ConfigError, match="= 12 devices, but there are 8"):
        make_mesh(2, 2, 3)
    with pytest.raises(ConfigError, match="do not divide the 8 devices"):
        make_mesh(-1, 3, 1)
    with pytest.raises(ConfigError, match="must be divisible by the data-parallel devices"):
        train(TrainConfig(mesh="data=4,fsdp=2", batch_size=12), log=lambda *_: None)


@pytest.fixture(scope="module")
def decisive_model():
    # Scaled random weights make the top two logits differ by far more than float noise at every step.
    model = GPT(CONFIG, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, state))
    return model


@pytest.mark.slow  # the quick tier keeps the train step's check on the same mesh
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "data{}-fsdp{}-tensor{}".format(*s))
def test_greedy_generate_matches_one_device(shape, decisive_model):
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [200]]
    want = generate(decisive_model, prompts, 20, sampling=GREEDY)
    got = generate(decisive_model, prompts, 20, sampling=GREEDY, mesh=mesh_of(*shape))
    assert got == want
    assert len(set(map(tuple, want))) == 3  # the rows differ, so a mixed-up row would show


@pytest.mark.slow  # the quick tier decodes over a mesh above; this, that its warm-up left nothing to compile
def test_an_engine_over_a_mesh_compiles_nothing_after_its_warm_up(decisive_model):
    """Every program a request runs was compiled by the warm-up: over a mesh too, where the slots' arrays had
    taken the layouts of whatever computed them, so that a server's first requests compiled `place` and
    `decode` again (~10 s on 2 cores) while every stream waited."""
    from gpt.inference.engine import Engine
    from gpt.inference.request import Request
    from gpt.inference.sampling import Sampling

    compiled = []

    def listener(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    engine = Engine(decisive_model, slots=4, cache_length=64, mesh=mesh_of(2, 1, 2))
    engine.warmup(log=lambda line: None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(2):  # a second round after the first's slots were freed and filled again
            completions = [engine.submit(Request([1, 2, 3, 1, 2], 12, GREEDY, stop_tokens=[7])),
                           engine.submit(Request([40, 41], 20, Sampling(temperature=0.9, top_k=20), seed=1)),
                           engine.submit(Request([9] * 30, 6, GREEDY, logprobs=2, prompt_logprobs=True))]
            engine.run(completions)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(c.finish_reason in ("length", "stop") for c in completions)
    assert compiled == []


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_four_devices(tmp_path, corpus_text):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text[:100_000])
    model = {"n_layer": 2, "n_head": 2, "n_embd": 64}
    flags = dict(data=(str(corpus),), val_fraction=0.5, block_size=32, batch_size=8, max_steps=5, warmup_steps=1, log_interval=1,
                 eval_interval=5, eval_iters=2, checkpoint_interval=5, sample_tokens=0)
    one = train(TrainConfig.from_flags(out_dir=str(tmp_path / "one"), num_devices=4, model=GPTConfig.preset("small", **model),
                            **flags), log=lambda *_: None)

    port, env = free_port(), {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                               "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(ROOT / "train.py"), "--out_dir", str(tmp_path / "two"),
               "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2"]
    for key, value in flags.items():
        command += [f"--{key}", *map(str, value if isinstance(value, tuple) else (value,))]
    for key, value in model.items():
        command += [f"--model.{key}", str(value)]
    workers = [subprocess.Popen(command + ["--process_id", str(i)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [w.communicate(timeout=bound(300))[0] for w in workers]
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output[-3000:]

    def losses(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if "loss" in r]

    assert len(losses("two")) == 5
    np.testing.assert_allclose(losses("two"), losses("one"), rtol=1e-5)
    restored = nnx.state(load_model(tmp_path / "two"), nnx.Param)  # one process reads the 2-process save
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(nnx.state(one.model, nnx.Param))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
