"""Validation loss against wall time and tokens: the training recipes side by side, and a PyTorch peer.

    python bench/time_to_loss.py                                # every variant below, seed 0
    python bench/time_to_loss.py --variants gpt2 modern --seeds 0 1 2
    python bench/time_to_loss.py --report-only                  # the table and plot from the saved results
    python bench/time_to_loss.py --preset gpt2 --block_size 1024 --batch_size 32 --dtype bfloat16 \
        --lr 6e-4 --variants gpt2 modern torch --data FILES      # GPT-2 124M's shape on a GPU (bench/gpu.sh ttl)

Every variant trains `python train.py`'s default run (the `small` shape, batch 8 x 128 tokens, 300 steps,
warmup 30) on the default corpus's own prepared shards, the same batches in the same order, from its own
initial weights: `gpt2` (the default recipe), `modern` (`gpt.train.recipes`), each of the modern recipe's
pieces alone on top of gpt2, label smoothing, and `torch` (the gpt2 recipe written the nanoGPT way:
transformers' GPT2LMHeadModel, torch AdamW, the same schedule, clipping and weight decay, eager on the
CPU; on a GPU, in CUDA with torch.compile, and in bfloat16 autocast when --dtype is bfloat16). The
shape, batch, dtype and corpus are flags, so the same comparison runs at GPT-2 124M's shape on a GPU. The
validation loss (plain cross-entropy, the same `eval_iters` held-out batches for all) is taken
every `--eval_every` steps with the clock stopped; compiling is done before the clock starts.

The target is the gpt2 recipe's final validation loss (mean over its seeds); each variant's time to it
is interpolated between evaluations. Results are appended to `--results` (JSON lines), so variants can
run in separate invocations; the report reads them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

# The torch peer may run in this process after JAX variants: JAX must not take 75% of a GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np
import tyro
from flax import nnx

from gpt.data.loader import Batches
from gpt.data.prepare import default_corpus, prepare
from gpt.model.config import GPTConfig
from gpt.model.sharding import make_mesh
from gpt.model.transformer import GPT
from gpt.train import TrainConfig, with_recipe
from gpt.train.optimizer import make_schedule
from gpt.train.step import init_train_state, make_eval_step, make_train_step

from machine import cpu_name

# name -> (recipe, GPTConfig changes, TrainConfig changes)
VARIANTS = {
    "gpt2": ("gpt2", {}, {}),
    "modern": ("modern", {}, {}),
    "rope": ("gpt2", {"position": "rope"}, {}),
    "qk_norm": ("gpt2", {"qk_norm": True}, {}),
    "relu2": ("gpt2", {"activation": "relu2"}, {}),
    "no_bias": ("gpt2", {"bias": False}, {}),
    "untied_head": ("gpt2", {"tied_head": False}, {}),
    "muon": ("gpt2", {}, {"optimizer": "muon"}),
    "wsd": ("gpt2", {}, {"schedule": "wsd"}),
    "label_smoothing": ("gpt2", {}, {"label_smoothing": 0.1}),
    "torch": ("gpt2", {}, {}),
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    variants: tuple[str, ...] = tuple(VARIANTS)
    seeds: tuple[int, ...] = (0,)
    eval_every: int = 20
    """Steps between validation losses."""
    max_steps: int | None = None
    """Steps per run (default: train.py's, 300)."""
    data: tuple[str, ...] = ()
    """Corpus inputs to prepare and train on (files, directories, globs; default: the default corpus)."""
    data_dir: str = ""
    """Prepared shards (`python -m gpt.data`) to train on (default: the default corpus, prepared into a
    temporary directory)."""
    preset: str = "small"
    """The model's shape (a GPTConfig preset: `gpt2` is GPT-2 124M)."""
    block_size: int = 128
    batch_size: int = 8
    dtype: str = "float32"
    """The compute dtype (bfloat16 on a GPU; parameters stay float32)."""
    lr: float | None = None
    """The learning rate of the gpt2 recipe and the torch peer (default: TrainConfig's); the modern recipe
    sets its own."""
    warmup_steps: int | None = None
    """Warmup steps (default: TrainConfig's, a tenth of the run)."""
    results: str = "bench/time_to_loss.jsonl"
    """Where each evaluation is appended (JSON lines; git ignores it)."""
    png: str = "bench/time_to_loss.png"
    report_only: bool = False
    """Only print the table and draw the plot from --results."""


def train_config(name: str, seed: int, bench: BenchConfig) -> TrainConfig:
    recipe, model_changes, changes = VARIANTS[name]
    shape = GPTConfig.preset(bench.preset, dtype=bench.dtype)
    given = {field: value for field, value in dict(lr=bench.lr, warmup_steps=bench.warmup_steps,
                                                    max_steps=bench.max_steps).items() if value is not None}
    config = with_recipe(TrainConfig.from_flags(seed=seed, model=shape, block_size=bench.block_size,
                                                batch_size=bench.batch_size, **given), recipe)
    return config.replace(model=config.model.replace(vocab_size=50257, **model_changes), **changes)


def jax_run(config: TrainConfig, data_dir: str):
    """(step(i) -> None, evaluate() -> float) for one variant, compiled, its clock not yet started."""
    mesh = make_mesh(devices=jax.devices()[:1])
    optimizer = config.optim
    model = GPT(config.model, rngs=nnx.Rngs(config.seed))
    graphdef, params, opt_state, shardings = init_train_state(model, optimizer, mesh)
    train_step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings,
                                 label_smoothing=config.label_smoothing)
    eval_step = make_eval_step(graphdef, mesh)
    train_batches = Batches.of_split(data_dir, "train", config.block_size, config.batch_size, config.seed)
    val_batches = [jax.device_put(b) for b in validation(config, data_dir)]
    copy = lambda tree: jax.tree.map(lambda a: a.copy(), tree)  # noqa: E731
    jax.block_until_ready(train_step(copy(params), copy(opt_state), train_batches[0][None], jax.random.key(0)))
    float(eval_step(params, val_batches[0]))  # both compiled before the clock starts
    state = {"params": params, "opt_state": opt_state}

    def step(i: int) -> None:
        state["params"], state["opt_state"], metrics = train_step(
            state["params"], state["opt_state"], train_batches[i][None], jax.random.key(i))
        return metrics["loss"]

    def evaluate() -> float:
        return float(np.mean([float(eval_step(state["params"], b)) for b in val_batches]))

    return step, evaluate


