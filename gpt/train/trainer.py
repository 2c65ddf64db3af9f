"""Pretraining: the run of a `TrainConfig` (`gpt.train.config`) that checks everything, owns its out_dir and loops.

`train(config)` reads top to bottom in three parts:

- `plan(config)`: every check that can fail on bad input (settings, mesh, model shape, corpus, and the
  identity of the run), before anything is written or compiled;
- `setup(plan, checkpoints)` -> `Run`: the corpus prepared, the loaders, the train state placed on the
  mesh (or restored), the compiled step, the metrics writer;
- `loop(run)`: the steps, which never wait on the host. Step n + 1 is dispatched before anything of step
  n is read; the next batches are read and placed on the mesh by a thread (`gpt.data.prefetch`); the metrics
  stay on the device until a log interval, when they are read one step late (the step after it already
  runs). The loop keeps two steps queued on the device, no more (so the batches in flight stay few);
  a checkpoint, an evaluation and the end are the only points where it waits for the device to drain,
  and a step is saved only after its finiteness flag (and every earlier step's) has been read True.

The pieces: `gpt.train.step` (the jitted step), `gpt.train.optimizer` (AdamW or Muon, the schedule), `gpt.run_dir` (lock and identity), `gpt.train.checkpoint` (which
checkpoints can be trusted), `gpt.train.metrics` (what is logged), `gpt.data.prepare` (corpus and loader), `gpt.train.peers`
(what the processes of a multi-host run settle together).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from gpt.chat_format import for_conversations
from gpt.data.conversations import longest_record
from gpt.data.corpus import holds_conversations
from gpt.data.loader import Batches
from gpt.data.prefetch import Prefetch
from gpt.data.prepare import conversation_template, corpus_identity, corpus_inputs, prepare, sources
from gpt.data.shards import verify_shards
from gpt.errors import ConfigError, check_fits_in_memory
from gpt.model import pretrained
from gpt.model.config import GPTConfig
from gpt.model.sharding import (
    batch_sharding,
    bytes_per_device,
    data_parallel_size,
    initialize_distributed,
    make_mesh,
    parse_mesh,
)
from gpt.model.transformer import GPT, num_params
from gpt.program_report import check_compiled_fits, compile_within_memory
from gpt.progress import Progress
from gpt.run_dir import RunLock, check_identity, identity, newest_step
from gpt.run_tokenizer import keep_tokenizer
from gpt.signals import StopSignals
from gpt.tokenizer import TextTokenizer, get_tokenizer
from gpt.train.checkpoint import CheckpointManager, config_to_json
from gpt.train.config import TrainConfig
from gpt.train.init_from import RunCheckpoint, initial_checkpoint, with_vocabulary
from gpt.train.metrics import MetricsWriter
from gpt.train.optimizer import make_schedule
from gpt.train.peers import PeerWatch, agree_on_signal, wait_for_all
from gpt.train.pending_metrics import NonFiniteStep, PendingMetrics
from gpt.train.profile import StepTrace, parse_step_range
from gpt.train.step import (
    TrainStep,
    abstract_train_state,
    init_train_state,
    make_eval_step,
    make_train_step,
)

__all__ = ["TrainConfig", "train", "TrainResult", "NonFiniteStep", "plan", "setup", "loop", "Plan", "Run",
           "mesh_and_model", "initial_checkpoint", "rows_sharding", "batch_shape", "FIT_ADVICE"]


# What to change when a train step does not fit the device's memory.
FIT_ADVICE = ("a smaller --batch_size with a larger --grad_accum, --model.remat, or the parameters and optimizer "
              "state split over more devices (--mesh fsdp=N)")

@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run did: the steps it ran, why it stopped, its last losses, and the trained model."""

    start_step: int
    """The step it started from (0, or the checkpoint it resumed)."""
    step: int
    """The step it stopped at (saved)."""
    signal: int | None
    """The stopping signal's number, or None."""
    train_loss: float | None
    """The mean training loss of the last log interval."""
    val_loss: float | None
    """The last validation loss."""
    params: dict
    """The trained parameters, a pure dict."""
    model: GPT

    @property
    def stop_reason(self) -> str:
        """'finished', or 'signal SIGTERM' / 'signal SIGINT'."""
        return "finished" if self.signal is None else f"signal {signal.Signals(self.signal).name}"


# ------------------------------------------------------------------------------------------ plan: before anything

