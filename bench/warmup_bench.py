"""How long an engine's warm-up takes in a fresh process: what `serve.py` pays before it listens.

    python bench/warmup_bench.py LABEL [--quantize int8]

GPT-2 124M shapes, random weights, serve.py's defaults (8 slots, a 1,024-position cache, prefill chunks of
256): the seconds from the engine's construction to the end of its warm-up, and how many programs it
compiled. Run it once per tree to compare (PYTHONPATH=that tree), alternating, on an otherwise idle
machine; no persistent compilation cache. Prints one line.
"""

import argparse
import time

import jax
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.inference.engine import Engine, compiled_programs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--quantize", default="none")
    args = parser.parse_args()
    model = GPT(GPTConfig.preset("gpt2"), rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    start = time.perf_counter()
    engine = Engine(model, slots=8, cache_length=1024, prefill_chunk=256, quantize=args.quantize)
    engine.warmup(log=lambda line: None)
    seconds = time.perf_counter() - start
    print(f"{args.label}: quantize {args.quantize}, warm-up {seconds:.1f} s, {compiled_programs()} programs "
          f"({jax.devices()[0].device_kind})", flush=True)


if __name__ == "__main__":
    main()
