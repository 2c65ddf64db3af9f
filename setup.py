"""The package's one compiled part: the int8 decoding kernel (gpt/model/int8_kernel.cc), an XLA FFI custom call.

Everything else is in pyproject.toml. The kernel is optional: where it cannot be compiled (no C++ compiler)
the install goes on without it and int8 decoding uses XLA's dot (`gpt.model.int8_kernel`). It is compiled
for plain x86-64; the AVX-512 VNNI and AVX2 paths are picked when it runs. XLA's FFI headers come from
jaxlib (a build requirement in pyproject.toml).
"""

import importlib.util
import platform
from pathlib import Path

from setuptools import Extension, setup


def _int8_kernel() -> list[Extension]:
    jaxlib = importlib.util.find_spec("jaxlib")
    if platform.machine().lower() not in ("x86_64", "amd64") or jaxlib is None:
        return []
    include = Path(jaxlib.submodule_search_locations[0]) / "include"
    return [Extension("gpt.model._int8_kernel", ["gpt/model/int8_kernel.cc"], include_dirs=[str(include)],
                      language="c++", extra_compile_args=["-O3", "-std=c++17"], optional=True)]


setup(ext_modules=_int8_kernel())
