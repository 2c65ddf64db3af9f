"""GPT-2 pretraining throughput on one GPU, against llm.c and PyTorch in the same call: one command, one table.

    python bench/gpu_bench.py                 # GPT-2 124M, bfloat16 compute / float32 params, block 1024,
                                              # ~0.5M tokens a step; scan_layers x remat; the torch peer
    python bench/gpu_bench.py --llmc llm.c/train_gpt2cu --variants baseline fp8   # llm.c (cuDNN) beside, and FP8
    python bench/gpu_bench.py --variants baseline padded_vocab bf16_logits all  # each lever, then them together
    python bench/gpu_bench.py --presets gpt2 gpt2-medium
    python bench/gpu_bench.py --smoke         # the same code at tiny shapes on a CPU (the test suite runs it)

Each configuration runs in a process of its own (so that one's out-of-memory and peak memory do not
touch the next): for each, the largest micro-batch of `--micro_batches` that fits, then gradient
accumulation up to `--tokens_per_step`. Ours is this project's jitted train step (forward, chunked
cross-entropy, backward, accumulation, clipping, AdamW) dispatched back to back as the training loop does;
the peers are llm.c's `train_gpt2cu` built with cuDNN (`bench/llmc_peer.py`: the reference pretraining
codebase, given by `--llmc PATH`) and nanoGPT's recipe in PyTorch: transformers' GPT2LMHeadModel with SDPA
(flash) attention, bfloat16 autocast, fused AdamW and `torch.compile`, on the same token batches.

A variant is a set of levers (`LEVERS`, joined by "+"; `all` is every lever but FP8, whose numbers differ), each a
cell of the backend table's row (`gpt.model.backend`, changed through `GPT_BACKEND_CHOICES`), a field of the
model's config, or XLA's options, which are set before JAX starts: so every variant runs in a process of its own.

Reported: tokens/s (best of `--rounds` rounds of `--steps` optimizer steps), MFU = tokens/s x
flops_per_token / peak, with flops_per_token = 6 x matmul parameters + 12 x layers x width x block (the
PaLM paper's formula; `gpt.train.step.flops_per_token`) and the device's dense bfloat16 peak
(`gpt.hardware.CHIPS`: H100 989 TFLOP/s), the first step's time (compile included) and the peak
device memory. `--json PATH` also writes the rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tyro

from variants import Lever, Levers, ran_with, report, run_worker

ROOT = Path(__file__).resolve().parents[1]
OOM_EXIT = 3  # a worker's exit status when its micro-batch does not fit


@dataclasses.dataclass(frozen=True)
class Bench:
    smoke: bool = False
    """Tiny shapes, float32 and a few steps, on whatever device there is (a CPU): the code path, not a figure."""
    presets: tuple[str, ...] = ("gpt2",)
    block_size: int = 1024
    tokens_per_step: int = 524_288
    """Tokens per optimizer step (micro-batch x block x accumulation), ~0.5M as GPT-2's recipe."""
    micro_batches: tuple[int, ...] = (32, 16, 8, 4)
    """Micro-batch sizes to try, largest first; the first that fits is used."""
    scan_layers: tuple[bool, ...] = (False, True)
    remat: tuple[bool, ...] = (False, True)
    variants: tuple[str, ...] = ("baseline",)
    """Each a lever of `LEVERS`, several joined by "+", `all`, or `baseline` (the table's row as it is)."""
    steps: int = 5
    """Timed optimizer steps per round."""
    rounds: int = 1
    torch: bool = True
    """Also run the PyTorch peer (right after our first configuration, at its micro-batch, halved until it fits)."""
    torch_compile: bool = True
    llmc: str | None = None
    """An llm.c `train_gpt2cu` binary (built with USE_CUDNN=1) to run as a peer on the same shapes."""
    json: str | None = None
    profile_dir: str | None = None
    """Also trace `profile_steps` steps of each of our configurations with JAX's profiler, into a folder of
    this one per configuration (`bench/step_profile.py FOLDER` makes the table)."""
    profile_steps: int = 3
    profile_variants: tuple[str, ...] | None = None
    """The variants traced under `profile_dir` (None: every one)."""
    timeout_s: float = 600
    """Per worker process."""

    def shapes(self) -> Bench:
        """`self`, or tiny shapes under --smoke."""
        if not self.smoke:
            return self
        return dataclasses.replace(self, presets=("smoke",), block_size=64, tokens_per_step=4 * 64 * 2,
                                   micro_batches=(4, 2), steps=2, rounds=1, timeout_s=300)