def validation(config: TrainConfig, data_dir: str) -> list[np.ndarray]:
    batches = Batches.of_split(data_dir, "val", config.block_size, config.batch_size, 1)
    return [batches[i] for i in range(config.eval_iters)]


def torch_run(config: TrainConfig, data_dir: str):
    """The nanoGPT-style peer: the gpt2 recipe in PyTorch, on the same batches and schedule. On a GPU (when
    JAX's runs there too): CUDA, torch.compile (compiled before the clock starts), fused AdamW, and bfloat16
    autocast when the model's dtype is bfloat16; on a CPU, eager float32."""
    import contextlib

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(config.seed)
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    m = config.model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=m.vocab_size, n_positions=m.block_size, n_embd=m.n_embd,
                                       n_layer=m.n_layer, n_head=m.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)).to(device).train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optim = config.optim
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": optim.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}],
                                  lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=cuda)
    schedule = make_schedule(optim, optim.lr)
    train_batches = Batches.of_split(data_dir, "train", config.block_size, config.batch_size, config.seed)
    val_batches = [torch.from_numpy(b.astype(np.int64)).to(device) for b in validation(config, data_dir)]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and m.dtype == "bfloat16"
                else contextlib.nullcontext())
    forward = torch.compile(model) if cuda else model

    def loss_of(batch):
        with autocast:
            return forward(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # HF shifts the labels itself

    def step(i: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = float(schedule(i))
        loss = loss_of(torch.from_numpy(train_batches[i].astype(np.int64)).to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def evaluate() -> float:
        with torch.no_grad():
            model.eval()
            losses = [float(loss_of(b)) for b in val_batches]
            model.train()
        return float(np.mean(losses))

    if cuda:  # compile the training and the evaluation graphs before the clock starts; no weight changes
        loss_of(torch.from_numpy(train_batches[0].astype(np.int64)).to(device)).backward()
        optimizer.zero_grad(set_to_none=True)
        evaluate()
    return step, evaluate


def run(name: str, seed: int, bench: BenchConfig, data_dir: str) -> list[dict]:
    """One variant's curve: a record per evaluation with the step, tokens seen and training seconds."""
    config = train_config(name, seed, bench)
    step, evaluate = (torch_run if name == "torch" else jax_run)(config, data_dir)
    tokens_per_step = config.batch_size * config.block_size
    records, seconds = [], 0.0
    for i in range(config.optim.max_steps):
        start = time.perf_counter()
        loss = step(i)
        if (i + 1) % bench.eval_every == 0 or i + 1 == config.optim.max_steps:
            float(loss)  # wait for the step: the clock stops here
            seconds += time.perf_counter() - start
            records.append({"variant": name, "seed": seed, "step": i + 1, "tokens": (i + 1) * tokens_per_step,
                            "seconds": seconds, "val_loss": evaluate()})
            print(f"{name} seed {seed}: step {i + 1}, {seconds:.1f} s, val loss {records[-1]['val_loss']:.4f}",
                  flush=True)
        else:
            seconds += time.perf_counter() - start
    return records


def device_name() -> str:
    """What the runs ran on: the GPU's name, or the CPU's."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else cpu_name()


def time_to(curve: list[dict], target: float) -> float | None:
    """Seconds of training until the validation loss first reaches `target`, linear between evaluations."""
    previous = {"seconds": 0.0, "val_loss": float("inf")}
    for record in curve:
        if record["val_loss"] <= target:
            if not np.isfinite(previous["val_loss"]):
                return record["seconds"]
            share = (previous["val_loss"] - target) / (previous["val_loss"] - record["val_loss"])
            return previous["seconds"] + share * (record["seconds"] - previous["seconds"])
        previous = record
    return None


def loss_at(curve: list[dict], seconds: float) -> float:
    """The validation loss at `seconds` of training, linear between evaluations (the last one after them)."""
    times, losses = [r["seconds"] for r in curve], [r["val_loss"] for r in curve]
    return float(np.interp(seconds, times, losses))


def report(bench: BenchConfig) -> None:
    records = [json.loads(line) for line in Path(bench.results).read_text().splitlines() if line.strip()]
    curves: dict[str, dict[int, list[dict]]] = {}
    for record in records:
        curves.setdefault(record["variant"], {}).setdefault(record["seed"], []).append(record)
    baseline = curves["gpt2"]
    # The target is where the default recipe ends, and its time is the whole run's (by definition).
    target = float(np.mean([curve[-1]["val_loss"] for curve in baseline.values()]))
    baseline_time = float(np.mean([curve[-1]["seconds"] for curve in baseline.values()]))
    print(f"target: the gpt2 recipe's final validation loss, {target:.4f} (mean of {len(baseline)} seeds), "
          f"after {baseline_time:.1f} s of training; {device_name()}")
    print("\n| variant | seeds | final val loss | s/step | time to target (s) | vs gpt2 | val loss at gpt2's time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, by_seed in curves.items():
        finals = [c[-1]["val_loss"] for c in by_seed.values()]
        per_step = np.mean([c[-1]["seconds"] / c[-1]["step"] for c in by_seed.values()])
        times = [c[-1]["seconds"] if name == "gpt2" else time_to(c, target) for c in by_seed.values()]
        reached = [t for t in times if t is not None]
        at_equal = np.mean([loss_at(c, baseline_time) for c in by_seed.values()])
        to_target = (f"{np.mean(reached):.1f}" + ("" if len(reached) == len(times) else f" ({len(reached)} seeds)")
                     if reached else "not reached")
        ratio = f"{np.mean(reached) / baseline_time:.2f}" if reached else "-"
        spread = f" +- {np.std(finals):.3f}" if len(finals) > 1 else ""
        print(f"| {name} | {len(by_seed)} | {np.mean(finals):.4f}{spread} | {per_step:.3f} | {to_target} | {ratio} "
              f"| {at_equal:.4f} |")
    plot(curves, target, bench.png)


def plot(curves: dict, target: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    main = {"gpt2": ("black", "-"), "modern": ("C3", "-"), "torch": ("C0", "--")}  # the rest: thin, one color each
    pieces = iter(plt.cm.tab10([1, 2, 4, 5, 6, 7, 8, 9, 0, 3]))
    for name, by_seed in curves.items():
        color, line = main[name] if name in main else (next(pieces), "-")
        style = {"color": color, "linestyle": line, "linewidth": 2.2 if name in main else 0.9}
        for seed, curve in by_seed.items():
            label = name if seed == min(by_seed) else None
            by_time.plot([r["seconds"] for r in curve], [r["val_loss"] for r in curve], label=label, **style)
            by_tokens.plot([r["tokens"] / 1e3 for r in curve], [r["val_loss"] for r in curve], **style)
    for ax, label in ((by_time, f"training seconds ({device_name()})"), (by_tokens, "thousand tokens")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    by_time.set_ylabel("validation loss (nats)")
    lowest = min(r["val_loss"] for by_seed in curves.values() for c in by_seed.values() for r in c)
    by_time.set_ylim(lowest - 0.05, target + 1.0)
    by_time.legend(fontsize=7, ncol=2)
    fig.suptitle(f"time to loss, {device_name()}: dashed = the gpt2 recipe's final loss", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")


def main(bench: BenchConfig) -> None:
    if not bench.report_only:
        unknown = [name for name in bench.variants if name not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        with tempfile.TemporaryDirectory() as scratch:
            data_dir = bench.data_dir
            if not data_dir:
                data_dir = str(Path(scratch) / "data")
                prepare(list(bench.data) or default_corpus(), data_dir, TrainConfig().val_fraction)
            print(f"# {device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, jax {jax.__version__}")
            for seed in bench.seeds:
                for name in bench.variants:
                    with open(bench.results, "a") as out:
                        for record in run(name, seed, bench, data_dir):
                            out.write(json.dumps(record) + "\n")
    report(bench)


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
