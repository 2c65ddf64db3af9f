"""Pretraining: a TrainConfig, one jitted AdamW step with donated state, eval, logging, checkpoints.

The step (forward, backward, gradient accumulation, clipping, AdamW) is one `jax.jit` with the params
and optimizer state donated and sharded by `gpt.sharding` over a mesh; the same code runs on one CPU,
one GPU, or many devices and hosts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from gpt import gpt2
from gpt.checkpoint import CheckpointManager, config_to_json
from gpt.config import GPTConfig
from gpt.data import Batches, default_corpus, prepare
from gpt.model import GPT
from gpt.tokenizer import get_tokenizer
from gpt.sharding import (batch_sharding, bytes_per_device, data_parallel_size, initialize_distributed, make_mesh,
                          param_shardings, parse_mesh, replicated)

__all__ = ["TrainConfig", "train", "make_optimizer", "make_train_step", "init_train_state", "loss_fn",
           "flops_per_token"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; `python train.py --help` lists these as flags."""

    data: tuple[str, ...] = ()
    """Text files, directories or globs to train on; empty trains on the embedded default corpus (the
    running Python's standard-library sources)."""
    out_dir: str = "out"
    """Where the tokenized data, checkpoints, metrics.jsonl and TensorBoard events go; a run resumes from
    the latest checkpoint here automatically."""
    val_fraction: float = 0.05
    """The share of the corpus (its end) held out for evaluation."""
    init_from: str = "scratch"
    """'scratch', or GPT-2 weights to fine-tune: a hub name (gpt2, gpt2-medium, ...) or an HF directory."""
    model: str = "small"
    """The GPTConfig preset for a model trained from scratch."""
    n_layer: int | None = None
    """Override the preset's depth."""
    n_head: int | None = None
    """Override the preset's head count."""
    n_embd: int | None = None
    """Override the preset's width."""
    position: str | None = None
    """Override the preset's position scheme: learned, sinusoidal or rope."""
    dropout: float = 0.0
    """Dropout on embeddings and residual branches."""
    block_size: int = 128
    """Tokens per training sequence (at most the model's context)."""
    batch_size: int = 8
    """Sequences per micro-batch (the global batch, over all devices and hosts)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Linear warmup steps."""
    max_steps: int = 300
    """Optimizer steps; the cosine decay spans them."""
    stop_after: int | None = None
    """Stop (with a checkpoint) at this step, though the schedule spans max_steps; resume later."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not biases, LayerNorms)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this (0 disables)."""
    dtype: str = "float32"
    """Compute dtype (bfloat16 on GPUs)."""
    param_dtype: str = "float32"
    """Parameter and optimizer-state dtype."""
    remat: bool = False
    """Recompute activations in the backward pass to save memory."""
    scan_layers: bool = False
    """Run the layers as one lax.scan: compile time flat in depth, a slightly slower step."""
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: int = 10
    checkpoint_interval: int = 100
    keep_checkpoints: int = 3
    seed: int = 0
    mesh: str = ""
    """Device mesh, e.g. 'data=2,fsdp=2,tensor=2'; empty puts every device on data."""
    num_devices: int | None = None
    """Use only the first N devices (default: all of them)."""
    distributed: bool = False
    """Run as one of several processes (jax.distributed): on SLURM, Open MPI or Cloud TPU the rest is
    found automatically; elsewhere give the three flags below (which imply this one)."""
    coordinator_address: str | None = None
    """host:port of process 0, the same on every process."""
    num_processes: int | None = None
    """How many processes take part (with coordinator_address)."""
    process_id: int | None = None
    """This process's index, 0 .. num_processes - 1."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, for MFU; known GPUs are looked up, unknown devices report no MFU."""
    sample_tokens: int = 200
    """Tokens of a sample printed at the end (0 for none)."""

    def __post_init__(self):
        for name in ("block_size", "batch_size", "grad_accum", "max_steps", "eval_iters", "log_interval",
                     "eval_interval", "checkpoint_interval", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be in [0, max_steps={self.max_steps}]")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig.min_lr={self.min_lr} must be in (0, lr={self.lr}]")


# ------------------------------------------------------------------------------------------ the step