@dataclasses.dataclass(frozen=True)
class Job:
    """One configuration, run by a worker process."""

    impl: str  # "jax", "torch" or "llmc"
    preset: str
    block_size: int
    micro_batch: int
    accumulation: int
    scan_layers: bool = False
    remat: bool = False
    variant: str = "baseline"
    steps: int = 4
    rounds: int = 2
    torch_compile: bool = True
    llmc: str | None = None
    timeout_s: float = 600
    profile_dir: str | None = None
    profile_steps: int = 3


def levers() -> Levers:
    """The training step's levers; `all` is every one but FP8, whose numbers differ."""
    from gpt.model.backend import GPU_XLA_OPTIONS

    known = {
        "padded_vocab": Lever(choices={"head_rows_multiple": 128}),  # the head's 50257 rows as 50304
        "bf16_logits": Lever(choices={"head_logits": "compute"}),
        "cast_once": Lever(choices={"params_cast_once": True}),
        "xla_options": Lever(env=GPU_XLA_OPTIONS),
        "fp8": Lever(config={"fp8": True}),
    }
    return Levers(known, together=tuple(name for name in known if name != "fp8"))


def model_config(preset: str, block_size: int, **runtime):
    from gpt.model.config import GPTConfig

    if preset == "smoke":  # a vocabulary that is no multiple of 128, as GPT-2's is not
        return GPTConfig.preset("small", n_layer=2, n_head=2, n_embd=64, block_size=block_size, vocab_size=500,
                                **runtime)
    return GPTConfig.preset(preset, block_size=max(block_size, 1024), **runtime)


def token_batches(job: Job, count: int = 2):
    """`count` int32 arrays [accumulation, micro_batch, block + 1] of random token ids (the same for both sides)."""
    import numpy as np

    rng, vocab = np.random.default_rng(0), model_config(job.preset, job.block_size).vocab_size
    return [rng.integers(0, vocab, (job.accumulation, job.micro_batch, job.block_size + 1), dtype=np.int32)
            for _ in range(count)]


def timed(step, job: Job) -> dict:
    """Run `step(i)` (which returns something to wait on) once for the compile, then `rounds` x `steps`."""
    start = time.perf_counter()
    step(0)()
    first = time.perf_counter() - start
    best = float("inf")
    for r in range(job.rounds):
        start = time.perf_counter()
        wait = None
        for i in range(job.steps):
            wait = step(1 + r * job.steps + i)  # dispatched back to back, as the training loop does
        wait()
        best = min(best, (time.perf_counter() - start) / job.steps)
    return {"first_step_s": first, "step_s": best}


def jax_worker(job: Job) -> dict:
    import jax
    from flax import nnx

    from gpt.model.sharding import make_mesh
    from gpt.model.transformer import GPT
    from gpt.train.optimizer import OptimizerConfig
    from gpt.train.step import init_train_state, make_train_step

    dtype = "float32" if job.preset == "smoke" else "bfloat16"
    config = model_config(job.preset, job.block_size, dtype=dtype, param_dtype="float32",
                          scan_layers=job.scan_layers, remat=job.remat, **levers().config(job.variant))
    optimizer = OptimizerConfig(max_steps=10_000)
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, params, opt_state, shardings = init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)
    train_step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
    batches = [jax.device_put(b) for b in token_batches(job)]
    state = {"params": params, "opt_state": opt_state}
    key = jax.random.key(0)
    start = time.perf_counter()  # compiled once, as the trainer does: the profile reads the program's text
    train_step = train_step.with_program(train_step.lower(params, opt_state, batches[0], key).compile())
    compile_s = time.perf_counter() - start

    def step(i: int):
        state["params"], state["opt_state"], metrics = train_step(state["params"], state["opt_state"],
                                                                   batches[i % len(batches)], key)
        return lambda: float(metrics["loss"])

    result = timed(step, job)
    result["first_step_s"] += compile_s
    stats = jax.devices()[0].memory_stats() or {}
    if job.profile_dir:
        trace_steps(job, config, train_step, state, batches, key, step)
    return {**result, "peak_bytes": stats.get("peak_bytes_in_use"), "device": jax.devices()[0].device_kind,
            "dtype": config.dtype, "ran_with": {**ran_with(), "fp8": config.fp8}}