@dataclasses.dataclass(frozen=True)
class Plan:
    """A run checked and ready to start: nothing written, nothing compiled."""

    config: TrainConfig
    """With block_size filled in."""
    model_config: GPTConfig
    mesh: Mesh
    inputs: list
    corpus_sources: list[dict]
    identity: dict
    tokenizer: TextTokenizer
    """What the corpus is tokenized with: GPT-2's, or the fine-tuned model's own (GPT-2's in its chat format, on
    conversations: `gpt.chat_format`)."""
    checkpoint: pretrained.Checkpoint | RunCheckpoint | None
    """The checkpoint it fine-tunes (`--init_from`), found once; None from scratch."""
    conversations: bool = False
    """The corpus is of conversations (`gpt.data.conversations`): the loss is on the assistant's tokens alone."""
    end_of_turn: tuple[int, ...] = ()
    """The ids beside the tokenizer's end of text that end a reply: the fine-tuned model's, or the chat format's;
    kept with the tokenizer."""

    @property
    def out_dir(self) -> Path:
        return Path(self.config.out_dir)

    def restart_advice(self) -> str:
        step = newest_step(self.out_dir)
        return ("no checkpoint was saved yet: restart every process to start again" if step is None else
                f"the newest checkpoint is step {step}: restart every process with the same flags to resume from it")


_RUNTIME_FIELDS = ("dropout", "dtype", "param_dtype", "fp8", "remat", "scan_layers")


def plan(config: TrainConfig, log=print) -> Plan:
    """Every check that can fail on bad input, before anything is written or compiled: the out_dir, the
    processes and the mesh, the model's shape, the corpus (read once, for its identity)."""
    out_dir = Path(config.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"TrainConfig.out_dir '{out_dir}' is a file, not a directory")
    if config.distributed or any(v is not None for v in (config.coordinator_address, config.num_processes,
                                                         config.process_id)):
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    devices = None
    if config.num_devices is not None:
        if not 1 <= config.num_devices <= jax.device_count():
            raise ConfigError(f"TrainConfig.num_devices={config.num_devices} must be in [1, {jax.device_count()}], "
                              "the devices there are")
        devices = jax.devices()[: config.num_devices]
    log = _main_process_only(log)
    checkpoint = initial_checkpoint(config.init_from)
    config, model_config, mesh = mesh_and_model(config, devices, log, checkpoint)
    tokenizer = _tokenizer(checkpoint)
    batch_bytes = config.grad_accum * config.batch_size * (config.block_size + 1) * 4 * (config.prefetch + 2)
    check_fits_in_memory(f"TrainConfig.batch_size={config.batch_size} x grad_accum={config.grad_accum}", batch_bytes,
                         f"the int32 token batches in flight ({config.prefetch} prefetched + 2 steps')",
                         "use a smaller --batch_size or --grad_accum")
    inputs = corpus_inputs(config.data)
    corpus_sources = sources(inputs, exclude=[out_dir])  # the one read of the corpus; never the run's own files
    paths = [Path(source["path"]) for source in corpus_sources]
    conversations = holds_conversations(paths, config.text_field)
    end_of_turn = () if checkpoint is None else checkpoint.end_of_turn()
    if conversations:
        tokenizer, vocab_size, format_end = for_conversations(tokenizer, model_config.vocab_size)
        end_of_turn = format_end or end_of_turn
        if vocab_size != model_config.vocab_size:
            log(f"the chat format's tokens (gpt/chat_format.py) grow the vocabulary from {model_config.vocab_size:,} "
                f"to {vocab_size:,} rows")
            model_config = model_config.replace(vocab_size=vocab_size)
        conversation_template(paths, config.text_field, tokenizer)  # none: one line, before any compile
    run_identity = identity(config_to_json(model_config), _training_identity(config),
                            corpus_identity(corpus_sources, config.val_fraction, config.text_field))
    return Plan(config, model_config, mesh, inputs, corpus_sources, run_identity, tokenizer, checkpoint,
                conversations, end_of_turn)


def mesh_and_model(config: TrainConfig, devices: list | None, log=print,
                   checkpoint: pretrained.Checkpoint | None = None) -> tuple[TrainConfig, GPTConfig, Mesh]:
    """The run's mesh over `devices` (default: all) and its model's config (the `checkpoint`'s, fine-tuning;
    `initial_checkpoint`), checked against each other and the batch; `config` with its block_size filled in.
    Nothing is read but a checkpoint's config.json."""
    mesh = make_mesh(**parse_mesh(config.mesh), devices=devices)
    if config.batch_size % data_parallel_size(mesh):
        raise ConfigError(f"TrainConfig.batch_size={config.batch_size} must be divisible by the data-parallel "
                          f"devices (data x fsdp = {data_parallel_size(mesh)})")
    config, model_config = _resolve_model(config, log, checkpoint)
    return config, model_config, mesh


