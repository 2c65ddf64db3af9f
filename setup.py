"""The package's one compiled part: the CPU decoding kernels (gpt/model/kernels/), XLA FFI custom calls for a decode
step's few-row matmuls and its attention.

Everything else is in pyproject.toml. The kernels are optional: where they cannot be compiled (no C++ compiler)
the install goes on without them and decoding uses XLA's ops (`gpt.model.cpu_kernels`). They are compiled
for plain x86-64; the AVX-512 and AVX2 paths are picked when they run. XLA's FFI headers come from
jaxlib (a build requirement in pyproject.toml).
"""

import importlib.util
import platform
from pathlib import Path

from setuptools import Extension, setup

KERNELS = Path("gpt/model/kernels")


def _cpu_kernels() -> list[Extension]:
    jaxlib = importlib.util.find_spec("jaxlib")
    if platform.machine().lower() not in ("x86_64", "amd64") or jaxlib is None:
        return []
    include = Path(jaxlib.submodule_search_locations[0]) / "include"
    sources = [str(KERNELS / name) for name in ("runtime.cc", "few_rows.cc", "few_rows_int4.cc", "decode_attention.cc")]
    headers = [str(KERNELS / name) for name in ("runtime.h", "float_lanes.h", "attend_rows.inc")]
    return [Extension("gpt.model._cpu_kernels", sources, depends=headers, include_dirs=[str(include), str(KERNELS)],
                      language="c++", extra_compile_args=["-O3", "-std=c++17"], optional=True)]


setup(ext_modules=_cpu_kernels())