def trace_steps(job: Job, config, train_step, state: dict, batches, key, step) -> None:
    """`job.profile_steps` more steps under JAX's profiler, in a folder of `job.profile_dir` named for the job."""
    import jax

    from gpt.train.checkpoint import config_to_json
    from gpt.train.profile import StepTrace

    name = f"{job.preset}-scan{int(job.scan_layers)}-remat{int(job.remat)}-{job.variant}"
    trace = StepTrace(Path(job.profile_dir) / name)
    jax.block_until_ready(state)
    trace.start()
    for i in range(job.profile_steps):
        wait = step(i)
    wait()
    jax.block_until_ready(state)
    hlo = train_step.compiled_text(state["params"], state["opt_state"], batches[0], key)
    trace.stop(job.profile_steps, {"model": config_to_json(config), "micro_batch": job.micro_batch,
                                   "block_size": job.block_size, "accumulation": job.accumulation}, hlo)


def torch_worker(job: Job) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = model_config(job.preset, job.block_size)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95), fused=cuda)
    forward = torch.compile(model) if job.torch_compile else model
    batches = [torch.from_numpy(b.astype("int64")).to(device) for b in token_batches(job)]
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=job.preset != "smoke")

    def step(i: int):
        batch = batches[i % len(batches)]
        for micro in batch:
            with autocast:
                logits = forward(input_ids=micro[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), micro[:, 1:].flatten())
            (loss / job.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return lambda: float(loss)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = timed(step, job)
    return {**result, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16 autocast" if
            job.preset != "smoke" else "float32"}


def llmc_worker(job: Job) -> dict:
    import llmc_peer

    config = model_config(job.preset, job.block_size)
    result = llmc_peer.run(job.llmc, depth=config.n_layer, vocab_size=config.vocab_size, micro_batch=job.micro_batch,
                           block_size=job.block_size, accumulation=job.accumulation, steps=job.steps * job.rounds,
                           timeout_s=job.timeout_s)
    return {**result, "peak_bytes": None, "dtype": "bfloat16"}


WORKERS = {"jax": jax_worker, "torch": torch_worker, "llmc": llmc_worker}


def is_oom(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(sign in text for sign in ("RESOURCE_EXHAUSTED", "OutOfMemory", "out of memory", "Out of memory"))


def worker(job: Job) -> int:
    try:
        result = WORKERS[job.impl](job)
    except Exception as error:
        if is_oom(error):
            return OOM_EXIT
        raise
    report({**dataclasses.asdict(job), **result})
    return 0


def run_job(job: Job, timeout_s: float) -> dict | None:
    """The worker's result row, None when the micro-batch does not fit; raises on any other failure."""
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ".92"),
           **levers().env(job.variant)}
    return run_worker(__file__, dataclasses.asdict(job), env, timeout_s, quiet_exit=OOM_EXIT)