def rows_sharding(mesh: Mesh) -> jax.sharding.NamedSharding:
    """The sharding of a step's batch, int32 [grad_accum, batch_size, block_size + 1]: rows over the data axes."""
    return batch_sharding(mesh, (None, "batch", None))


def batch_shape(config: TrainConfig, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """A step's global batch as the step is compiled for it (here, and by `--compile_only`): int32 [grad_accum,
    batch_size, block_size + 1], its rows over the data axes."""
    return jax.ShapeDtypeStruct((config.grad_accum, config.batch_size, config.block_size + 1), jnp.int32,
                                sharding=rows_sharding(mesh))


def _default_identity() -> dict:
    """The identity record of the default settings, which stand in for fields an older record lacks."""
    default = TrainConfig()
    return identity(config_to_json(default.model), _training_identity(default), {})


def _training_identity(config: TrainConfig) -> dict:
    """The flags an identity record compares, with the warmup resolved (its default depends on max_steps)."""
    return {**config.flags(), "warmup_steps": config.optim.warmup}


def _main_process_only(log):
    """`log` on process 0; nothing on the others (one process speaks for the run)."""
    return log if jax.process_index() == 0 else lambda *_: None


def _resolve_model(config: TrainConfig, log,
                   checkpoint: pretrained.Checkpoint | None) -> tuple[TrainConfig, GPTConfig]:
    """The model's config, from the flags or the checkpoint's config.json (no weights read), and `config` with
    its block_size filled in."""
    runtime = {name: getattr(config.model, name) for name in _RUNTIME_FIELDS}
    if checkpoint is not None:
        model_config = checkpoint.config(**runtime)
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


def _tokenizer(checkpoint: pretrained.Checkpoint | None) -> TextTokenizer:
    """The tokenizer of the model a run trains: GPT-2's from scratch, else the checkpoint's (checked against its
    vocabulary: `Checkpoint.tokenizer`)."""
    return get_tokenizer() if checkpoint is None else checkpoint.tokenizer()


# ------------------------------------------------------------------------------------------ the run

def train(config: TrainConfig, log=print) -> TrainResult:
    """Train (or resume) a GPT as `config` says.

    Raises ConfigError for bad input (before any compile), RunFailed (NonFiniteStep, a failed save,
    PeerLost) when the run must stop. A run stopped by SIGTERM/SIGINT saves the step it stopped at and
    returns with `signal` set.
    """
    checked = plan(config, log)
    log = _main_process_only(log)
    main = jax.process_index() == 0
    with PeerWatch(checked.restart_advice) as peers, RunLock(checked.out_dir, enabled=main), \
            RunLock(checked.out_dir / "data", enabled=main, advice="or train with another --out_dir"), \
            _checkpoint_manager(checked.out_dir, config.keep_checkpoints) as checkpoints, \
            peers.collective_failures_named():
        newest = checkpoints.newest_metadata()
        if newest is not None:  # before the corpus is re-tokenized or anything restored
            check_identity(newest[1].get("identity"), checked.identity, checked.out_dir, newest[0],
                           config.resume_anyway, log, defaults=_default_identity())
        return loop(setup(checked, checkpoints, log), log)


@contextlib.contextmanager
def _checkpoint_manager(out_dir: Path, keep: int):
    """A CheckpointManager closed (pending saves finished) on leaving, except after a failure on several
    processes, where closing would wait for the dead."""
    checkpoints = CheckpointManager(out_dir, keep=keep)
    try:
        yield checkpoints
    except BaseException:
        if jax.process_count() == 1:
            checkpoints.close()
        raise
    checkpoints.close()


# ------------------------------------------------------------------------------------------ setup: compile, restore

@dataclasses.dataclass
class Run:
    """Everything the loop needs, made by `setup`; `params` and `opt_state` change as it steps."""

    config: TrainConfig
    model_config: GPTConfig
    mesh: jax.sharding.Mesh
    identity: dict
    data_identity: str
    """The prepared shards' digest (`gpt.data.shards.verify_shards`), recorded with every checkpoint."""
    graphdef: nnx.GraphDef
    params: dict
    opt_state: object
    train_step: Callable
    eval_step: Callable
    schedule: Callable[[int], float]
    train_batches: Batches
    """This process's rows of each step's global batch [grad_accum x batch_size, block_size + 1]."""
    val_batches: Batches
    checkpoints: CheckpointManager
    writer: MetricsWriter
    start: int
    end: int

    @functools.cached_property
    def _rows_sharding(self) -> jax.sharding.NamedSharding:
        return rows_sharding(self.mesh)

    def batch(self, step: int) -> jax.Array:
        """Step `step`'s global batch, int32 [grad_accum, batch_size, block_size + 1], placed on the mesh."""
        c = self.config
        local = self.train_batches[step]
        return jax.make_array_from_process_local_data(
            self._rows_sharding, local.reshape(c.grad_accum, -1, local.shape[-1]),
            (c.grad_accum, c.batch_size, c.block_size + 1))

    def key(self, step: int) -> jax.Array:
        """The random key of step `step`'s dropout (a pure function of the seed and the step)."""
        return jax.random.key((self.config.seed * 7919 + step) % 2**63)  # a seed near 2**63 must not overflow

    def evaluate(self) -> float:
        """The mean loss of `eval_iters` validation batches (waits for the device)."""
        c = self.config
        losses = [self.eval_step(self.params, jax.make_array_from_process_local_data(
            batch_sharding(self.mesh), self.val_batches[i], (c.batch_size, c.block_size + 1)))
            for i in range(c.eval_iters)]
        return float(np.mean([float(x) for x in losses]))

    def save(self, step: int) -> None:
        self.checkpoints.save(step, self.params, self.opt_state, {
            "step": step, "identity": self.identity, "data_identity": self.data_identity,
            "model_config": config_to_json(self.model_config), "train_config": self.config.flags()})


def setup(checked: Plan, checkpoints: CheckpointManager, log=print) -> Run:
    """Compile the train step from the state's shapes (a step that cannot fit the devices' memory stops the
    run here, before the corpus's preparation, which can take hours), prepare the corpus (`_prepared_corpus`),
    make the loaders, and place the train state on the mesh or restore it from the newest intact checkpoint."""
    config, model_config, mesh = checked.config, checked.model_config, checked.mesh
    pid, nproc = jax.process_index(), jax.process_count()
    data_dir = checked.out_dir / "data"
    optimizer = config.optim
    graphdef, abstract_params, abstract_opt_state, shardings = abstract_train_state(model_config, optimizer, mesh)
    train_step = _compiled_within_memory(make_train_step(graphdef, optimizer, dropout=model_config.dropout > 0,
                                                         mesh=mesh, shardings=shardings,
                                                         label_smoothing=config.label_smoothing,
                                                         scored_only=checked.conversations),
                                         abstract_params, abstract_opt_state, config, mesh)
    meta = _prepared_corpus(checked)
    data_identity = verify_shards(data_dir, model_config.vocab_size)  # before anything trains on them
    checkpoints.check_trained_on(data_identity, data_dir, "resume with the data it was trained on, or train a new "
                                 "run in another --out_dir")
    rows = config.batch_size * config.grad_accum
    train_batches = Batches.of_split(data_dir, "train", config.block_size, rows, config.seed, pid, nproc)
    val_batches = Batches.of_split(data_dir, "val", config.block_size, config.batch_size, config.seed + 1, pid, nproc)
    if checked.conversations:
        _report_cut_conversations(train_batches, meta, config.block_size, log)

    params, opt_state, start = _placed_state(checked, checkpoints, shardings, log)
    end = min(config.optim.max_steps, config.stop_after or config.optim.max_steps)
    log(f"model: {num_params(model_config):,} parameters; data: {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val tokens; mesh {dict(mesh.shape)}, params + optimizer state "
        f"{max(bytes_per_device((params, opt_state)).values()) / 2**20:.1f} MiB per device; steps {start} -> {end}")
    if start >= end:
        log(f"nothing to train: {checked.out_dir} is at step {start} and this run ends at step {end} (raise "
            f"--max_steps, with --resume_anyway, to train further)")
    return Run(config, model_config, mesh, checked.identity, data_identity, graphdef, params, opt_state, train_step,
               make_eval_step(graphdef, mesh, checked.conversations), make_schedule(optimizer, optimizer.lr), train_batches, val_batches,
               checkpoints, MetricsWriter(checked.out_dir, resume_step=start, enabled=pid == 0), start, end)


def _prepared_corpus(checked: Plan) -> dict:
    """The corpus's metadata once its shards are prepared in the run's data directory: by process 0 (with the
    run's tokenizer kept beside it, before a checkpoint exists) once every process has compiled its step; the
    others wait for it up to --prepare_timeout_s, then find the shards up to date."""
    config, data_dir = checked.config, checked.out_dir / "data"
    pid, nproc = jax.process_index(), jax.process_count()

    def prepare_corpus() -> dict:  # under the data directory's lock, which the run holds
        return prepare(checked.inputs, data_dir, config.val_fraction, config.text_field,
                       progress=config.progress_style if pid == 0 else "none",
                       corpus_sources=checked.corpus_sources, lock=False, tokenizer=checked.tokenizer)

    if nproc > 1:  # the others' wait for the corpus then times process 0's preparation, not a slower compile
        multihost_utils.sync_global_devices("gpt: train step compiled")
    if pid == 0:
        keep_tokenizer(checked.out_dir, checked.tokenizer, checked.end_of_turn)
        meta = prepare_corpus()
    if nproc > 1:
        wait_for_all("gpt: corpus prepared", config.prepare_timeout_s,
                     f"process 0 did not finish preparing the corpus in {data_dir} within --prepare_timeout_s="
                     f"{config.prepare_timeout_s}")
        if pid != 0:
            meta = prepare_corpus()
    return meta


def _placed_state(checked: Plan, checkpoints: CheckpointManager, shardings, log) -> tuple:
    """(params, optimizer state, first step): the newest intact checkpoint's, else the initial model's (fresh or
    `--init_from`'s), placed on the mesh as `shardings` say. From here on, work is compiled."""
    config, model_config = checked.config, checked.model_config
    _, params, opt_state, _ = init_train_state(_build_model(config, model_config, checked.checkpoint), config.optim,
                                               checked.mesh)
    restored = checkpoints.restore_newest_intact({"params": params, "opt_state": opt_state},
                                                 {"params": shardings[0], "opt_state": shardings[1]}, log)
    if restored is None:
        return params, opt_state, 0
    start, trees, _ = restored
    log(f"resumed from {checkpoints.directory / str(start)}")
    return trees["params"], trees["opt_state"], start


def _compiled_within_memory(step: TrainStep, params, opt_state, config: TrainConfig, mesh: Mesh) -> TrainStep:
    """`step` compiled before its first call, for the run's batch, and checked against the devices' memory: a
    step that cannot fit is one line naming the GiB it needs and the device's (exit 2), not an allocator's
    traceback after the first step began."""
    batch = batch_shape(config, mesh)
    setting = f"TrainConfig.batch_size={config.batch_size} x grad_accum={config.grad_accum}"
    devices = list(mesh.devices.flat)
    program = compile_within_memory(step.lower(params, opt_state, batch, jax.random.key(0)), "train step",
                                    devices[0].device_kind, setting, f"try {FIT_ADVICE}")
    check_compiled_fits(program, devices, "train step", setting, f"try {FIT_ADVICE}")
    return step.with_program(program)


def _build_model(config: TrainConfig, model_config: GPTConfig,
                 checkpoint: pretrained.Checkpoint | RunCheckpoint | None) -> GPT:
    if checkpoint is None:
        return GPT(model_config, rngs=nnx.Rngs(config.seed))
    model = with_vocabulary(checkpoint.load(model_config.dtype, model_config.param_dtype), model_config.vocab_size)
    model.config = model_config
    return model


def _report_cut_conversations(batches, meta: dict, block_size: int, log) -> None:
    """Say how many training conversations are longer than a row, and so cut (`gpt.data.conversations`)."""
    cut = int((batches.lengths > block_size + 1).sum())
    if cut:
        log(f"warning: {cut:,} of {batches.lengths.size:,} training conversations are longer than block_size + 1 = "
            f"{block_size + 1:,} tokens and are cut there, their later turns untaught (the longest: "
            f"{longest_record(meta)}); raise --block_size to keep them whole")


# ------------------------------------------------------------------------------------------ the loop

def loop(run: Run, log=print) -> TrainResult:
    """Step from `run.start` to `run.end`: log, evaluate and save at their intervals, stop on a signal
    (saving the step it stopped at) or at the first non-finite step (saving nothing after the last good
    checkpoint). The loop never waits on the host; it waits for the device only to evaluate, to save and
    at the end."""
    config = run.config
    step, pending, deferred_log, val_loss, stop_signal = run.start, PendingMetrics(run), None, None, None
    every = lambda interval: step % interval == 0 or step == run.end  # noqa: E731
    profile = _Profile(run)
    try:
        with StopSignals() as stop, Prefetch(run.batch, range(run.start, run.end), config.prefetch) as batches, \
                Progress("train", run.end, run.start, "step",
                         config.progress_style if jax.process_index() == 0 else "none") as bar:
            while step < run.end:
                stop_signal = _stop_signal(stop, step, config.log_interval)
                if stop_signal is not None:
                    break
                batch = next(batches)
                profile.before(step, batch)
                run.params, run.opt_state, metrics = run.train_step(run.params, run.opt_state, batch, run.key(step))
                step += 1
                profile.after(step, log)
                pending.add(step, metrics)
                bar.update(1)
                run.checkpoints.check_for_errors()  # a save that failed in the background stops the run now
                if deferred_log is not None:  # read while the step just dispatched runs
                    _log(run, pending, deferred_log, bar)
                    deferred_log = None
                must_wait = every(config.eval_interval) or every(config.checkpoint_interval)
                if every(config.log_interval):
                    if must_wait:
                        _log(run, pending, step, bar)
                    else:
                        deferred_log = step
                if every(config.eval_interval):
                    val_loss = run.evaluate()
                    run.writer.write({"step": step, "val_loss": val_loss})
                    bar.write(f"step {step}: val loss {val_loss:.4f}", step=step, val_loss=val_loss)
                if every(config.checkpoint_interval):
                    pending.read(step)
                    run.save(step)
            if deferred_log is not None:
                _log(run, pending, deferred_log, bar)
            pending.read(step)
            if step > run.start and run.checkpoints.latest_step() != step:
                run.save(step)
        run.checkpoints.wait()
    finally:
        profile.trace.abandon()
        run.writer.close()
    result = TrainResult(start_step=run.start, step=step, signal=stop_signal, train_loss=pending.last_loss,
                         val_loss=val_loss, params=run.params, model=nnx.merge(run.graphdef, run.params))
    if stop_signal is not None:
        log(f"stopped by {result.stop_reason} at step {step}; checkpoint saved, rerun to resume")
    return result


def _stop_signal(stop: StopSignals, step: int, log_interval: int) -> int | None:
    """The signal to stop on before `step`'s successor, if any. One process checks at every step; several
    agree at the log intervals (a blocking collective, where the loop reads the device anyway), so a
    signal takes effect within log_interval steps there."""
    if jax.process_count() == 1:
        return stop.received
    return agree_on_signal(stop.received) if step % log_interval == 0 else None


def _log(run: Run, pending: PendingMetrics, step: int, progress: Progress) -> None:
    record = pending.record(step)
    run.writer.write(record)
    progress.report(step, **{name: record[name] for name in ("loss", "grad_norm", "tokens_per_s", "mfu")})


class _Profile:
    """`--profile_steps A:B`: the trace started before step A is dispatched and stopped once step B-1 has
    finished (the device drained at both ends, so that the trace holds those steps alone)."""

    def __init__(self, run: Run):
        self.run = run
        self.steps = parse_step_range(run.config.profile_steps) if jax.process_index() == 0 else None
        self.trace = StepTrace(Path(run.config.out_dir) / "profile")
        self.arguments = None

    def before(self, step: int, batch: jax.Array) -> None:
        if self.steps is not None and step == max(self.steps[0], self.run.start) < self.steps[1]:
            jax.block_until_ready((self.run.params, self.run.opt_state))
            self.arguments = (batch, self.run.key(step))
            self.first = step
            self.trace.start()

    def after(self, step: int, log) -> None:
        if self.trace.active and step == self.steps[1]:
            run, c = self.run, self.run.config
            jax.block_until_ready((run.params, run.opt_state))
            hlo = run.train_step.compiled_text(run.params, run.opt_state, *self.arguments)
            directory = self.trace.stop(step - self.first, {
                "model": config_to_json(run.model_config), "micro_batch": c.batch_size,
                "block_size": c.block_size, "accumulation": c.grad_accum}, hlo)
            log(f"profile of steps {self.first}-{step - 1} written to {directory}: "
                f"python bench/step_profile.py {directory}")
