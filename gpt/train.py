"""Pretraining: a TrainConfig, and the run that checks everything, owns its out_dir and loops.

`train(config)` first does every check that can fail on bad input (settings, mesh, model shape, corpus,
the out_dir's lock and the identity of the run in it), and only then compiles and steps. The pieces:
`gpt.step` (the jitted step), `gpt.run_dir` (lock and identity), `gpt.checkpoint` (which checkpoints
can be trusted), `gpt.metrics` (what is logged), `gpt.data` (corpus and loader).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from gpt import gpt2
from gpt.checkpoint import CheckpointManager, config_to_json, newest_step
from gpt.config import PRESETS, GPTConfig
from gpt.data import Batches, corpus_identity, default_corpus, prepare, sources
from gpt.errors import ConfigError, RunFailed
from gpt.metrics import MetricsWriter
from gpt.model import GPT
from gpt.peers import PeerLost, PeerWatch
from gpt.run_dir import RunLock, check_identity, identity
from gpt.sharding import (batch_sharding, bytes_per_device, data_parallel_size, initialize_distributed, make_mesh,
                          parse_mesh)
from gpt.signals import StopSignals
from gpt.step import flops_per_token, init_train_state, make_eval_step, make_optimizer, make_train_step, peak_flops
from gpt.tokenizer import get_tokenizer

__all__ = ["TrainConfig", "train", "NonFiniteStep"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; `python train.py --help` lists these as flags."""

    data: tuple[str, ...] = ()
    """Files, directories or globs to train on (text, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, or a saved
    datasets directory); empty trains on the embedded default corpus (the Python standard library)."""
    out_dir: str = "out"
    """Where the tokenized data, checkpoints, metrics.jsonl and TensorBoard events go; a run resumes from
    the newest intact checkpoint here automatically."""
    val_fraction: float = 0.05
    """The share of the corpus held out for evaluation (sections chosen by hash: see gpt/data.py)."""
    text_field: str = "text"
    """The field (JSONL) or column (Parquet, saved datasets) holding each document's text."""
    prepare_timeout_s: float = 24 * 3600
    """On several processes: how long the others wait for process 0 to prepare the corpus."""
    init_from: str = "scratch"
    """'scratch', or GPT-2 weights to fine-tune: a hub name (gpt2, gpt2-medium, ...) or an HF directory."""
    model: GPTConfig = PRESETS["small"]
    """The model trained from scratch: `--preset` picks the defaults, `--model.FIELD` changes any field.
    With --init_from, the shape comes from the checkpoint and only dropout, dtype, param_dtype, remat and
    scan_layers apply."""
    block_size: int | None = None
    """Tokens per training sequence (at most the model's context; default: 128, or the context if shorter)."""
    batch_size: int = 8
    """Sequences per micro-batch (the global batch, over all devices and hosts)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: 30, or a tenth of max_steps when that is fewer)."""
    max_steps: int = 300
    """Optimizer steps; the cosine decay spans them."""
    stop_after: int | None = None
    """Stop (with a checkpoint) at this step, though the schedule spans max_steps; resume later."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not biases, LayerNorms)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this (0 disables)."""
    eval_interval: int = 100
    """Steps between validation-loss evaluations (and at the end)."""
    eval_iters: int = 10
    """Validation batches averaged per evaluation."""
    log_interval: int = 10
    """Steps between metric records (loss, lr, grad norm, tokens/s, MFU)."""
    checkpoint_interval: int = 100
    """Steps between checkpoints (and one at the end, or on SIGTERM/SIGINT)."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    seed: int = 0
    """Seeds the initial weights, the batches and dropout."""
    resume_anyway: bool = False
    """Resume even though lr, max_steps, the schedule, the batch or the seed differ from the checkpoint's
    run (never a different model or corpus)."""
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
    compile_cache: bool = True
    """Keep compiled programs in the user's cache directory (a resumed run skips most of its compiles)."""

    def __post_init__(self):
        for name in ("batch_size", "grad_accum", "max_steps", "eval_iters", "log_interval",
                     "eval_interval", "checkpoint_interval", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.max_steps:  # the cosine decay needs at least one step after the warmup
            raise ConfigError(f"TrainConfig.warmup_steps={self.warmup} must be in [0, max_steps={self.max_steps})")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"TrainConfig.lr must be positive and finite, got {self.lr}")
        if not 0 < self.min_lr <= self.lr:
            raise ConfigError(f"TrainConfig.min_lr={self.min_lr} must be in (0, lr={self.lr}]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"TrainConfig.{name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.peak_flops is not None and not 0 < self.peak_flops < math.inf:
            raise ConfigError(f"TrainConfig.peak_flops must be positive and finite, got {self.peak_flops}")
        if not self.prepare_timeout_s > 0:
            raise ConfigError(f"TrainConfig.prepare_timeout_s must be > 0, got {self.prepare_timeout_s}")
        if self.sample_tokens < 0:
            raise ConfigError(f"TrainConfig.sample_tokens must be >= 0, got {self.sample_tokens}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"TrainConfig.val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("stop_after", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def warmup(self) -> int:
        """warmup_steps, or its default: 30, at most a tenth of max_steps."""
        return self.warmup_steps if self.warmup_steps is not None else min(30, self.max_steps // 10)


class NonFiniteStep(RunFailed):
    """A step's loss, gradient norm or updated parameters were not finite; it was not saved."""


# ------------------------------------------------------------------------------------------ before any compile

_RUNTIME_FIELDS = ("dropout", "dtype", "param_dtype", "remat", "scan_layers")


def _resolve_model(config: TrainConfig, log) -> tuple[TrainConfig, GPTConfig]:
    """The model's config, from the flags or the GPT-2 checkpoint's config.json (no weights read), and
    `config` with its block_size filled in."""
    runtime = {name: getattr(config.model, name) for name in _RUNTIME_FIELDS}
    if config.init_from != "scratch":
        model_config = gpt2.read_config(config.init_from, **runtime)
    else:
        model_config = config.model
        vocab = get_tokenizer().vocab_size
        if model_config.vocab_size < vocab:  # e.g. the `tiny` preset, sized for model tests
            log(f"vocab_size {model_config.vocab_size} is below the GPT-2 tokenizer's {vocab}: using {vocab}")
            model_config = model_config.replace(vocab_size=vocab)
    if config.block_size is None:
        config = dataclasses.replace(config, block_size=min(128, model_config.block_size))
    if config.block_size > model_config.block_size:
        raise ConfigError(f"TrainConfig.block_size={config.block_size} is above the model's context of "
                          f"{model_config.block_size} tokens")
    return config, model_config


def _build_model(config: TrainConfig, model_config: GPTConfig) -> GPT:
    if config.init_from == "scratch":
        return GPT(model_config, rngs=nnx.Rngs(config.seed))
    model = gpt2.load(config.init_from, dtype=model_config.dtype, param_dtype=model_config.param_dtype)
    model.config = model_config
    return model


def _agreed(received: int | None) -> int | None:
    """The signal to stop on, the same on every process: processes that receive a signal on different
    steps must still stop (and save) on the same one, or one would wait in the save's barrier while
    another runs the next step's collectives."""
    local = received or 0
    if jax.process_count() > 1:
        local = int(multihost_utils.process_allgather(np.int32(local)).max())
    return local or None


def _root(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _is_collective_failure(error: BaseException) -> bool:
    """Did a cross-process collective fail (the sign, on CPU and GPU alike, that another process died)?"""
    text = " ".join(str(e) for e in (error, _root(error)))
    return any(sign in text for sign in ("Gloo", "Connection closed by peer", "Connection reset by peer",
                                         "NCCL", "coordination service", "heartbeat"))


def _wait_for_all(name: str, timeout_s: float, message: str) -> None:
    """A barrier of every process, through JAX's coordination service, that gives up after `timeout_s`."""
    from jax._src.distributed import global_state  # jax.distributed's client (no public barrier with a timeout)

    try:
        global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as error:
        raise RunFailed(f"{message} ({str(error).strip().splitlines()[0][:200]})") from error


def _non_finite_message(step: int, metrics: dict, checkpoints: CheckpointManager) -> str:
    values = {"loss": float(metrics["loss"]), "grad norm": float(metrics["grad_norm"])}
    bad = [f"{name} {value}" for name, value in values.items() if not np.isfinite(value)] or ["updated parameters"]
    last = checkpoints.latest_step()
    after = (f"The newest checkpoint, step {last} in {checkpoints.directory}, is finite: resume from it with a "
             f"lower --lr (and --resume_anyway)" if last is not None else
             "No checkpoint was saved before it: start again with a lower --lr")
    return f"step {step} gave a non-finite {', '.join(bad)}; it was not saved. {after}"


# ------------------------------------------------------------------------------------------ the run

def train(config: TrainConfig, log=print) -> dict:
    """Train (or resume) a GPT as `config` says.

    Returns a summary: start_step, step, stop_reason ('finished' or 'signal SIGTERM'...), signal (the
    number, or None), train_loss, val_loss, params (a pure dict) and model. Raises ConfigError for bad
    input (before any compile), RunFailed (NonFiniteStep, a failed save) when the run must stop.
    """
    out_dir = Path(config.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"TrainConfig.out_dir '{out_dir}' is a file, not a directory")
    if config.distributed or any(v is not None for v in (config.coordinator_address, config.num_processes,
                                                         config.process_id)):
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    devices = jax.devices()[: config.num_devices] if config.num_devices else None
    mesh = make_mesh(**parse_mesh(config.mesh), devices=devices)
    if config.batch_size % data_parallel_size(mesh):
        raise ConfigError(f"TrainConfig.batch_size={config.batch_size} must be divisible by the data-parallel "
                          f"devices (data x fsdp = {data_parallel_size(mesh)})")
    pid, nproc = jax.process_index(), jax.process_count()
    if pid != 0:
        log = lambda *_: None  # noqa: E731  (one process speaks for the run)
    config, model_config = _resolve_model(config, log)
    inputs = list(config.data) or default_corpus()
    corpus_sources = sources(inputs)  # the one read of the whole corpus before tokenizing
    run_identity = identity(config_to_json(model_config), {**dataclasses.asdict(config), "warmup_steps": config.warmup},
                            corpus_identity(corpus_sources, config.val_fraction, config.text_field))

    def restart_advice() -> str:
        step = newest_step(out_dir)
        return ("no checkpoint was saved yet: restart every process to start again" if step is None else
                f"the newest checkpoint is step {step}: restart every process with the same flags to resume from it")

    with PeerWatch(restart_advice) as peers, RunLock(out_dir, enabled=pid == 0):
        checkpoints = CheckpointManager(out_dir, keep=config.keep_checkpoints)
        failed = True
        try:
            newest = checkpoints.newest_metadata()
            if newest is not None:  # before the corpus is re-tokenized or anything restored
                check_identity(newest[1].get("identity"), run_identity, out_dir, newest[0], config.resume_anyway, log)
            summary = _run(config, out_dir, mesh, model_config, inputs, corpus_sources, run_identity, checkpoints, log)
            failed = False
            return summary
        except Exception as error:
            if nproc > 1 and _is_collective_failure(error):
                raise PeerLost(f"{peers.silent_peers()} died (a collective failed: "
                               f"{str(_root(error)).strip().splitlines()[0][:200]}); process {pid} stops too; "
                               f"{restart_advice()}") from error
            raise
        finally:
            if not (failed and nproc > 1):  # after a failure on several processes, closing would wait for the dead
                checkpoints.close()


def _run(config, out_dir, mesh, model_config, inputs, corpus_sources, run_identity, checkpoints, log) -> dict:
    pid, nproc = jax.process_index(), jax.process_count()
    data_dir = out_dir / "data"

    def prepare_corpus() -> dict:
        return prepare(inputs, data_dir, config.val_fraction, config.text_field, corpus_sources=corpus_sources)

    if pid == 0:
        meta = prepare_corpus()
    if nproc > 1:  # the others wait for process 0, then find the shards up to date
        _wait_for_all("gpt: corpus prepared", config.prepare_timeout_s,
                      f"process 0 did not finish preparing the corpus in {data_dir} within --prepare_timeout_s="
                      f"{config.prepare_timeout_s}")
        if pid != 0:
            meta = prepare_corpus()
    global_rows = config.batch_size * config.grad_accum
    train_batches = Batches.of_split(data_dir, "train", config.block_size, global_rows, config.seed, pid, nproc)
    val_batches = Batches.of_split(data_dir, "val", config.block_size, config.batch_size, config.seed + 1, pid, nproc)

    # From here on, work is compiled.
    optimizer, schedule = make_optimizer(config)
    graphdef, params, opt_state, (shardings, opt_shardings) = init_train_state(
        _build_model(config, model_config), optimizer, mesh)
    restored = checkpoints.restore_newest_intact({"params": params, "opt_state": opt_state},
                                                 {"params": shardings, "opt_state": opt_shardings}, log)
    start = 0
    if restored is not None:
        start, trees, _ = restored
        params, opt_state = trees["params"], trees["opt_state"]
        log(f"resumed from {checkpoints.directory / str(start)}")

    train_step = make_train_step(graphdef, optimizer, dropout=model_config.dropout > 0, mesh=mesh,
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

    def save(step):
        checkpoints.save(step, params, opt_state, {
            "step": step, "identity": run_identity, "model_config": config_to_json(model_config),
            "train_config": config_to_json(config)})

    writer = MetricsWriter(out_dir, resume_step=start, enabled=pid == 0)
    tokens_per_step = global_rows * config.block_size
    flops = flops_per_token(model_config, config.block_size) * tokens_per_step
    peak = peak_flops(config.peak_flops)
    end = min(config.max_steps, config.stop_after or config.max_steps)
    summary = {"start_step": start, "stop_reason": "finished", "signal": None, "train_loss": None, "val_loss": None}
    log(f"model: {model_config.num_params():,} parameters; data: {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val tokens; mesh {dict(mesh.shape)}, params + optimizer state "
        f"{max(bytes_per_device((params, opt_state)).values()) / 2**20:.1f} MiB per device; steps {start} -> {end}")
    if start >= end:
        log(f"nothing to train: {out_dir} is at step {start} and this run ends at step {end} (raise --max_steps, "
            f"with --resume_anyway, to train further)")

    step, last_time, losses = start, time.perf_counter(), []
    try:
        with StopSignals() as stop, tqdm(total=end, initial=start, desc="train", unit="step",
                                          disable=None if pid == 0 else True) as bar:
            while step < end:
                signum = _agreed(stop.received)
                if signum is not None:
                    summary.update(stop_reason=f"signal {signal.Signals(signum).name}", signal=signum)
                    break
                batch = global_batch(microbatch(train_batches[step]), rows_sharding,
                                     (config.grad_accum, global_rows // config.grad_accum, config.block_size + 1))
                params, opt_state, metrics = train_step(params, opt_state, batch, jax.random.key(config.seed * 7919 + step))
                if not bool(metrics["finite"]):
                    checkpoints.wait()  # a save in flight is of an earlier step, which was finite
                    raise NonFiniteStep(_non_finite_message(step + 1, metrics, checkpoints))
                checkpoints.check_for_errors()  # a save that failed in the background stops the run now
                step += 1
                losses.append(float(metrics["loss"]))
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
                    save(step)
            if step > start and checkpoints.latest_step() != step:
                save(step)
        checkpoints.wait()
    finally:
        writer.close()
    summary.update(step=step, params=params, model=nnx.merge(graphdef, params))
    if summary["signal"] is not None:
        log(f"stopped by {summary['stop_reason']} at step {step}; checkpoint saved, rerun to resume")
    return summary
