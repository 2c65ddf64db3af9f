"""The package's one compiled part: the decode step's few-row matmul kernels (gpt/model/few_rows.cc), XLA FFI custom
calls.

Everything else is in pyproject.toml. The kernels are optional: where they cannot be compiled (no C++ compiler)
the install goes on without them and decoding uses XLA's dots (`gpt.model.few_rows`). They are compiled
for plain x86-64; the AVX-512 and AVX2 paths are picked when they run. XLA's FFI headers come from
jaxlib (a build requirement in pyproject.toml).
"""

import importlib.util
import platform
from pathlib import Path

from setuptools import Extension, setup


def _few_rows_kernels() -> list[Extension]:
    jaxlib = importlib.util.find_spec("jaxlib")
    if platform.machine().lower() not in ("x86_64", "amd64") or jaxlib is None:
        return []
    include = Path(jaxlib.submodule_search_locations[0]) / "include"
    return [Extension("gpt.model._few_rows", ["gpt/model/few_rows.cc"], include_dirs=[str(include)],
                      language="c++", extra_compile_args=["-O3", "-std=c++17"], optional=True)]


setup(ext_modules=_few_rows_kernels())
