"""The matmuls of a decode step's few rows: compiled CPU kernels where they can run, XLA's dots elsewhere.

A decode step multiplies 1-16 rows by every weight matrix once, so its speed is the speed at which the
weights are read. XLA's CPU dots fall short of that for so few rows: its int8 dot reads at half the
memory's speed, and its float32 GEMM for 2-16 rows is far from it. `few_rows.cc` holds two XLA FFI
custom calls, int8 x int8 -> int32 (exact) and float32, that read each output's weights once for all rows
with AVX-512 (VNNI for int8) or AVX2, picked at run time, over XLA's own CPU threads. They are built by
the package's install as an optional extension (setup.py): a machine without a C++ compiler installs
without them. Figures: bench/RESULTS.md, "CPU decoding".

The kernels run when they were built, the CPU has AVX2 and FMA, JAX's backend is the CPU, and the
environment's `GPT_FEW_ROWS_KERNELS` is not `0` (which keeps XLA's dots, to compare the two);
`GPT_FEW_ROWS_KERNELS=avx2` keeps them to their AVX2 paths. Elsewhere every product is XLA's: for 2-16
float32 rows on a CPU a multiply and a sum (`xla_few_rows`), otherwise a dot.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt.model.backend import choices

__all__ = ["MAX_KERNEL_ROWS", "kernel_isa", "limit_isa", "product", "kernel_product", "xla_product", "xla_few_rows",
           "at_least_two_rows"]

MAX_KERNEL_ROWS = 16  # more rows (a prefill) make a GEMM, which XLA's dot runs well
# The kernels' inputs' dtype -> (the FFI target, the result's dtype).
_KERNELS = {jnp.dtype(jnp.int8): ("gpt_few_rows_int8", jnp.int32),
            jnp.dtype(jnp.float32): ("gpt_few_rows_float32", jnp.float32)}
_ISA_NAMES = {0: None, 1: "avx2", 2: "avx512_vnni"}
_ISA_LEVELS = {"avx2": 1, "avx512_vnni": 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, registered with XLA (once), or None where they were not built or cannot run here."""
    setting = os.environ.get("GPT_FEW_ROWS_KERNELS", "")
    built = sorted(Path(__file__).parent.glob("_few_rows*.so"))
    if setting == "0" or not built:
        return None
    library = ctypes.CDLL(str(built[0]))
    if library.FewRowsLimitIsa(_ISA_LEVELS.get(setting, 2)) == 0:
        return None
    for symbol, (target, _) in zip(("FewRowsInt8", "FewRowsFloat32"), _KERNELS.values()):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


def kernel_isa() -> str | None:
    """The kernels' instruction set here ("avx512_vnni" or "avx2"), or None where they do not run (not built, a
    CPU without AVX2, a backend other than the CPU, or GPT_FEW_ROWS_KERNELS=0)."""
    library = _library() if choices().few_rows_kernels else None
    return _ISA_NAMES[library.FewRowsIsa()] if library is not None else None


def limit_isa(isa: str) -> str | None:
    """Keeps the kernels to `isa` ("avx2" or "avx512_vnni") or below from the next call on (a CPU with both runs
    either; the tests run each); the instruction set now in use, or None where the kernels do not run."""
    library = _library()
    return _ISA_NAMES[library.FewRowsLimitIsa(_ISA_LEVELS[isa])] if library is not None else None


def kernel_product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """x [M, D] times matrix [K, D] contracting D, in the compiled kernel: [M, K], int32 for int8 operands
    (exact), float32 for float32 ones. 1 <= M <= 16; only where `kernel_isa()` is not None."""
    target, result = _KERNELS[x_MD.dtype]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x_MD.shape[0], matrix_KD.shape[0]), result))(x_MD, matrix_KD)


def xla_few_rows(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """x [M, D] times matrix [K, D] contracting D, for small M: one elementwise multiply and a sum over D,
    which XLA fuses into one loop that reads each output's weights once for all M rows: [M, K]."""
    return (matrix_KD[:, None, :] * x_MD[None, :, :]).sum(axis=-1).T


# XLA's CPU dot runs 1 float32 row as a matrix-vector product at the memory's speed, but 2 to 16 rows as a
# GEMM far from it: on a 2-core AMD EPYC (Zen 4) a chain of GPT-2's block matrices (340 MB in float32) took
# 12.3 ms for 1 row and 34.1 ms for 8, where `xla_few_rows` took 21.3 ms (`bench/decode_parts.py`). From
# 64 rows the GEMM wins again.
_XLA_FEW_ROWS = range(2, 17)


def at_least_two_rows(x_MD: jax.Array) -> jax.Array:
    """XLA's CPU dot for int8 or bfloat16 operands falls off its fast path for a single row (GPT-2's block
    matrices in int8: 113 ms against 7.2 at two rows), so one row runs as two (the second all zeros)."""
    return jnp.concatenate([x_MD, jnp.zeros_like(x_MD)]) if x_MD.shape[0] == 1 else x_MD


def xla_product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """The same product through XLA: [M, K], int32 for int8 operands (exact), else x's dtype."""
    M = x_MD.shape[0]
    if x_MD.dtype == jnp.int8:
        return jax.lax.dot_general(at_least_two_rows(x_MD), matrix_KD, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)[:M]
    if M in _XLA_FEW_ROWS and x_MD.dtype == jnp.float32 and choices().few_rows_matmul:
        return xla_few_rows(x_MD, matrix_KD)
    return jax.lax.dot_general(x_MD, matrix_KD, (((1,), (1,)), ((), ())))


def product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """x [M, D] times an output-major matrix [K, D] of x's dtype, contracting D: [M, K] (int32 for int8
    operands, exact); by a kernel for 1-16 int8 or float32 rows where they run, by XLA otherwise."""
    if x_MD.shape[0] <= MAX_KERNEL_ROWS and x_MD.dtype in _KERNELS and kernel_isa() is not None:
        return kernel_product(x_MD, matrix_KD)
    return xla_product(x_MD, matrix_KD)
