"""The two parts of a float32 decode step on CPU, each against its alternatives, for bench/RESULTS.md.

    python bench/decode_parts.py

1. Matmuls: a chain of GPT-2 124M's 48 block matrices (340 MB, output-major [K, D]) in one jit, for a
   few rows: XLA's dot, the few-row multiply-and-sum (`gpt.model.few_rows.xla_few_rows`), the compiled
   few-rows kernel (`gpt.model.few_rows.kernel_product`, where built), and torch's
   `x @ W.T` on the same matrices. A step streams every weight once, so these set its floor. Then the
   same 48 in int8 with the LM head (124 MB, what an int8 step streams): XLA's quantize-multiply-rescale
   (`xla_int8_product`) against the kernel (`kernel_int8_product`), with the rate the kernel read them at.
2. Attention over an 8-row x 12-head cache of 1024 slots, all 12 layers (600 MB, more than the cache
   of a CPU, as in a real step): the paged read (`attend_paged`, pages of `PAGE_LENGTH` slots, each its
   own buffer) against the whole-cache read (`attend` under the mask).

Milliseconds, median of --repeats calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt.model.attention import attend, attend_paged
from gpt.model.backend import CHOICES
from gpt.model.cpu_kernels import isa as kernel_isa
from gpt.model.few_rows import kernel_int8_product, kernel_product, xla_few_rows, xla_int8_product
from gpt.model.layouts import Int8Matrix

PAGE_LENGTH = CHOICES["cpu"].kv_page_length  # an engine's pages on a CPU

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
    few_rows = chain(xla_few_rows)
    kernel = chain(kernel_product) if kernel_isa() else None
    print(f"| rows | XLA dot | few-row multiply-and-sum | few-rows kernel ({kernel_isa()}) | torch |")
    print("| --- | --- | --- | --- | --- |")
    for rows in rows_list:
        x_MD = jnp.ones((rows, D))

        def torch_chain():
            with torch.inference_mode():
                x = torch.ones((rows, D))
                for m in torch_matrices:
                    y = x @ m.T
                    x = y[:, :D].contiguous() if m.shape[0] == 3 * D else y

        times = [_median_ms(lambda f=f: f(matrices, x_MD).block_until_ready(), repeats) if f else float("nan")
                 for f in (dot, few_rows, kernel)]
        print(f"| {rows} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | {_median_ms(torch_chain, repeats):.1f} |",
              flush=True)


def int8_chain(rows_list, repeats: int) -> None:
    D = 768
    rng = np.random.default_rng(0)
    shapes = [(3 * D, D), (D, D), (4 * D, D), (D, 4 * D)] * 12 + [(50257, D)]
    matrices = [Int8Matrix.quantize(jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])))
                for shape in shapes]
    megabytes = sum(m.values_KD.size for m in matrices) / 1e6

    def chain(product):
        @jax.jit
        def run(matrices, x_MD):
            for m in matrices:
                y = product(x_MD, m.values_KD, m.scale_K)
                x_MD = y[:, :D] if m.values_KD.shape[0] == 3 * D else y  # as in the float32 chain
            return x_MD
        return run

    xla, kernel = chain(xla_int8_product), chain(kernel_int8_product) if kernel_isa() else None
    print(f"| rows | XLA | kernel ({kernel_isa()}) | kernel's read (GB/s) |")
    print("| --- | --- | --- | --- |")
    for rows in rows_list:
        x_MD = jnp.asarray(rng.standard_normal((rows, D), dtype=np.float32))
        times = [_median_ms(lambda f=f: f(matrices, x_MD).block_until_ready(), repeats) if f else float("nan")
                 for f in (xla, kernel)]
        print(f"| {rows} | {times[0]:.2f} | {times[1]:.2f} | {megabytes / times[1]:.1f} |", flush=True)


def attention(positions_list, repeats: int, layers: int = 12) -> None:
    B, N, S, H = 8, 12, 1024, 64
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H), dtype=np.float32))
    ks, vs = ([jnp.asarray(rng.standard_normal((B * N, S, H), dtype=np.float32)) for _ in range(layers)]
              for _ in range(2))
    paged = lambda x: tuple(x[:, start:start + PAGE_LENGTH] for start in range(0, S, PAGE_LENGTH))  # noqa: E731
    k_pages, v_pages = [paged(k) for k in ks], [paged(v) for v in vs]
    read_paged = jax.jit(lambda q, kp, vp, p: sum(attend_paged(q, k, v, p) for k, v in zip(kp, vp)))
    read_whole = jax.jit(lambda q, ks, vs, p: sum(attend(q, k, v, jnp.arange(S)[None, None, :] <= p[:, :, None])
                                                   for k, v in zip(ks, vs)))
    print("| furthest position | paged (ours) | whole |")
    print("| --- | --- | --- |")
    for position in positions_list:
        p = jnp.full((B, 1), position, jnp.int32)
        times = [_median_ms(lambda: read_paged(q, k_pages, v_pages, p).block_until_ready(), repeats),
                 _median_ms(lambda: read_whole(q, ks, vs, p).block_until_ready(), repeats)]
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
    print("\nMatmul chain, int8 (the 48 block matrices and the LM head), ms:\n")
    int8_chain(args.rows, args.repeats)
    print(f"\nDecode attention, 12 layers, 8 rows x 12 heads over 1024 slots (pages of {PAGE_LENGTH}), ms:\n")
    attention(args.positions, args.repeats)


if __name__ == "__main__":
    main()
