"""FP8 training products (`gpt.model.fp8`, `GPTConfig.fp8`): the scaling and rounding against numpy's float8
types (ml_dtypes) in float64, the products and their gradients, the LM head's loss, and the flag."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from gpt.cli import parse_train_config
from gpt.model.config import GPTConfig
from gpt.model.fp8 import E4M3, E5M2, fp8_matmul, quantize_dequantize
from gpt.model.kv_cache import KVCache
from gpt.model.loss import lm_head_cross_entropy
from gpt.model.transformer import GPT

FORMATS = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def reference(x: np.ndarray, fp8) -> np.ndarray:
    """x rounded to the FP8 format under the power-of-two scale that fits its largest magnitude, in float64."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max()
    if amax == 0:
        return x
    largest = float(ml_dtypes.finfo(FORMATS[fp8]).max)
    scale = 2.0 ** np.ceil(np.log2(amax / largest))
    return np.clip(x / scale, -largest, largest).astype(FORMATS[fp8]).astype(np.float64) * scale


def spread(key, shape, decades=6):
    """Random values whose magnitudes span `decades` powers of ten, of both signs."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * 10.0 ** jax.random.uniform(k2, shape, minval=-decades / 2,
                                                                      maxval=decades / 2)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("amax", [1e-6, 0.37, 448.0, 3e4, 7e8])
def test_rounding_equals_numpys_float8_under_a_power_of_two_scale(fp8, amax):
    x = spread(jax.random.key(0), (64, 48))
    x = x / jnp.abs(x).max() * amax
    got = np.asarray(quantize_dequantize(x, fp8), np.float64)
    np.testing.assert_array_equal(got, reference(x, fp8))
    # The scale is a power of two: bfloat16 holds each rounded value exactly, so its rounding is the same.
    np.testing.assert_array_equal(np.asarray(quantize_dequantize(x.astype(jnp.bfloat16), fp8), np.float64),
                                  reference(np.asarray(x.astype(jnp.bfloat16), np.float64), fp8))


@pytest.mark.parametrize("fp8, mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_the_largest_value_fits_and_normal_values_keep_their_mantissa_bits(fp8, mantissa_bits):
    x = spread(jax.random.key(1), (4096,), decades=2)
    got = np.asarray(quantize_dequantize(x, fp8), np.float64)
    x = np.asarray(x, np.float64)
    assert np.isfinite(got).all() and np.abs(got).max() <= np.abs(x).max() * (1 + 2.0 ** -mantissa_bits)
    info = ml_dtypes.finfo(FORMATS[fp8])
    scale = 2.0 ** np.ceil(np.log2(np.abs(x).max() / float(info.max)))
    normal = np.abs(x) >= float(info.smallest_normal) * scale
    assert normal.mean() > 0.9
    relative = np.abs(got - x)[normal] / np.abs(x)[normal]
    assert relative.max() <= 2.0 ** -(mantissa_bits + 1)  # round to nearest: half a unit in the last place


def test_zeros_stay_zeros():
    assert not np.asarray(quantize_dequantize(jnp.zeros((3, 5)), E4M3)).any()


def test_the_product_and_its_gradients_are_the_rounded_operands_products():
    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x, w, dy = jax.random.normal(kx, (32, 48)), 0.02 * jax.random.normal(kw, (48, 40)), jax.random.normal(kg, (32, 40))
    y, vjp = jax.vjp(fp8_matmul, x, w)
    dx, dw = vjp(dy)
    x8, w8, dy8 = reference(x, E4M3), reference(w, E4M3), reference(dy, E5M2)
    np.testing.assert_allclose(np.asarray(y), x8 @ w8, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), dy8 @ w8.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), x8.T @ dy8, rtol=1e-5, atol=1e-6)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert 1e-3 < np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact) < 0.1  # rounded, not lost


def test_the_lm_heads_loss_in_fp8_is_the_rounded_operands_cross_entropy():
    B, T, D, V = 2, 8, 32, 96
    kx, kt, ky = jax.random.split(jax.random.key(3), 3)
    x, table = jax.random.normal(kx, (B, T, D)), 0.1 * jax.random.normal(kt, (V, D))
    targets = jax.random.randint(ky, (B, T), 0, V)
    loss, (dx, dtable) = jax.value_and_grad(lm_head_cross_entropy, argnums=(0, 1))(x, table, targets, fp8=True)

    x8, t8 = reference(x, E4M3).reshape(B * T, D), reference(table, E4M3)
    logits = x8 @ t8.T
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    one_hot = np.eye(V)[np.asarray(targets).reshape(-1)]
    np.testing.assert_allclose(float(loss), -(log_probs * one_hot).sum() / (B * T), rtol=1e-6)
    dlogits = reference(np.exp(log_probs) - one_hot, E5M2)  # one chunk: one scale for the whole gradient
    np.testing.assert_allclose(np.asarray(dx).reshape(B * T, D), dlogits @ t8 / (B * T), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dtable), dlogits.T @ x8 / (B * T), rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # FP8 is a GPU lever, off by default: a training run of it (its products are checked quickly)
def test_an_fp8_model_trains_its_mlp_and_head_in_fp8_and_decodes_as_before():
    config = GPTConfig.preset("tiny")
    tokens = jax.random.randint(jax.random.key(4), (2, 33), 0, config.vocab_size)
    model, fp8_model = GPT(config, rngs=nnx.Rngs(0)), GPT(config.replace(fp8=True), rngs=nnx.Rngs(0))

    def loss_and_grads(model):
        graphdef, state = nnx.split(model)
        return jax.value_and_grad(lambda s: nnx.merge(graphdef, s).loss(tokens[:, :-1], tokens[:, 1:]))(state)

    (loss, grads), (fp8_loss, fp8_grads) = loss_and_grads(model), loss_and_grads(fp8_model)
    assert fp8_loss != loss and abs(float(fp8_loss) - float(loss)) < 0.01 * float(loss)
    for name in ("fc_kernel", "proj_kernel", "q_kernel", "kv_kernel"):
        got, want = (np.asarray(g["blocks"][name][...]) for g in (fp8_grads, grads))
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        # The MLP's gradients pass through FP8 products; q, k and v's through the MLP's input gradient.
        assert (0 < error < 0.2) if name not in ("q_kernel", "kv_kernel") else error < 0.2, (name, error)
    # With a cache (decoding) the products are the compute dtype's, as without fp8.
    want, _ = model(tokens[:, :8], cache=KVCache.init(config, 2, 16))
    got, _ = fp8_model(tokens[:, :8], cache=KVCache.init(fp8_model.config, 2, 16))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_fp8_flag():
    assert parse_train_config(["--fp8"]).model.fp8
    assert parse_train_config(["--model.fp8"]).model.fp8
    assert not parse_train_config([]).model.fp8
