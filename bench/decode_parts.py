"""The two parts of a float32 decode step on CPU, each against its alternatives, for bench/RESULTS.md.

    python bench/decode_parts.py

1. Matmuls: a chain of GPT-2 124M's 48 block matrices (340 MB, output-major [K, D]) in one jit, for a
   few rows: XLA's dot, the few-row multiply-and-sum (`gpt.layouts._few_rows_matmul`), and torch's
   `x @ W.T` on the same matrices. A step streams every weight once, so these set its floor.
2. Attention over an 8-row x 12-head cache of 1024 slots (one layer): the chunked read
   (`_attend_in_chunks`, chunks of 128), the whole-cache read (`attend` under the mask), and
   `attend_cached`, which picks between them.

Milliseconds, median of --repeats calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt.attention import _attend_in_chunks, attend, attend_cached
from gpt.layouts import _few_rows_matmul
from machine import cpu_name


def _median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def matmul_chain(rows_list, repeats: int) -> None:
    import torch

    D = 768
    rng = np.random.default_rng(0)
    shapes = [(3 * D, D), (D, D), (4 * D, D), (D, 4 * D)] * 12
    # std 1/sqrt(inputs): activations keep their size down the chain (no denormals, which slow torch)
    matrices = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])) for shape in shapes]
    torch_matrices = [torch.from_numpy(np.array(m)) for m in matrices]

    def chain(matmul):
        @jax.jit
        def run(matrices, x_MD):  # each product feeds the next, in a block's order, as in a forward
            for m in matrices:  # [3D, D] (q, k, v: q goes on), [D, D], [4D, D], [D, 4D]
                y = matmul(x_MD, m)
                x_MD = y[:, :D] if m.shape[0] == 3 * D else y
            return x_MD
        return run

    dot = chain(lambda x, m: jax.lax.dot_general(x, m, (((1,), (1,)), ((), ()))))
    few_rows = chain(_few_rows_matmul)
    print("| rows | XLA dot | few-row multiply-and-sum | torch |")
    print("| --- | --- | --- | --- |")
    for rows in rows_list:
        x_MD = jnp.ones((rows, D))

        def torch_chain():
            with torch.inference_mode():
                x = torch.ones((rows, D))
                for m in torch_matrices:
                    y = x @ m.T
                    x = y[:, :D].contiguous() if m.shape[0] == 3 * D else y

        times = [_median_ms(lambda f=f: f(matrices, x_MD).block_until_ready(), repeats) for f in (dot, few_rows)]
        print(f"| {rows} | {times[0]:.1f} | {times[1]:.1f} | {_median_ms(torch_chain, repeats):.1f} |", flush=True)


def attention(positions_list, repeats: int, chunk: int = 128) -> None:
    B, N, S, H = 8, 12, 1024, 64
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H), dtype=np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B * N, S, H), dtype=np.float32)) for _ in range(2))
    chunked = jax.jit(lambda q, k, v, p: _attend_in_chunks(q, k, v, p, jnp.max(p) // chunk + 1, chunk))
    whole = jax.jit(lambda q, k, v, p: attend(q, k, v, jnp.arange(S)[None, None, :] <= p[:, :, None]))
    chosen = jax.jit(lambda q, k, v, p: attend_cached(q, k, v, p, chunk))
    print("| furthest position | chunked | whole | attend_cached |")
    print("| --- | --- | --- | --- |")
    for position in positions_list:
        p = jnp.full((B, 1), position, jnp.int32)
        times = [_median_ms(lambda f=f: f(q, k, v, p).block_until_ready(), repeats) for f in (chunked, whole, chosen)]
        print(f"| {position} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--positions", type=int, nargs="+", default=[64, 192, 384, 640, 960])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"# {cpu_name()}, {cores} cores, jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("\nMatmul chain (48 GPT-2 block matrices, float32), ms:\n")
    matmul_chain(args.rows, args.repeats)
    print("\nDecode attention, one layer, 8 rows x 12 heads over 1024 slots, ms:\n")
    attention(args.positions, args.repeats)


if __name__ == "__main__":
    main()
