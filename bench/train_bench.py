"""Train-step tokens/s: this project's jitted step against transformers' GPT2LMHeadModel + torch AdamW.

    python bench/train_bench.py                      # the issue's CPU config: 4 layers, 4 heads, 256 wide,
                                                     # block 256, batch 8, GPT-2 vocabulary, float32
    python bench/train_bench.py --preset gpt2 --block_size 1024 --batch_size 16 --dtype bfloat16 --no-torch
                                                     # GPT-2 124M on a GPU, with MFU

Both sides run the same work per step: forward, cross-entropy over the full vocabulary, backward,
global-norm clipping at 1.0 and an AdamW update (decay 0.1 on matrices only), on the same random
batches. Each side is timed over `--steps` steps after `--warmup` untimed ones, in alternating rounds so
that a busy machine slows both alike; the best round is reported.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import tyro
from flax import nnx

from gpt.model.config import GPTConfig
from gpt.model.sharding import make_mesh
from gpt.model.transformer import GPT
from gpt.train.optimizer import OptimizerConfig
from gpt.train.step import flops_per_token, init_train_state, make_train_step, peak_flops

from machine import cpu_name


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    preset: str = "small"
    """GPTConfig preset; the layer/head/width flags below override it."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    batch_size: int = 8
    dtype: str = "float32"
    steps: int = 10
    """Timed steps per round."""
    warmup: int = 3
    rounds: int = 3
    torch: bool = True
    """Also time transformers' GPT2LMHeadModel + torch.optim.AdamW."""
    threads: int | None = None
    """torch threads (default: torch's own choice, all cores)."""


def model_config(bench: BenchConfig) -> GPTConfig:
    overrides = dict(n_layer=bench.n_layer, n_head=bench.n_head, n_embd=bench.n_embd) if bench.preset == "small" else {}
    return GPTConfig.preset(bench.preset, vocab_size=50257, block_size=max(bench.block_size, 64), dtype=bench.dtype,
                            **overrides)


def batches(bench: BenchConfig, count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50257, (count, bench.batch_size, bench.block_size + 1), dtype=np.int32)


def jax_stepper(bench: BenchConfig, data: np.ndarray):
    config = model_config(bench)
    optimizer = OptimizerConfig(max_steps=10_000)
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, params, opt_state, shardings = init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)
    step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
    state = {"params": params, "opt_state": opt_state}
    device_batches = [jax.device_put(b[None]) for b in data]

    def run(i: int) -> float:
        state["params"], state["opt_state"], metrics = step(state["params"], state["opt_state"],
                                                            device_batches[i % len(data)], jax.random.key(i))
        return float(metrics["loss"])  # waits for the step

    return run


def torch_stepper(bench: BenchConfig, data: np.ndarray):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if bench.threads:
        torch.set_num_threads(bench.threads)
    config = model_config(bench)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )).train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    tensors = [torch.from_numpy(b.astype(np.int64)) for b in data]

    def run(i: int) -> float:
        batch = tensors[i % len(data)]
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return run


def seconds_per_step(run, bench: BenchConfig, offset: int) -> float:
    start = time.perf_counter()
    for i in range(bench.steps):
        run(offset + i)
    return (time.perf_counter() - start) / bench.steps


def main(bench: BenchConfig) -> None:
    data = batches(bench, 8)
    steppers = {"gpt (jax)": jax_stepper(bench, data)}
    if bench.torch:
        steppers["transformers (torch)"] = torch_stepper(bench, data)
    for run in steppers.values():
        for i in range(bench.warmup):
            run(i)  # compiles (jax) and warms allocators (torch)
    best = {name: float("inf") for name in steppers}
    for r in range(bench.rounds):
        for name, run in steppers.items():
            best[name] = min(best[name], seconds_per_step(run, bench, bench.warmup + r * bench.steps))

    config = model_config(bench)
    tokens = bench.batch_size * bench.block_size
    device = jax.devices()[0]
    peak = peak_flops()
    print(f"# {cpu_name()} / {device.device_kind}; jax {jax.__version__}; "
          f"{config.num_params():,} params; batch {bench.batch_size} x block {bench.block_size}; {bench.dtype}")
    print("| impl | ms/step | tokens/s | vs torch | MFU |")
    print("| --- | --- | --- | --- | --- |")
    reference = best.get("transformers (torch)")
    for name, seconds in best.items():
        mfu = (f"{flops_per_token(config, bench.block_size) * tokens / seconds / peak:.1%}"
               if peak and name.startswith("gpt") else "-")
        ratio = f"{reference / seconds:.2f}x" if reference else "-"
        print(f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {ratio} | {mfu} |")


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