def largest_that_fits(bench: Bench, make_job) -> dict | None:
    for micro_batch in bench.micro_batches:
        accumulation = max(1, bench.tokens_per_step // (micro_batch * bench.block_size))
        row = run_job(make_job(micro_batch, accumulation), bench.timeout_s)
        if row is not None:
            return row
        print(f"  micro-batch {micro_batch} does not fit", flush=True)
    return None


def add_rates(row: dict) -> dict:
    from gpt.hardware import chip_of
    from gpt.train.step import flops_per_token

    tokens = row["micro_batch"] * row["accumulation"] * row["block_size"]
    chip = chip_of(row["device"])
    peak = None if chip is None else chip.bf16_flops
    rate = tokens / row["step_s"]
    flops = flops_per_token(model_config(row["preset"], row["block_size"]), row["block_size"])
    return {**row, "tokens_per_s": rate, "mfu": rate * flops / peak if peak else None}


IMPL_NAMES = {"jax": "gpt (jax)", "llmc": "llm.c (cuDNN)"}


def table(rows: list[dict]) -> str:
    lines = ["| impl | preset | scan_layers | remat | variant | micro-batch x accum | tokens/s | MFU | vs llm.c | "
             "vs torch | first step (s) | peak memory (GiB) |", "| --- " * 12 + "|"]
    peers = {impl: {row["preset"]: row["tokens_per_s"] for row in rows if row["impl"] == impl}
             for impl in ("llmc", "torch")}
    for row in rows:
        impl = IMPL_NAMES.get(row["impl"]) or "torch" + (" (compile)" if row["torch_compile"] else "")
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        ratios = [f"{row['tokens_per_s'] / peers[peer][row['preset']]:.2f}x" if row["preset"] in peers[peer] else "-"
                  for peer in ("llmc", "torch")]
        memory = f"{row['peak_bytes'] / 2**30:.1f}" if row["peak_bytes"] else "-"
        knobs = (row["scan_layers"], row["remat"], row["variant"]) if row["impl"] == "jax" else ("-", "-", "-")
        lines.append(f"| {impl} | {row['preset']} | {' | '.join(map(str, knobs))} | {row['micro_batch']} x "
                     f"{row['accumulation']} | {row['tokens_per_s']:,.0f} | {mfu} | {' | '.join(ratios)} | "
                     f"{row['first_step_s']:.1f} | {memory} |")
    return "\n".join(lines)


def peer_rows(bench: Bench, preset: str, micro_batch: int, impl: str) -> list[dict]:
    """The peer `impl` (llm.c where given, torch where asked for) at `micro_batch` (halved until it fits): its row,
    if it ran."""
    if (impl == "llmc" and not bench.llmc) or (impl == "torch" and not bench.torch):
        return []
    print(f"{impl} {preset}", flush=True)
    sizes = tuple(mb for mb in bench.micro_batches if mb <= micro_batch)
    try:
        row = largest_that_fits(dataclasses.replace(bench, micro_batches=sizes), lambda mb, acc: Job(
            impl, preset, bench.block_size, mb, acc, steps=bench.steps, rounds=bench.rounds,
            torch_compile=bench.torch_compile, llmc=bench.llmc, timeout_s=bench.timeout_s))
    except (RuntimeError, subprocess.TimeoutExpired) as error:  # a peer's failure costs its row, not ours
        print(f"  {impl} failed: {str(error)[-2000:]}", flush=True)
        return []
    if row is None:
        return []
    row = add_rates(row)
    print("  " + table([row]).splitlines()[-1], flush=True)
    return [row]


def main(bench: Bench) -> list[dict]:
    bench = bench.shapes()
    levers().check(bench.variants)
    rows = []

    def save() -> None:
        if bench.json:
            Path(bench.json).write_text(json.dumps(rows, indent=1))

    for preset in bench.presets:
        first = None
        for scan_layers, remat, variant in itertools.product(bench.scan_layers, bench.remat, bench.variants):
            print(f"jax {preset} scan_layers={scan_layers} remat={remat} variant={variant}", flush=True)
            row = largest_that_fits(bench, lambda mb, acc: Job(
                "jax", preset, bench.block_size, mb, acc, scan_layers, remat, variant, bench.steps, bench.rounds,
                profile_dir=bench.profile_dir if variant in (bench.profile_variants or (variant,)) else None,
                profile_steps=bench.profile_steps))
            if row is None:
                continue
            rows.append(add_rates(row))
            print("  " + table(rows[-1:]).splitlines()[-1], flush=True)  # kept if a later job is cut off
            if first is None:  # llm.c, the figure to beat, right after our first row: a budget cut never loses it
                first = row
                rows += peer_rows(bench, preset, row["micro_batch"], "llmc")
            save()
        if first is not None:  # torch last: ours has been ahead of it since the first measurement
            rows += peer_rows(bench, preset, first["micro_batch"], "torch")
            save()
    device = rows[0]["device"] if rows else "?"
    print(f"\n# {device}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ~{bench.tokens_per_step:,} tokens "
          f"a step, block {bench.block_size}; best of {bench.rounds} rounds of {bench.steps} steps (llm.c: the "
          f"median of its steps after its first two)")
    print(table(rows), flush=True)
    print("MFU = tokens/s x (6 x matmul parameters + 12 x layers x width x block) / the device's dense bfloat16 "
          "peak (H100 and H200: 989 TFLOP/s), for every row alike")
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(Job(**json.loads(sys.argv[2]))))
    main(tyro.cli(Bench))
