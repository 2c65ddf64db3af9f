"""Causal attention through Pallas' splash kernel (the TPU's row of `gpt.model.backend`), run in Pallas' TPU
interpreter on the CPU: forward and gradients equal the plain attention's, at GPT-2's head size (64, padded to
the kernel's 128 lanes) and an odd one, a local layer's band too, with and without a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.model import attention, backend, splash
from gpt.model.sharding import make_mesh

pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")


def _qkv(B, T, N, H, seed=0):
    return [jax.random.normal(jax.random.key(seed + i), (B, T, N, H), jnp.float32) for i in range(3)]


def _plain(q, k, v, window=None):
    B, T, N, H = q.shape
    rows = lambda x: x.transpose(0, 2, 1, 3).reshape(B * N, T, H)  # noqa: E731 (the cache's layout)
    return attention.attend(q, rows(k), rows(v), None, window)  # the CPU's row: the plain form, under its band


@pytest.mark.parametrize("H, window", [(64, None), pytest.param(48, None, marks=pytest.mark.slow),
                                       pytest.param(64, 100, marks=pytest.mark.slow)],
                         ids=["gpt2-heads", "odd-heads", "local-100"])  # GPT-2's head size, an odd one, a band
def test_splash_equals_plain_attention_forward_and_gradients(H, window):
    q, k, v = _qkv(2, 256, 3, H)
    cotangent = jax.random.normal(jax.random.key(9), q.shape)

    def loss(attend, q, k, v):
        return (attend(q, k, v) * cotangent).sum()

    kernel = lambda q, k, v: splash.splash_causal(q, k, v, window, interpret=True)  # noqa: E731
    plain = lambda q, k, v: _plain(q, k, v, window)  # noqa: E731
    np.testing.assert_allclose(kernel(q, k, v), plain(q, k, v), atol=2e-6, rtol=2e-6)
    for got, want in zip(jax.grad(loss, argnums=(1, 2, 3))(kernel, q, k, v),
                         jax.grad(loss, argnums=(1, 2, 3))(plain, q, k, v)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_splash_sees_only_earlier_positions():
    q, k, v = _qkv(1, 128, 2, 64)
    later = v.at[:, 100:].set(1e3)  # values after position 99 change; outputs up to 99 must not
    before, after = (splash.splash_causal(q, k, x, interpret=True) for x in (v, later))
    np.testing.assert_array_equal(before[:, :100], after[:, :100])
    assert not np.allclose(before[:, 100:], after[:, 100:])


def test_splash_over_a_mesh_runs_each_devices_rows_and_heads():
    mesh = make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    q, k, v = _qkv(4, 128, 4, 64)
    with jax.set_mesh(mesh):
        assert splash.splash_fits(4, 128, 4) and not splash.splash_fits(4, 128, 3)  # 3 heads over 2 devices
        out = jax.jit(lambda q, k, v: splash.splash_causal(q, k, v, interpret=True))(q, k, v)
    np.testing.assert_allclose(out, _plain(q, k, v), atol=2e-6, rtol=2e-6)


def test_the_tpu_row_takes_splash_where_it_fits_and_the_plain_form_elsewhere(monkeypatch):
    monkeypatch.setattr(attention, "choices", lambda: backend.CHOICES["tpu"])
    called = []
    monkeypatch.setattr(attention, "splash_causal", lambda q, k, v, window: called.append((q.shape, window)) or q)
    q, k, v = _qkv(1, 128, 2, 64)
    rows = lambda x: x.transpose(0, 2, 1, 3).reshape(2, 128, 64)  # noqa: E731
    attention.attend(q, rows(k), rows(v), None)
    attention.attend(q, rows(k), rows(v), None, 32)  # a local layer's band: the kernel's local mask
    attention.attend(q, rows(k), rows(v), None, jnp.int32(32))  # a traced one (a scan over kinds): a mask
    assert called == [((1, 128, 2, 64), None), ((1, 128, 2, 64), 32)]
    short = _qkv(1, 64, 2, 64)  # 64 positions: no block of the kernel's divides them
    attention.attend(short[0], *(x.transpose(0, 2, 1, 3).reshape(2, 64, 64) for x in short[1:]), None)
    attention.attend(q, rows(k), rows(v), jnp.ones((1, 128, 128), bool))  # a mask: the plain form
    assert len(called) == 2
