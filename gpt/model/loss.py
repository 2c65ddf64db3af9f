"""Next-token cross-entropy through the LM head, in chunks, without materializing the logits.

For the CPU benchmark config (8 x 256 tokens, GPT-2's 50257-token vocabulary) the logits are 411 MB of
float32, and the plain `softmax_cross_entropy(x @ wte.T)` streams them through memory about six times
(max, exp, sum, and the gradient's scale and write) before the two backward matmuls read them again.
Here the positions are cut into chunks whose logits fit in cache, and each chunk's gradients with respect
to x and to the table are computed in the forward pass, while its logits are still hot: the loss is a
scalar at the end of the graph, so the backward pass only scales them by the incoming cotangent. The
matmuls are the same three as the plain version's; the passes over the logits become cache traffic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt.model.backend import choices
from gpt.model.fp8 import E4M3, E5M2, quantize_dequantize
from gpt.model.sharding import constrain, data_parallel_size

__all__ = ["lm_head_cross_entropy"]


def lm_head_cross_entropy(x_BTD: jax.Array, table_VD: jax.Array, targets_BT: jax.Array,
                          chunk_bytes: int | None = None, label_smoothing: float = 0.0, fp8: bool = False) -> jax.Array:
    """Mean cross-entropy of `targets` under the logits `x @ table.T`, as
    `optax.softmax_cross_entropy_with_integer_labels(x @ table.T, targets).mean()` computes it (with
    `label_smoothing` e: against `optax.smooth_labels(one_hot(targets), e)`, i.e. 1 - e on the target and
    e / V spread over the whole vocabulary).

    Args:
      x_BTD: final hidden states [B, T, D] (any float dtype; the matmuls run in it).
      table_VD: the LM head [V, D] (the embedding table when tied), in x's dtype.
      targets_BT: int32 next-token ids [B, T] in [0, V).
      chunk_bytes: the float32 logits each device holds at once (default: 128 MiB on CPU, 1 GiB
        elsewhere). The chunks split T and keep B whole, so a batch split over devices stays split.
      label_smoothing: e in [0, 1); 0 is the plain cross-entropy.
      fp8: the head's products in FP8 (`gpt.model.fp8`): x and the table rounded to e4m3 (each under one
        scale), each chunk's gradient of its logits to e5m2 before the two backward products.
    Returns:
      the float32 scalar mean loss (nats). Differentiable in x and table.
    """
    B, T, _ = x_BTD.shape
    if chunk_bytes is None:
        chunk_bytes = choices().loss_chunk_bytes
    shards = _batch_shards(B)
    longest = chunk_bytes // (B // shards * table_VD.shape[0] * 4)
    with jax.named_scope("loss"):
        return _chunked_loss(x_BTD, table_VD, targets_BT, _chunk_length(T, longest), shards, float(label_smoothing),
                             fp8)


def _batch_shards(B: int) -> int:
    """How many ways the active mesh splits a batch of B rows (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else data_parallel_size(mesh)
    return shards if B % shards == 0 else 1


def _chunk_length(T: int, longest: int) -> int:
    """Positions per chunk: at most `longest` (but at least 1), dividing T where a divisor is near, so that
    little or no padding is computed."""
    count = -(-T // max(1, longest))
    for more in range(count, 2 * count + 1):  # up to twice as many chunks, to find an exact split
        if T % more == 0:
            return T // more
    return -(-T // count)


def _chunks(a_BT: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [n, B * chunk, ...]: T padded with zeros up to n * chunk, each chunk's rows flat
    (XLA on CPU runs 2-D matmuls much faster than ones that contract two axes)."""
    B, T = a_BT.shape[:2]
    n = -(-T // chunk)
    a_BT = jnp.pad(a_BT, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (a_BT.ndim - 2))
    return jnp.moveaxis(a_BT.reshape(B, n, chunk, *a_BT.shape[2:]), 1, 0).reshape(n, B * chunk, *a_BT.shape[2:])


def _unchunk(a_nM: jax.Array, B: int, T: int) -> jax.Array:
    """The inverse of `_chunks`: [n, B * chunk, ...] -> [B, T, ...]."""
    n, M = a_nM.shape[:2]
    a_BnC = jnp.moveaxis(a_nM.reshape(n, B, M // B, *a_nM.shape[2:]), 0, 1)
    return a_BnC.reshape(B, n * (M // B), *a_nM.shape[2:])[:, :T]


def _chunked_inputs(x_BTD, targets_BT, chunk):
    """x [n, M, D], targets [n, M] and a validity mask [n, M] (False on the padding), M = B * chunk."""
    valid_BT = jnp.ones(targets_BT.shape, jnp.bool_)
    return _chunks(x_BTD, chunk), _chunks(targets_BT, chunk), _chunks(valid_BT, chunk)


def _chunk_loss(x_MD, table_VD, targets_M, valid_M, smoothing):
    """A chunk's summed loss, and the softmax-minus-target gradient of its logits [M, V] (float32)."""
    with jax.named_scope("lm_head"):  # the scopes sort a profile's time (bench/step_profile.py)
        logits_MV = jax.lax.dot_general(x_MD, table_VD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    top_M1 = logits_MV.max(-1, keepdims=True)
    exp_MV = jnp.exp(logits_MV - top_M1)
    total_M1 = exp_MV.sum(-1, keepdims=True)
    target_logit_M = jnp.take_along_axis(logits_MV, targets_M[:, None], axis=-1)[:, 0]
    log_total_M = top_M1[:, 0] + jnp.log(total_M1[:, 0])
    loss_M = log_total_M - target_logit_M
    is_target_MV = jnp.arange(logits_MV.shape[-1]) == targets_M[:, None]
    dlogits_MV = exp_MV / total_M1 - is_target_MV
    if smoothing:  # the target distribution (1 - e) one_hot + e / V: e of the mean of -log p over V
        loss_M = (1 - smoothing) * loss_M + smoothing * (log_total_M - logits_MV.mean(-1))
        dlogits_MV = exp_MV / total_M1 - ((1 - smoothing) * is_target_MV + smoothing / logits_MV.shape[-1])
    # Padding rows need no mask in the gradient: their x is zero, so they add nothing to the table's
    # gradient, and their rows of x's gradient are cut off.
    return jnp.where(valid_M, loss_M, 0.0).sum(), dlogits_MV


def _fp8_operands(x_BTD, table_VD, fp8):
    """The head's forward operands: as they are, or each rounded to e4m3."""
    if not fp8:
        return x_BTD, table_VD
    return quantize_dequantize(x_BTD, E4M3), quantize_dequantize(table_VD, E4M3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_loss(x_BTD, table_VD, targets_BT, chunk, shards, smoothing, fp8):
    B, T, _ = x_BTD.shape
    x_BTD, table_VD = _fp8_operands(x_BTD, table_VD, fp8)

    def add_chunk(total, xs):
        x_MD, targets_M, valid_M = xs
        return total + _chunk_loss(x_MD, table_VD, targets_M, valid_M, smoothing)[0], None

    xs = _chunked_inputs(x_BTD, targets_BT, chunk)
    total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), xs)
    return total / (B * T)


def _chunked_loss_forward(x_BTD, table_VD, targets_BT, chunk, shards, smoothing, fp8):
    B, T, D = x_BTD.shape
    V = table_VD.shape[0]
    out_dtypes = x_BTD.dtype, table_VD.dtype
    x_BTD, table_VD = _fp8_operands(x_BTD, table_VD, fp8)

    def add_chunk(carry, xs):
        total, dtable_SVD = carry
        x_MD, targets_M, valid_M = xs
        loss, dlogits_MV = _chunk_loss(x_MD, table_VD, targets_M, valid_M, smoothing)
        dlogits_MV = dlogits_MV.astype(x_MD.dtype)
        if fp8:
            dlogits_MV = quantize_dequantize(dlogits_MV, E5M2)
        with jax.named_scope("backward"), jax.named_scope("lm_head"):  # the head's backward, done here
            dx_MD = dlogits_MV @ table_VD
            # The table's gradient sums over the rows, which are split over `shards` devices: keep one partial
            # sum per shard through the loop and add them up once after it, rather than once per chunk.
            rows = x_MD.shape[0] // shards
            dtable_SVD = dtable_SVD + jnp.einsum("SmV,SmD->SVD", dlogits_MV.reshape(shards, rows, V),
                                                 x_MD.reshape(shards, rows, D), preferred_element_type=jnp.float32)
        return (total + loss, constrain(dtable_SVD, ("batch", "vocab", None))), dx_MD

    xs = _chunked_inputs(x_BTD, targets_BT, chunk)
    partial_SVD = constrain(jnp.zeros((shards, V, D), jnp.float32), ("batch", "vocab", None))
    (total, dtable_SVD), dx_nMD = jax.lax.scan(add_chunk, (jnp.zeros((), jnp.float32), partial_SVD), xs)
    # The gradients of the mean, ready for the backward pass to scale by its cotangent (1 for a loss).
    dx_BTD = (_unchunk(dx_nMD, B, T) / (B * T)).astype(out_dtypes[0])
    dtable_VD = (dtable_SVD.sum(0) / (B * T)).astype(out_dtypes[1])
    return total / (B * T), (dx_BTD, dtable_VD)


def _chunked_loss_backward(chunk, shards, smoothing, fp8, residuals, cotangent):
    dx_BTD, dtable_VD = residuals
    return (cotangent * dx_BTD).astype(dx_BTD.dtype), (cotangent * dtable_VD).astype(dtable_VD.dtype), None


_chunked_loss.defvjp(_chunked_loss_forward, _chunked_loss_backward)
