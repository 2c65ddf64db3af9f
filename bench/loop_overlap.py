"""Does the training loop hide its host work behind the device? `train()` against the bare step, with the
host side made slow on purpose.

    python bench/loop_overlap.py                    # 2 layers x 64 wide, block 64, batch 8; host 0 and ~1 step
    python bench/loop_overlap.py --host_ms 0 50 150

The loader is slowed by `--host_ms` milliseconds per batch (a sleep in `Batches.__getitem__`, as a slow
disk or tokenizer would be), and the loop reads its metrics as it always does. The loop's step time is the
median over its log intervals (the first, which compiles, left out); the bare step is the jitted step
alone, dispatched back to back on batches already on the device. A loop that waits on the host takes
host + device a step; one that overlaps them takes max(host, device).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import tyro
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt.data import loader  # noqa: E402
from gpt.data.prepare import default_corpus  # noqa: E402
from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.sharding import make_mesh  # noqa: E402
from gpt.model.transformer import GPT  # noqa: E402
from gpt.train.optimizer import OptimizerConfig  # noqa: E402
from gpt.train.step import init_train_state, make_train_step  # noqa: E402
from gpt.train.trainer import TrainConfig, train  # noqa: E402

from machine import cpu_name  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Bench:
    n_layer: int = 2
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 8
    steps: int = 60
    log_interval: int = 10
    host_ms: tuple[float, ...] = ()
    """Milliseconds of host work per batch; default: 0 and the bare step's own time."""


def model_config(bench: Bench) -> GPTConfig:
    return GPTConfig.preset("small", n_layer=bench.n_layer, n_head=2, n_embd=bench.n_embd,
                            block_size=bench.block_size, vocab_size=50257)


def bare_step_ms(bench: Bench, repeats: int = 30) -> float:
    """The jitted step alone, back to back, on placed batches: the device's time a step."""
    optimizer = OptimizerConfig(max_steps=10_000, warmup_steps=0)
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, params, opt_state, shardings = init_train_state(GPT(model_config(bench), rngs=nnx.Rngs(0)),
                                                              optimizer, mesh)
    step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, 50257, (1, bench.batch_size, bench.block_size + 1), dtype=np.int32))
               for _ in range(4)]
    key = jax.random.key(0)
    for i in range(3):
        params, opt_state, metrics = step(params, opt_state, batches[i % 4], key)
    jax.block_until_ready(metrics)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(repeats):
            params, opt_state, metrics = step(params, opt_state, batches[i % 4], key)
        jax.block_until_ready(metrics)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def loop_step_ms(bench: Bench, corpus: str, host_ms: float, work: Path) -> float:
    """train()'s own step time with the loader slowed by `host_ms`: the median log interval's."""
    original = loader.Batches.__getitem__

    def slow(self, step):
        time.sleep(host_ms / 1e3)
        return original(self, step)

    loader.Batches.__getitem__ = slow
    try:
        out_dir = work / f"run-{host_ms:g}"
        train(TrainConfig.from_flags(data=(corpus,), out_dir=str(out_dir), model=model_config(bench),
                                     block_size=bench.block_size, batch_size=bench.batch_size, max_steps=bench.steps,
                                     log_interval=bench.log_interval, eval_interval=10**6, eval_iters=1,
                                     checkpoint_interval=10**6, sample_tokens=0, compile_cache=False),
              log=lambda *_: None)
    finally:
        loader.Batches.__getitem__ = original
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [bench.batch_size * bench.block_size / r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return statistics.median(seconds[1:]) * 1e3


def main(bench: Bench) -> None:
    device_ms = bare_step_ms(bench)
    work = Path(tempfile.mkdtemp(prefix="loop-overlap-"))
    corpus = work / "corpus.txt"
    corpus.write_text("".join(p.read_text(errors="replace") for p in default_corpus()[:40]))
    print(f"# {cpu_name()} / {jax.devices()[0].device_kind}; jax {jax.__version__}; {bench.n_layer} layers x "
          f"{bench.n_embd} wide, block {bench.block_size}, batch {bench.batch_size}; bare step {device_ms:.1f} ms")
    print("| host ms/batch | loop ms/step | host + device | max(host, device) | loop / max |")
    print("| --- | --- | --- | --- | --- |")
    for host_ms in bench.host_ms or (0.0, round(device_ms)):
        loop_ms = loop_step_ms(bench, str(corpus), host_ms, work)
        bound = max(host_ms, device_ms)
        print(f"| {host_ms:g} | {loop_ms:.1f} | {host_ms + device_ms:.1f} | {bound:.1f} | {loop_ms / bound:.2f} |",
              flush=True)


if __name__ == "__main__":
    main(tyro.cli(Bench))
