"""Weight layouts: every row count runs the product it stands for, on whichever path XLA runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the few-rows product is XLA's CPU path")
def test_a_decode_steps_few_rows_run_without_a_gemm():
    # The reason the few-rows path exists: 2 to 16 rows run as a fused multiply and sum, not a dot
    # (XLA's CPU GEMM was ~1.6x slower at 8 rows on an AMD EPYC); 1 row and many rows stay dots.
    matrix = OutputMajor(jnp.ones((300, 96), jnp.float32))

    def has_dot(rows):
        text = jax.jit(matrix.matmul).lower(jnp.ones((rows, 96), jnp.float32)).compile().as_text()
        return " dot(" in text

    assert [has_dot(rows) for rows in (1, 2, 8, 16, 17)] == [True, False, False, False, True]
