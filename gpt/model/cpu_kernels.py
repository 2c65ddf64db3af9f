"""The compiled CPU decoding kernels (gpt/model/kernels/): loaded, registered with XLA, and which instruction set
they run.

XLA FFI custom calls for a decode step: the matmuls of its few rows, int8, int4 and float32 (`gpt.model.few_rows`),
int4, and its attention over the paged KV cache (`gpt.model.attention.attend_paged`). They are built by the
package's install as an optional extension (setup.py): a machine without a C++ compiler installs without
them, and every op is XLA's. They run when they were built, the CPU has AVX2 and FMA, JAX's backend is the
CPU (the backend table's `cpu_kernels`), no mesh of several devices is active where the program is traced
(XLA partitions its own ops over one; a custom call would have its operands gathered whole onto every
device), and the environment's `GPT_CPU_KERNELS` is not `0` (which keeps XLA's ops, to compare the two);
`GPT_CPU_KERNELS=avx2` keeps them to their AVX2 paths.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax

from gpt.model.backend import choices

__all__ = ["isa", "limit_isa", "call", "TARGETS"]

# The library's handler symbol of each FFI target.
TARGETS = {"gpt_few_rows_int8": "FewRowsInt8", "gpt_few_rows_int4": "FewRowsInt4", "gpt_few_rows_float32": "FewRowsFloat32",
           "gpt_decode_attention": "DecodeAttention"}
_ISA_NAMES = {0: None, 1: "avx2", 2: "avx512_vnni"}
_ISA_LEVELS = {"avx2": 1, "avx512_vnni": 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, registered with XLA (once), or None where they were not built or cannot run here."""
    setting = os.environ.get("GPT_CPU_KERNELS", "")
    built = sorted(Path(__file__).parent.glob("_cpu_kernels*.so"))
    if setting == "0" or not built:
        return None
    library = ctypes.CDLL(str(built[0]))
    if library.CpuKernelsLimitIsa(_ISA_LEVELS.get(setting, 2)) == 0:
        return None
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


def _several_devices() -> bool:
    """Whether the mesh active where this is traced (`jax.set_mesh`) has more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def isa() -> str | None:
    """The kernels' instruction set here ("avx512_vnni" or "avx2"), or None where they do not run (not built, a
    CPU without AVX2, a backend other than the CPU, a mesh of several devices active, or GPT_CPU_KERNELS=0)."""
    library = _library() if choices().cpu_kernels and not _several_devices() else None
    return _ISA_NAMES[library.CpuKernelsIsa()] if library is not None else None


def limit_isa(name: str) -> str | None:
    """Keeps the kernels to `name` ("avx2" or "avx512_vnni") or below from the next call on (a CPU with both runs
    either; the tests run each); the instruction set now in use, or None where the kernels do not run."""
    library = _library()
    return _ISA_NAMES[library.CpuKernelsLimitIsa(_ISA_LEVELS[name])] if library is not None else None


def call(target: str, result: jax.ShapeDtypeStruct):
    """`jax.ffi.ffi_call` of one of the kernels (`TARGETS`), registered first; only where `isa()` is not None."""
    if _library() is None:
        raise RuntimeError(f"the CPU kernels are not built or are turned off here, so {target} cannot run")
    return jax.ffi.ffi_call(target, result)
