"""Causal attention on a TPU through Pallas' splash attention kernel (`jax.experimental.pallas.ops.tpu`), each query
seeing every earlier key or, on a local layer, the last `window` (the kernel's local mask: blocks wholly outside the
band are skipped, never computed and masked).

The kernel computes softmax(q k^T) v in blocks in the chip's vector memory, so that the T x T scores are never
written to HBM (what XLA's attention does); its backward is blocked the same way. It takes one sequence's heads
at a time ([N, T, H], vmapped over the batch here), a head size that fills the 128 lanes of a vector register
(GPT-2's 64 is padded with zeros: the padded channels add nothing to q k^T, and v's give zero columns that are
cut off), and a sequence that its blocks divide. Under a mesh it runs per device inside `jax.shard_map`, over
the batch rows and heads that device holds (a Pallas call is not split by XLA's partitioner).

Shape letters: B batch, T positions, N heads, H head dim.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp

from gpt.model.sharding import RULES, logical_to_spec

__all__ = ["splash_causal", "splash_fits", "LANES"]

LANES = 128  # a TPU vector register's lane count: the kernel's head size is a multiple of it
_BLOCKS = (512, 256, 128)  # the largest that divides T is each block's length (the kernel's defaults are 512)


def splash_fits(B: int, T: int, N: int) -> bool:
    """Whether the kernel takes [B, T, N, H]: its blocks divide T, and the active mesh (if any) splits the B rows
    over its batch axes and the N heads over its heads' evenly (each device runs whole rows and heads)."""
    mesh = jax.sharding.get_abstract_mesh()
    ways = lambda logical: 1 if mesh.empty else math.prod(  # noqa: E731
        mesh.shape[axis] for axis in _names(RULES[logical]))
    return any(T % block == 0 for block in _BLOCKS) and B % ways("batch") == 0 and N % ways("heads") == 0


def _names(axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def splash_causal(q_BTNH: jax.Array, k_BTNH: jax.Array, v_BTNH: jax.Array, window: int | None = None,
                  interpret: bool = False) -> jax.Array:
    """Causal attention [B, T, N, H] in q's dtype (the softmax in float32), each query seeing keys 0..itself, or
    only its last `window` (itself included: a local layer's, `gpt.model.attention.causal_band`).

    Args:
      q_BTNH, k_BTNH, v_BTNH: queries, keys and values [B, T, N, H], of shapes that `splash_fits`.
      window: a Python int (the kernel's mask is built from it), or None for plainly causal.
      interpret: run the kernel in Pallas' TPU interpreter (on any backend: how it is tested on a CPU).
    """
    _, T, _, H = q_BTNH.shape
    padded = -(-H // LANES) * LANES

    def per_device(q, k, v):  # closes over Python numbers only: a traced value here would leak out of a remat
        kernel = _kernel(T, q.shape[2], window, interpret)
        pad = [(0, 0)] * 3 + [(0, padded - H)]
        q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q * H ** -0.5, k, v))  # [B, N, T, padded]
        return jax.vmap(kernel)(q, k, v)[..., :H].transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_device(q_BTNH, k_BTNH, v_BTNH)
    spec = logical_to_spec(("batch", None, "heads", None))
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(
        q_BTNH, k_BTNH, v_BTNH)


@functools.lru_cache(maxsize=32)
def _kernel(T: int, N: int, window: int | None, interpret: bool):
    """The splash kernel for N heads of T positions, causal or local (its mask's block map is built once per
    shape and window)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = next(size for size in _BLOCKS if T % size == 0)
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    one = masks.CausalMask((T, T)) if window is None else masks.LocalMask((T, T), (window - 1, 0), offset=0)
    mask = masks.MultiHeadMask([one for _ in range(N)])
    # Its block maps become arrays when it is made, and made inside a trace they are that trace's values, which a
    # remat's backward (tracing again) finds leaked; `ensure_compile_time_eval` does not keep them out. JAX's trace
    # state is per thread: made on a thread of its own, they are plain arrays.
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(kernel.make_splash_mha, mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                             interpret=interpret).result()

