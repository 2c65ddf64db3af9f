"""The int8 x int8 -> int32 product of a decode step: the compiled kernel where it can run, XLA's dot elsewhere.

`int8_kernel.cc` is an XLA FFI custom call built by the package's install (an optional extension, so a
machine without a C++ compiler still installs; see setup.py). For 1-16 rows it reads each output's int8
weights once for all rows with AVX-512 VNNI or AVX2, picked at run time, over XLA's own CPU threads:
GPT-2 124M's int8 matrices in 4.3 ms a token on a 2-core AMD EPYC (Zen 4), where XLA's dot took 8.9 ms
for the two rows it needs (bench/RESULTS.md, "int8 decoding"). Both paths accumulate exactly in int32, so
their results are equal bit for bit.

The kernel runs when it was built, this CPU has AVX2, JAX's backend is the CPU and the environment's
`GPT_INT8_KERNEL` is not `0` (which keeps XLA's dot, to compare the two); `GPT_INT8_KERNEL=avx2` keeps it to
its AVX2 path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt.model.backend import choices

__all__ = ["MAX_KERNEL_ROWS", "kernel_isa", "limit_isa", "int8_product", "kernel_product", "xla_product"]

MAX_KERNEL_ROWS = 16  # more rows (a prefill) make a GEMM, which XLA's dot runs well
_TARGET = "gpt_int8_matmul"
_ISA_NAMES = {0: None, 1: "avx2", 2: "avx512_vnni"}
_ISA_LEVELS = {"avx2": 1, "avx512_vnni": 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, registered with XLA (once), or None where it was not built or cannot run here."""
    setting = os.environ.get("GPT_INT8_KERNEL", "")
    built = sorted(Path(__file__).parent.glob("_int8_kernel*.so"))
    if setting == "0" or not built:
        return None
    library = ctypes.CDLL(str(built[0]))
    if library.Int8MatmulLimitIsa(_ISA_LEVELS.get(setting, 2)) == 0:
        return None
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.Int8Matmul), platform="cpu")
    return library


def kernel_isa() -> str | None:
    """The kernel's instruction set on this machine ("avx512_vnni" or "avx2"), or None where it does not run
    (not built, a CPU without AVX2, a backend other than the CPU, or GPT_INT8_KERNEL=0)."""
    library = _library() if choices().int8_kernel else None
    return _ISA_NAMES[library.Int8MatmulIsa()] if library is not None else None


def limit_isa(isa: str) -> str | None:
    """Keeps the kernel to `isa` ("avx2" or "avx512_vnni") or below from the next trace on (a CPU with both
    runs either; the tests run each); the instruction set now in use, or None where the kernel does not run."""
    library = _library()
    if library is None:
        return None
    return _ISA_NAMES[library.Int8MatmulLimitIsa(_ISA_LEVELS[isa])]


def kernel_product(x_MD: jax.Array, values_KD: jax.Array) -> jax.Array:
    """x [M, D] int8 times values [K, D] int8, contracting D, in the compiled kernel: [M, K] int32.
    1 <= M <= 16; only where `kernel_isa()` is not None."""
    M, K = x_MD.shape[0], values_KD.shape[0]
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((M, K), jnp.int32))(x_MD, values_KD)


def xla_product(x_MD: jax.Array, values_KD: jax.Array) -> jax.Array:
    """The same product through XLA's dot: [M, K] int32. Its CPU int8 dot falls off its fast path for one row
    (GPT-2's block matrices: 113 ms against float32's 10.6 ms; at two rows, 7.2 ms), so one row runs as two
    (the second all zeros)."""
    M = x_MD.shape[0]
    x_MD = jnp.concatenate([x_MD, jnp.zeros_like(x_MD)]) if M == 1 else x_MD
    y_MK = jax.lax.dot_general(x_MD, values_KD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return y_MK[:M]


def int8_product(x_MD: jax.Array, values_KD: jax.Array) -> jax.Array:
    """x [M, D] int8 times values [K, D] int8 contracting D: [M, K] int32, exact; by the kernel for 1-16 rows
    where it runs, by XLA's dot otherwise."""
    if x_MD.shape[0] <= MAX_KERNEL_ROWS and kernel_isa() is not None:
        return kernel_product(x_MD, values_KD)
    return xla_product(x_MD, values_KD)
