"""How long a tiny model's first eager calls take in a fresh process: init, a forward, a gradient.

    python bench/eager_bench.py LABEL

Run it once per tree to compare (PYTHONPATH=that tree), alternating, since every figure includes the
compiles a fresh process pays. Prints one line.
"""

import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from gpt import GPT, GPTConfig


def timed(function):
    """(what `function` returns, the seconds it took until its arrays were ready)."""
    start = time.perf_counter()
    value = jax.block_until_ready(function())
    return value, time.perf_counter() - start


def main(label: str) -> None:
    (graphdef, params), init = timed(lambda: nnx.split(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    _, forward = timed(lambda: model(jnp.zeros((3, 7), jnp.int32)))
    tokens = jnp.ones((2, 17), jnp.int32)
    _, grad = timed(lambda: jax.grad(lambda p: nnx.merge(graphdef, p).loss(tokens[:, :-1], tokens[:, 1:]))(params))
    print(f"{label}: init {init:.2f} s, first eager forward {forward:.2f} s, first eager grad of the loss {grad:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
