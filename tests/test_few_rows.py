"""The decode step's few-rows kernels (`gpt.model.few_rows`), on each instruction set, for every row count they
take and odd shapes: int8 exactly the integer product and XLA's quantized product, and within the
quantization bound of the float64 product; float32 within float32's rounding of the float64 product. XLA's paths where they do not run, and
an install that goes on without a C++ compiler."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.inference.decoder import decoding_weights
from gpt.model import cpu_kernels
from gpt.model.few_rows import MAX_KERNEL_ROWS, kernel_int8_product, kernel_product, xla_int8_product
from gpt.model.layouts import Int8Matrix
from gpt.model.transformer import forward, lm_head

from bounds import bound
from conftest import KERNEL_ISAS, some_quick

REPO = Path(__file__).resolve().parents[1]


def test_the_kernels_are_built_and_run_where_they_can():
    # An x86-64 CPU with AVX2 and a C++ compiler at install: the kernels must be there (else every test of
    # them below would skip and hide a broken build).
    if platform.machine() != "x86_64" or not KERNEL_ISAS or shutil.which("c++") is None:
        pytest.skip("no x86-64 CPU with AVX2, or no C++ compiler")
    assert cpu_kernels.isa() == KERNEL_ISAS[-1]


SHAPES = [(37, 100), (5, 64), (130, 1), (64, 200), (2304, 768), (768, 3079)]
# The quick tier's: a width the kernel's vectors do not divide, one column, GPT-2's attention projection.
QUICK_SHAPES = [(37, 100), (130, 1), (2304, 768)]


@pytest.mark.parametrize("K, D", SHAPES)
def test_int8_sums_are_the_exact_integer_products(kernel_isa, K, D):
    # Rows of integers whose largest magnitude is 127 quantize to themselves (scale 1), and scales of 1 leave
    # the exact int32 sums, as float32: exactly the int64 product rounded to float32, every row count.
    rng = np.random.default_rng(K * D)
    x = rng.integers(-127, 128, (MAX_KERNEL_ROWS, D)).astype(np.float32)
    x[:, 0] = np.where(np.arange(MAX_KERNEL_ROWS) % 2, 127, -127)
    w = rng.integers(-127, 128, (K, D), dtype=np.int8)
    w[0] = 127  # the largest products (AVX2's 16-bit pairs: 2 * 127 * 127 must not saturate)
    x[0], x[1] = 127, -127
    kernel = jax.jit(kernel_int8_product)
    for M in range(1, MAX_KERNEL_ROWS + 1):
        exact = (x[:M].astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
        got = np.asarray(kernel(x[:M], w, np.ones(K, np.float32)))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, exact, err_msg=f"{kernel_isa}, {M} rows")


@pytest.mark.parametrize("K, D", some_quick(SHAPES, quick=QUICK_SHAPES))
def test_int8_equals_xlas_quantized_product_exactly(kernel_isa, K, D):
    # Float rows quantized, multiplied and scaled as XLA does it (`xla_int8_product`): the same floats.
    rng = np.random.default_rng(K + D)
    x = rng.standard_normal((MAX_KERNEL_ROWS, D)).astype(np.float32)
    x[3] = 0  # a row of zeros: its scale is 1, its products 0
    x[4, 0] = 2.5 * np.abs(x[4]).max() / 127  # a value halfway between two steps: rounded to even
    matrix = Int8Matrix.quantize(jnp.asarray(rng.normal(0, 0.02, (K, D)), jnp.float32))
    kernel, xla = jax.jit(kernel_int8_product), jax.jit(xla_int8_product)
    for M in range(1, MAX_KERNEL_ROWS + 1):
        got = np.asarray(kernel(x[:M], matrix.values_KD, matrix.scale_K))
        np.testing.assert_array_equal(got, np.asarray(xla(x[:M], matrix.values_KD, matrix.scale_K)),
                                      err_msg=f"{kernel_isa}, {M} rows")


@pytest.mark.parametrize("K, D", some_quick(SHAPES, quick=QUICK_SHAPES))
def test_float32_is_the_float64_product_within_rounding(kernel_isa, K, D):
    rng = np.random.default_rng(K + D)
    x = rng.standard_normal((MAX_KERNEL_ROWS, D)).astype(np.float32)
    w = rng.standard_normal((K, D)).astype(np.float32)
    kernel = jax.jit(kernel_product)
    for M in range(1, MAX_KERNEL_ROWS + 1):
        exact = x[:M].astype(np.float64) @ w.astype(np.float64).T
        got = np.asarray(kernel(x[:M], w))
        assert got.dtype == np.float32
        # float32 sums of D products of unit normals: each rounding ~6e-8 of a partial sum of size ~sqrt(D)
        bound = 1e-6 * np.sqrt(D) * np.log2(2 * D)
        np.testing.assert_allclose(got, exact, rtol=0, atol=bound, err_msg=f"{kernel_isa}, {M} rows")


def test_quantized_rows_stay_within_the_bound_of_the_float64_product(kernel_isa):
    # Per-row int8 activations and per-output int8 weights, each rounded to 1/254 of its range: the
    # product's relative error stays near 1% for Gaussian rows (test_quantize's bound for one matrix, x2).
    rng = np.random.default_rng(1)
    matrix = rng.normal(0, 0.02, (2304, 768))
    quantized = Int8Matrix.quantize(jnp.asarray(matrix, jnp.float32))
    for M in (1, 5, 16):
        x = rng.normal(size=(M, 768))
        exact = x @ matrix.T
        got = np.asarray(jax.jit(quantized.matmul)(jnp.asarray(x, jnp.float32)), np.float64)
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.02, (kernel_isa, M)


def _int8_logits(model, weights):
    tokens = jnp.asarray([list(range(1, 17))] * 2, jnp.int32)  # 32 rows: XLA's dot; 2 rows: the kernel's
    hidden = forward(model.config, weights, tokens, jnp.arange(16)[None])[0]
    return lm_head(weights, hidden[:, -1:])


def test_without_the_kernels_int8_logits_are_the_same(monkeypatch):
    # With the kernels off (not built, another backend, GPT_CPU_KERNELS=0) every product is XLA's:
    # exactly the same integers, so exactly the same logits.
    model = GPT(GPTConfig.preset("tiny", n_embd=64), rngs=nnx.Rngs(0))
    weights = decoding_weights(model, "int8")
    # Each traced afresh: the path is chosen when a function is traced, and jit would reuse the first trace.
    logits = lambda: np.asarray(jax.jit(lambda weights: _int8_logits(model, weights))(weights))  # noqa: E731
    with_kernel = logits()
    monkeypatch.setattr(cpu_kernels, "isa", lambda: None)
    fallback = logits()
    np.testing.assert_array_equal(with_kernel, fallback)


@pytest.mark.slow
def test_it_installs_and_runs_without_a_compiler(tmp_path):
    # The package copied and installed with the C++ compiler replaced by `false`: the install succeeds
    # without the kernels, and products go through XLA's dots.
    source = tmp_path / "source"
    shutil.copytree(REPO / "gpt", source / "gpt", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    env = {**os.environ, "CC": "false", "CXX": "false"}
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                              "--no-index", "--target", str(tmp_path / "site"), str(source)],
                             env=env, capture_output=True, text=True, timeout=bound(300))
    assert install.returncode == 0, install.stderr
    installed = tmp_path / "site" / "gpt" / "model"
    assert (installed / "few_rows.py").exists() and not list(installed.glob("_cpu_kernels*"))
    check = ("import jax.numpy as jnp, numpy as np\n"
             "from gpt.model.cpu_kernels import isa\n"
             "from gpt.model.few_rows import product\n"
             "x = jnp.asarray(np.arange(-6, 6, dtype=np.int8).reshape(2, 6))\n"
             "print(isa(), product(x, x).tolist())\n")
    ran = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                         cwd=tmp_path, capture_output=True, text=True, timeout=bound(120))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["None", "[[91,", "-35],", "[-35,", "55]]"]
