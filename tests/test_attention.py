"""Paged decode attention, XLA's and the compiled CPU kernel's (on each instruction set), against plain
attention under the mask and against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.model import attention, cpu_kernels
from gpt.model.attention import MAX_KERNEL_HEAD_DIM, attend, attend_paged

from conftest import some_quick


def traced_afresh(fn):
    """`jax.jit(fn)` traced anew: the path is chosen when a function is traced, and jit would reuse the trace
    of the same function made on another path."""
    return jax.jit(lambda *args: fn(*args))


def _pages(x, page_length):
    return tuple(x[:, start:start + page_length] for start in range(0, x.shape[1], page_length))


# Key heads K: one per query head, one for all three. The quick tier: one page; the furthest row within page 0
# of several; within the last of three; 25 pages, the last 8 slots long.
@pytest.mark.parametrize("page_length, furthest, K", some_quick(
    [(p, f, K) for p in (320, 128, 48, 13) for f in (39, 150, 319) for K in (3, 1)],
    quick=[(320, 150, 3), (48, 39, 1), (128, 319, 3), (13, 319, 1)]))
def test_paged_decode_attention_equals_masked_attention(attention_path, page_length, furthest, K):
    # attend_paged reads page 0 and every page that the furthest row has reached (one page: the whole
    # cache under the mask; 13: 25 pages, the last 8 slots long); either way it must equal plain attention
    # under the mask "slots 0..position", whatever the cache holds beyond each row's position.
    rng = np.random.default_rng(0)
    B, N, S, H = 4, 3, 320, 8
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B * K, S, H)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0], [17], [furthest], [31]], jnp.int32)
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
    got = traced_afresh(attend_paged)(q, _pages(k, page_length), _pages(v, page_length), positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attend(q, k, v, mask)), atol=1e-5, rtol=0)


# Query heads N, key heads K; the quick tier: each head size once, each grouping at least once.
@pytest.mark.parametrize("H, N, K", some_quick(
    [(H, N, K) for H in (1, 20, 64, MAX_KERNEL_HEAD_DIM) for N, K in ((2, 2), (4, 1), (6, 2))],
    quick=[(1, 2, 2), (20, 4, 1), (64, 6, 2), (MAX_KERNEL_HEAD_DIM, 4, 1)]))
def test_a_view_of_some_rows_is_the_float64_attention(attention_path, H, N, K):
    # A view (an engine's decode over some of its slots): query row b's head n reads cache row
    # rows[b] * K + n // (N / K), each of its slots 0..position, every head size the kernel takes (a last vector
    # of 1..16 lanes).
    rng = np.random.default_rng(H)
    B, R, S = 3, 5, 100
    q = rng.normal(size=(B, 1, N, H))
    k, v = (rng.normal(size=(R * K, S, H)) for _ in range(2))
    positions = np.asarray([[99], [0], [57]])
    rows = np.asarray([4, 0, 2])
    rows_M = (rows[:, None] * K + np.arange(K)).reshape(-1)
    as32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = traced_afresh(attend_paged)(as32(q), _pages(as32(k), 32), _pages(as32(v), 32), jnp.asarray(positions, jnp.int32),
                                jnp.asarray(rows_M, jnp.int32))
    want = np.zeros((B, 1, N, H))
    for b in range(B):
        for n in range(N):
            seen = positions[b, 0] + 1
            row = rows[b] * K + n // (N // K)
            scores = k[row, :seen] @ q[b, 0, n] / np.sqrt(H)
            weights = np.exp(scores - scores.max())
            want[b, 0, n] = weights @ v[row, :seen] / weights.sum()
    # float32 scores of H products and a softmax over <= 100 slots: each within ~1e-6 of the float64 one
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.sqrt(H), rtol=0)


def _runs_kernel(B, H, dtype=jnp.float32) -> bool:
    """Whether attend_paged over a two-page cache, traced here, calls the kernel."""
    q, page = jnp.ones((B, 1, 2, H), dtype), jnp.ones((2 * B, 16, H), dtype)
    jaxpr = jax.make_jaxpr(attention.attend_paged)(q, (page, page), (page, page), jnp.zeros((B, 1), jnp.int32))
    return "ffi_call" in str(jaxpr)


def test_the_kernel_runs_where_it_can_and_xla_beyond():
    # float32 heads up to MAX_KERNEL_HEAD_DIM on a CPU with the kernels; a larger head, or bfloat16, is XLA's.
    built = cpu_kernels.isa() is not None
    assert _runs_kernel(1, MAX_KERNEL_HEAD_DIM) == built
    assert not _runs_kernel(1, MAX_KERNEL_HEAD_DIM + 1) and not _runs_kernel(1, 64, jnp.bfloat16)


def test_under_a_mesh_of_several_devices_the_ops_are_xlas():
    # XLA partitions its own ops over a mesh; a custom call would have a sharded cache gathered whole onto each
    # device. A mesh of one device keeps the kernel.
    from gpt.model.sharding import make_mesh

    built = cpu_kernels.isa() is not None
    with jax.set_mesh(make_mesh(data=2, devices=jax.devices()[:2])):
        assert not _runs_kernel(2, 8)
    with jax.set_mesh(make_mesh(data=1, devices=jax.devices()[:1])):
        assert _runs_kernel(2, 8) == built