def loss_fn(model: GPT, batch_BT1: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats, float32) of int32 windows [B, T + 1]."""
    return model.loss(batch_BT1[:, :-1], batch_BT1[:, 1:], dropout_key=dropout_key)


def make_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup + cosine decay, decay on matrices only, global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
        decay_steps=config.max_steps, end_value=config.min_lr,
    )
    adamw = optax.adamw(schedule, b1=config.beta1, b2=config.beta2, weight_decay=config.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    chain = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
    return optax.chain(*chain, adamw), schedule


def init_train_state(model: GPT, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh):
    """Place the model's params on `mesh` as `gpt.sharding.RULES` say and create the optimizer state beside
    them: each Adam moment sharded like its parameter, scalars (the step count) replicated.

    Returns (graphdef, params, opt_state, (param_shardings, opt_shardings)); params and param_shardings
    are pure dicts shaped like `nnx.to_pure_dict(nnx.state(model))`.
    """
    graphdef, state = nnx.split(model)
    shardings = param_shardings(model, mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    opt_shardings = _optimizer_shardings(optimizer, params, shardings, mesh)
    # Pinned: left to propagation, XLA may replicate the zeros that the moments start from.
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return graphdef, params, opt_state, (shardings, opt_shardings)


def _optimizer_shardings(optimizer, params, shardings, mesh):
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

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(optimizer.init, params))


def make_train_step(graphdef, optimizer, dropout: bool, mesh: jax.sharding.Mesh, shardings: tuple):
    """step(params, opt_state, batch [A, B, T+1], key) -> (params, opt_state, {loss, grad_norm}), compiled
    for `mesh` (the activations' sharding constraints refer to it); the new params and optimizer state
    keep `shardings` (param_shardings, opt_shardings), so donation reuses their buffers step after step."""

    def step(params, opt_state, batch_ABT1, key):
        def micro(grad_sum, xs):
            batch, micro_key = xs
            loss_and_grad = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch,
                                                                 micro_key if dropout else None))
            loss, grads = loss_and_grad(params)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        accum = batch_ABT1.shape[0]
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro, zeros, (batch_ABT1, jax.random.split(key, accum)))
        grads = jax.tree.map(lambda g: g / accum, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads)}

    return _on_mesh(jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, replicated(mesh))), mesh)


def make_eval_step(graphdef, mesh: jax.sharding.Mesh):
    return _on_mesh(jax.jit(lambda params, batch: loss_fn(nnx.merge(graphdef, params), batch)), mesh)


def _on_mesh(function, mesh: jax.sharding.Mesh):
    def call(*args):
        with jax.set_mesh(mesh):
            return function(*args)

    return call


def flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters, the tied LM head counted as one matmul) plus
    12 x layers x width x sequence for attention's two matmuls (the PaLM paper's formula, appendix B)."""
    matmul_params = config.num_params() - (config.block_size * config.n_embd if config.position == "learned" else 0)
    return 6 * matmul_params + 12 * config.n_layer * config.n_embd * seq_len


_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v4": 275e12, "TPU v5": 459e12}


def _peak_flops(config: TrainConfig) -> float | None:
    if config.peak_flops:
        return config.peak_flops
    kind = jax.devices()[0].device_kind
    return next((flops for name, flops in _PEAK_BF16_FLOPS.items() if name in kind), None)


# ------------------------------------------------------------------------------------------ the run

class _StopSignal:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps, so it can save before exiting."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class NonFiniteLoss(RuntimeError):
    pass


def _build_model(config: TrainConfig) -> GPT:
    if config.init_from != "scratch":
        model = gpt2.load(config.init_from, dtype=config.dtype, param_dtype=config.param_dtype)
        model.config = model.config.replace(dropout=config.dropout, remat=config.remat,
                                            scan_layers=config.scan_layers)
    else:
        overrides = {k: v for k in ("n_layer", "n_head", "n_embd", "position") if (v := getattr(config, k)) is not None}
        model_config = GPTConfig.preset(config.model, dropout=config.dropout, dtype=config.dtype,
                                        param_dtype=config.param_dtype, remat=config.remat,
                                        scan_layers=config.scan_layers, **overrides)
        model = GPT(model_config, rngs=nnx.Rngs(config.seed))
    if config.block_size > model.config.block_size:
        raise ValueError(
            f"TrainConfig.block_size={config.block_size} is above the model's context of "
            f"{model.config.block_size} tokens"
        )
    return model


def train(config: TrainConfig, log=print) -> dict:
    """Train (or resume) a GPT as `config` says. Returns a summary: final step, losses, stop reason."""
    out_dir = Path(config.out_dir)
    if config.distributed or any(v is not None for v in (config.coordinator_address, config.num_processes,
                                                         config.process_id)):
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    devices = jax.devices()[: config.num_devices] if config.num_devices else None
    mesh = make_mesh(**parse_mesh(config.mesh), devices=devices)
    if config.batch_size % data_parallel_size(mesh):
        raise ValueError(f"TrainConfig.batch_size={config.batch_size} must be divisible by the data-parallel "
                         f"devices (data x fsdp = {data_parallel_size(mesh)})")
    model = _build_model(config)  # errors in the config or the mesh surface before any data work
    if model.config.vocab_size < get_tokenizer().vocab_size:
        raise ValueError(f"the model's vocab_size={model.config.vocab_size} is below the GPT-2 tokenizer's "
                         f"{get_tokenizer().vocab_size}")
    optimizer, schedule = make_optimizer(config)
    graphdef, params, opt_state, (shardings, opt_shardings) = init_train_state(model, optimizer, mesh)
    model_config = model.config
    del model

    pid, nproc = jax.process_index(), jax.process_count()
    if pid != 0:
        log = lambda *_: None  # noqa: E731  (one process speaks for the run)
    inputs = list(config.data) or default_corpus()
    if nproc > 1:  # process 0 tokenizes; the others then find the shards up to date (or make their own)
        if pid == 0:
            prepare(inputs, out_dir / "data", config.val_fraction)
        multihost_utils.sync_global_devices("gpt: data prepared")
    meta = prepare(inputs, out_dir / "data", config.val_fraction)
    global_rows = config.batch_size * config.grad_accum
    train_batches = Batches(out_dir / "data" / "train.bin", config.block_size, global_rows, config.seed, pid, nproc)
    val_batches = Batches(out_dir / "data" / "val.bin", config.block_size, config.batch_size, config.seed + 1, pid, nproc)

    checkpoints = CheckpointManager(out_dir, keep=config.keep_checkpoints)
    start = checkpoints.latest_step() or 0
    if start:
        params, opt_state, saved = checkpoints.restore(start, params, opt_state, shardings, opt_shardings)
        if saved["loader"] != {"seed": config.seed, "rows": global_rows, "block_size": config.block_size}:
            raise ValueError(f"{out_dir} holds a run with loader {saved['loader']}; use another out_dir")
        log(f"resumed from {checkpoints.directory / str(start)}")

    train_step = make_train_step(graphdef, optimizer, dropout=config.dropout > 0, mesh=mesh,
                                 shardings=(shardings, opt_shardings))
    eval_step = make_eval_step(graphdef, mesh)
    rows_sharding = batch_sharding(mesh, (None, "batch", None))  # [accumulation, rows, T + 1]
    microbatch = lambda b: b.reshape(config.grad_accum, -1, b.shape[-1])  # noqa: E731

    def global_batch(local, sharding, shape):
        return jax.make_array_from_process_local_data(sharding, local, shape)

    def evaluate() -> float:
        losses = [eval_step(params, global_batch(val_batches[i], batch_sharding(mesh), (config.batch_size, config.block_size + 1)))
                  for i in range(config.eval_iters)]
        return float(np.mean([float(x) for x in losses]))

    def metadata(step):
        return {"step": step, "loader": {"seed": config.seed, "rows": global_rows, "block_size": config.block_size},
                "model_config": config_to_json(model_config), "train_config": config_to_json(config)}

    writer = _Metrics(out_dir, enabled=pid == 0)
    tokens_per_step = global_rows * config.block_size
    flops = flops_per_token(model_config, config.block_size) * tokens_per_step
    peak = _peak_flops(config)
    end = min(config.max_steps, config.stop_after or config.max_steps)
    summary = {"start_step": start, "stop_reason": "finished", "train_loss": None, "val_loss": None}
    log(f"model: {model_config.num_params():,} parameters; data: {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val tokens; mesh {dict(mesh.shape)}, params + optimizer state "
        f"{max(bytes_per_device((params, opt_state)).values()) / 2**20:.1f} MiB per device; steps {start} -> {end}")

    step, last_time, losses = start, time.perf_counter(), []
    with _StopSignal() as stop, tqdm(total=end, initial=start, desc="train", unit="step",
                                      disable=None if pid == 0 else True) as bar:
        while step < end:
            if stop.received is not None:
                summary["stop_reason"] = f"signal {signal.Signals(stop.received).name}"
                break
            batch = global_batch(microbatch(train_batches[step]), rows_sharding,
                                 (config.grad_accum, global_rows // config.grad_accum, config.block_size + 1))
            params, opt_state, metrics = train_step(params, opt_state, batch, jax.random.key(config.seed * 7919 + step))
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                checkpoints.wait()
                checkpoints.close()
                raise NonFiniteLoss(
                    f"loss became {loss} at step {step + 1}; stopping. The last good checkpoint "
                    f"(step {checkpoints.latest_step()}) is kept in {checkpoints.directory}"
                )
            step += 1
            losses.append(loss)
            bar.update(1)
            if step % config.log_interval == 0 or step == end:
                now = time.perf_counter()
                seconds = (now - last_time) / len(losses)
                record = {"step": step, "loss": float(np.mean(losses)), "lr": float(schedule(step - 1)),
                          "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_step / seconds,
                          "mfu": flops / seconds / (peak * jax.device_count()) if peak else None}
                writer.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                summary["train_loss"], last_time, losses = record["loss"], now, []
            if step % config.eval_interval == 0 or step == end:
                summary["val_loss"] = evaluate()
                writer.write({"step": step, "val_loss": summary["val_loss"]})
                bar.write(f"step {step}: val loss {summary['val_loss']:.4f}")
            if step % config.checkpoint_interval == 0 or step == end:
                checkpoints.save(step, params, opt_state, metadata(step))
        if step > start and checkpoints.latest_step() != step:
            checkpoints.save(step, params, opt_state, metadata(step))
    checkpoints.wait()
    checkpoints.close()
    writer.close()
    summary.update(step=step, params=params, model=nnx.merge(graphdef, params))
    if summary["stop_reason"] != "finished":
        log(f"stopped by {summary['stop_reason']} at step {step}; checkpoint saved, rerun to resume")
    return summary


class _Metrics:
    """The same records to `metrics.jsonl` and to TensorBoard event files (`out_dir/tensorboard`)."""

    def __init__(self, out_dir: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            from tensorboardX import SummaryWriter

            out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(out_dir / "metrics.jsonl", "a")
            self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step" and value is not None:
                self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tensorboard.close()
