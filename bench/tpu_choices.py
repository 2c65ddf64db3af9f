"""The TPU row of the backend table (`gpt.model.backend`), choice by choice, from compiled programs: GPT-2's train
step at two layers (the loss and attention's share of memory does not depend on depth), 8 sequences of 1024 tokens
a chip, bfloat16, compiled on this CPU for a v5e-8 (libtpu's compiler) with each value of one choice, and what
each program needs of a chip. No TPU has run it: the figures are the compiler's memory and cost analyses.

    pip install -e ".[tpu]"
    python bench/tpu_choices.py                            # attention, then the loss's chunk size
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from gpt.model import backend  # noqa: E402
from gpt.model.config import GPTConfig  # noqa: E402
from gpt.train import step  # noqa: E402
from gpt.train.compile_only import compile_train_step  # noqa: E402
from gpt.train.trainer import TrainConfig  # noqa: E402

VARIANTS = {"attention": ["splash", "plain"], "loss_chunk_bytes": [64 << 20, 256 << 20, 1 << 30, 8 << 30]}


def compiled_with(choice: str, value) -> dict:
    """The report of the step compiled with the TPU row's `choice` set to `value`."""
    backend.CHOICES["tpu"] = dataclasses.replace(backend.CHOICES["tpu"], **{choice: value})
    jax.clear_caches()  # the choices are read while tracing: a cached trace would keep the last ones
    step._train_step.cache_clear()
    config = TrainConfig.from_flags(model=GPTConfig.preset("gpt2", n_layer=2, dtype="bfloat16"), batch_size=64,
                                    block_size=1024, compile_only="v5e-8")
    report = compile_train_step(config, log=lambda *_: None)
    return {"temporaries_gib": report.temp_bytes / 2**30, "total_gib": report.total_bytes / 2**30,
            "xla_tflops": report.flops / 1e12, "bytes_accessed_gb": report.bytes_accessed / 1e9, "loops": report.loops}


def main() -> None:
    chosen = backend.CHOICES["tpu"]
    for choice, values in VARIANTS.items():
        print(f"\n| {choice} | temporaries (GiB) | total (GiB) | XLA's TFLOP | bytes accessed (GB) | loops |")
        print("| --- | --- | --- | --- | --- | --- |")
        for value in values:
            r = compiled_with(choice, value)
            shown = f"{value >> 20} MiB" if isinstance(value, int) else value
            print(f"| {shown}{' (the row)' * (value == getattr(chosen, choice))} | {r['temporaries_gib']:.2f} | "
                  f"{r['total_gib']:.2f} | {r['xla_tflops']:.3f} | {r['bytes_accessed_gb']:.1f} | {r['loops']} |",
                  flush=True)
        backend.CHOICES["tpu"] = chosen


if __name__ == "__main__":
    main()
