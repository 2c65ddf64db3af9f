"""A training run's settings: `TrainConfig`, what `python train.py --help` lists, checked as they are made."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import tyro

from gpt.compilation_cache import CompileCacheChoice
from gpt.data.prepare import CorpusChoice
from gpt.errors import ConfigError
from gpt.hardware import CompileOnlyChoice
from gpt.model.config import PRESETS, GPTConfig
from gpt.progress import ProgressChoice
from gpt.train.checkpoint import config_to_json
from gpt.train.optimizer import OptimizerConfig
from gpt.train.profile import parse_step_range

__all__ = ["TrainConfig"]


@dataclasses.dataclass(frozen=True)
class TrainConfig(CorpusChoice, CompileCacheChoice, CompileOnlyChoice, ProgressChoice):
    """Everything a training run needs; `python train.py --help` lists these as flags (the corpus it trains
    on and its split: `CorpusChoice`; the optimizer: `optim`; compiling for a TPU topology: `CompileOnlyChoice`)."""

    out_dir: str = "out"
    """Where the tokenized data, checkpoints, metrics.jsonl and TensorBoard events go; a run resumes from
    the newest intact checkpoint here automatically."""
    prepare_timeout_s: float = 24 * 3600
    """On several processes: how long the others wait for process 0 to prepare the corpus (timed from when
    every process has compiled its train step)."""
    init_from: str = "scratch"
    """'scratch', or weights to fine-tune: a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3 or Gemma 3
    directory, or a hub name in the local Hugging Face cache (gpt2, gpt2-medium, ...; HuggingFaceTB/SmolLM2-135M,
    ...). The corpus is tokenized with the model's own tokenizer, which the run keeps (`gpt.run_tokenizer`)."""
    model: GPTConfig = PRESETS["small"]
    """The model trained from scratch: `--preset` picks the defaults, `--model.FIELD` changes any field.
    With --init_from, the shape comes from the checkpoint and only dropout, dtype, param_dtype, fp8, remat
    and scan_layers apply."""
    block_size: int | None = None
    """Tokens per training sequence (at most the model's context; default: 128, or the context if shorter)."""
    batch_size: int = 8
    """Sequences per micro-batch (the global batch, over all devices and hosts)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    optim: Annotated[OptimizerConfig, tyro.conf.OmitArgPrefixes] = OptimizerConfig()
    """The optimizer and its schedule; its flags are this command's own (`--lr`, `--max_steps`)."""
    label_smoothing: float = 0.0
    """Train against targets smoothed by this much (1 - e on the next token, e spread over the vocabulary):
    a regularizer that costs perplexity; the validation loss is always the plain cross-entropy."""
    stop_after: int | None = None
    """Stop (with a checkpoint) at this step, though the schedule spans max_steps; resume later."""
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
    prefetch: int = 2
    """Batches read and placed on the devices ahead of the step, by a background thread (0: read each
    batch on the loop's own thread, when its step needs it)."""
    profile_steps: str = ""
    """'A:B': trace steps A to B-1 (counted from 0) with JAX's profiler into out_dir/profile, for
    TensorBoard or Perfetto; `bench/step_profile.py OUT_DIR/profile` sums it by category. Empty: none."""

    def __post_init__(self):
        for name in ("batch_size", "grad_accum", "eval_iters", "log_interval",
                     "eval_interval", "checkpoint_interval", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"TrainConfig.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.peak_flops is not None and not 0 < self.peak_flops < math.inf:
            raise ConfigError(f"TrainConfig.peak_flops must be positive and finite, got {self.peak_flops}")
        if not self.prepare_timeout_s > 0:
            raise ConfigError(f"TrainConfig.prepare_timeout_s must be > 0, got {self.prepare_timeout_s}")
        if self.sample_tokens < 0:
            raise ConfigError(f"TrainConfig.sample_tokens must be >= 0, got {self.sample_tokens}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"TrainConfig.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.prefetch < 0:
            raise ConfigError(f"TrainConfig.prefetch must be >= 0, got {self.prefetch}")
        if not 0 <= self.seed < 2**63:  # numpy's and JAX's generators take it as a 64-bit integer
            raise ConfigError(f"TrainConfig.seed must be in [0, 2**63), got {self.seed}")
        for name in ("stop_after", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        CompileOnlyChoice.__post_init__(self)
        traced = parse_step_range(self.profile_steps, "TrainConfig.profile_steps")
        if traced is not None and traced[1] > self.optim.max_steps:
            raise ConfigError(f"TrainConfig.profile_steps={self.profile_steps!r} ends after "
                              f"max_steps={self.optim.max_steps}")

    @classmethod
    def from_flags(cls, **flags) -> TrainConfig:
        """The default settings with `flags` changed, each named as train.py's flag names it (`lr=3e-3`,
        `max_steps=100` set the optimizer's)."""
        return cls().replace(**flags)

    def replace(self, **flags) -> TrainConfig:
        """These settings with `flags` changed, named as in `from_flags`."""
        optimizer_fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
        optim = {name: value for name, value in flags.items() if name in optimizer_fields}
        rest = {name: value for name, value in flags.items() if name not in optimizer_fields}
        return dataclasses.replace(self, optim=dataclasses.replace(self.optim, **optim), **rest)

    def flags(self) -> dict:
        """These settings as train.py's flags name them: one flat, JSON-ready dict, the optimizer's beside the
        rest (what a checkpoint records, in the same shape whichever code wrote it)."""
        mine = config_to_json(self)
        return {**{name: value for name, value in mine.items() if name != "optim"}, **mine["optim"]}
