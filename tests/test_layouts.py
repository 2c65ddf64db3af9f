"""Weight layouts: every row count runs the product it stands for, on whichever path XLA runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.model import cpu_kernels
from gpt.model.layouts import OutputMajor


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 40])
def test_output_major_matmul_equals_the_float64_product(rows):
    rng = np.random.default_rng(rows)
    matrix_KD = rng.standard_normal((300, 96)).astype(np.float32)
    x_MD = rng.standard_normal((rows, 96)).astype(np.float32)
    got = np.asarray(jax.jit(OutputMajor(jnp.asarray(matrix_KD)).matmul)(jnp.asarray(x_MD)))
    want = x_MD.astype(np.float64) @ matrix_KD.astype(np.float64).T
    # float32 sums of 96 products of unit normals: |error| ~ 1e-6 * |terms|, far below 1e-4.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the few-rows paths are the CPU's")
@pytest.mark.parametrize("kernels", [True, False])
def test_a_decode_steps_few_rows_run_without_a_gemm(monkeypatch, kernels):
    # The reason the few-rows paths exist: 1 to 16 rows go through the compiled kernel where it is built,
    # else 2 to 16 through a fused multiply and sum, not XLA's GEMM (~1.6x slower at 8 rows on an AMD
    # EPYC); more rows stay dots.
    if kernels and cpu_kernels.isa() is None:
        pytest.skip("the few-rows kernels are not built here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "isa", lambda: None)
    matrix = OutputMajor(jnp.ones((300, 96), jnp.float32))

    def path(rows):
        text = jax.jit(matrix.matmul).lower(jnp.ones((rows, 96), jnp.float32)).compile().as_text()
        return "kernel" if "gpt_few_rows_float32" in text else "dot" if " dot(" in text else "multiply-sum"

    expected = (["kernel"] * 4 if kernels else ["dot", "multiply-sum", "multiply-sum", "multiply-sum"]) + ["dot"]
    assert [path(rows) for rows in (1, 2, 8, 16, 17)] == expected
