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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt.model.backend import choices
from gpt.model.fp8 import E4M3, E5M2, quantize_dequantize
from gpt.model.sharding import constrain, data_parallel_size

__all__ = ["lm_head_cross_entropy"]


def lm_head_cross_entropy(x_BTD: jax.Array, table_VD: jax.Array, targets_BT: jax.Array,
                          chunk_bytes: int | None = None, label_smoothing: float = 0.0, fp8: bool = False,
                          scored_only: bool = False) -> jax.Array:
    """Mean cross-entropy of `targets` under the logits `x @ table.T`, as
    `optax.softmax_cross_entropy_with_integer_labels(x @ table.T, targets).mean()` computes it (with
    `label_smoothing` e: against `optax.smooth_labels(one_hot(targets), e)`, i.e. 1 - e on the target and
    e / V spread over the whole vocabulary).

    Args:
      x_BTD: final hidden states [B, T, D] (any float dtype; the matmuls run in it).
      table_VD: the LM head [V, D] (the embedding table when tied), in x's dtype.
      targets_BT: int32 next-token ids [B, T] in [0, V); with `scored_only`, a target below 0 is not scored (a
        conversation's user turn: `gpt.data.conversations`).
      chunk_bytes: the float32 logits each device holds at once (default: 128 MiB on CPU, 1 GiB
        elsewhere). The chunks split T and keep B whole, so a batch split over devices stays split.
      label_smoothing: e in [0, 1); 0 is the plain cross-entropy.
      fp8: the head's products in FP8 (`gpt.model.fp8`): x and the table rounded to e4m3 (each under one
        scale), each chunk's gradient of its logits to e5m2 before the two backward products.
      scored_only: the mean over the targets >= 0 alone (0 where there are none), the others adding nothing to the
        loss or its gradients. A static choice: without it the program is the plain one.
    Returns:
      the float32 scalar mean loss (nats). Differentiable in x and table.

    The backend table (`gpt.model.backend`) says how the head's product is shaped: its rows padded with zeros
    to a multiple of `head_rows_multiple` (the padded logits left out of the softmax, the table's gradient
    cut back to V rows), and its logits written in float32 or in x's dtype (`head_logits`; the reductions
    over them run in float32 either way).
    """
    B, T, _ = x_BTD.shape
    chosen = choices()
    if chunk_bytes is None:
        chunk_bytes = chosen.loss_chunk_bytes
    shards = _batch_shards(B)
    longest = chunk_bytes // (B // shards * table_VD.shape[0] * 4)
    head = _Head(chosen.head_rows_multiple, chosen.head_logits == "compute", float(label_smoothing), fp8,
                 scored_only)
    with jax.named_scope("loss"):
        return _chunked_loss(x_BTD, table_VD, targets_BT, _chunk_length(T, longest), shards, head)


class _Head(NamedTuple):
    """How the loss computes the head's product (static: each value is a program of its own)."""

    rows_multiple: int  # the table padded with zero rows to a multiple of this
    compute_logits: bool  # logits in x's dtype rather than float32
    smoothing: float
    fp8: bool
    scored_only: bool  # targets below 0 are left out


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


def _chunked_inputs(x_BTD, targets_BT, chunk, head: _Head):
    """x [n, M, D], targets [n, M] and a validity mask [n, M] (False on the padding, and on the unscored targets
    with `head.scored_only`), M = B * chunk; and the number of targets the mean is over (float32 [])."""
    if head.scored_only:
        valid_BT = targets_BT >= 0
        targets_BT = jnp.maximum(targets_BT, 0)
        count = jnp.maximum(valid_BT.sum(), 1).astype(jnp.float32)  # a batch of no scored targets: loss 0, not nan
    else:
        valid_BT = jnp.ones(targets_BT.shape, jnp.bool_)
        count = targets_BT.size
    return (_chunks(x_BTD, chunk), _chunks(targets_BT, chunk), _chunks(valid_BT, chunk)), count


def _chunk_loss(x_MD, table_PD, targets_M, valid_M, V, head: _Head):
    """A chunk's summed loss, and the softmax-minus-target gradient of its logits [M, P] (float32; zero in the
    P - V padded columns, which the softmax leaves out)."""
    logits_dtype = x_MD.dtype if head.compute_logits else jnp.float32
    with jax.named_scope("lm_head"):  # the scopes sort a profile's time (bench/step_profile.py)
        logits_MP = jax.lax.dot_general(x_MD, table_PD, (((1,), (1,)), ((), ())), preferred_element_type=logits_dtype)
    if head.compute_logits:  # XLA would fold the upcast into the product: the barrier keeps its output 16-bit
        logits_MP = jax.lax.optimization_barrier(logits_MP)
    logits_MP = logits_MP.astype(jnp.float32)  # fused into the reductions that read it
    real_P = jnp.arange(logits_MP.shape[-1]) < V
    if logits_MP.shape[-1] > V:
        logits_MP = jnp.where(real_P, logits_MP, -jnp.inf)
    top_M1 = logits_MP.max(-1, keepdims=True)
    exp_MP = jnp.exp(logits_MP - top_M1)
    total_M1 = exp_MP.sum(-1, keepdims=True)
    target_logit_M = jnp.take_along_axis(logits_MP, targets_M[:, None], axis=-1)[:, 0]
    log_total_M = top_M1[:, 0] + jnp.log(total_M1[:, 0])
    loss_M = log_total_M - target_logit_M
    is_target_MP = jnp.arange(logits_MP.shape[-1]) == targets_M[:, None]
    dlogits_MP = exp_MP / total_M1 - is_target_MP
    if head.smoothing:  # the target distribution (1 - e) one_hot + e / V: e of the mean of -log p over V
        e = head.smoothing
        mean_logit_M = jnp.where(real_P, logits_MP, 0.0).sum(-1) / V
        loss_M = (1 - e) * loss_M + e * (log_total_M - mean_logit_M)
        dlogits_MP = exp_MP / total_M1 - ((1 - e) * is_target_MP + jnp.where(real_P, e / V, 0.0))
    # Padding rows need no mask in the gradient: their x is zero, so they add nothing to the table's
    # gradient, and their rows of x's gradient are cut off. Unscored targets' rows do.
    if head.scored_only:
        dlogits_MP = jnp.where(valid_M[:, None], dlogits_MP, 0.0)
    return jnp.where(valid_M, loss_M, 0.0).sum(), dlogits_MP


def _head_operands(x_BTD, table_VD, head: _Head):
    """The head's forward operands: x and the table padded to P rows, as they are or each rounded to e4m3."""
    V = table_VD.shape[0]
    table_PD = jnp.pad(table_VD, ((0, -V % head.rows_multiple), (0, 0)))
    if not head.fp8:
        return x_BTD, table_PD
    return quantize_dequantize(x_BTD, E4M3), quantize_dequantize(table_PD, E4M3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_loss(x_BTD, table_VD, targets_BT, chunk, shards, head: _Head):
    V = table_VD.shape[0]
    x_BTD, table_PD = _head_operands(x_BTD, table_VD, head)

    def add_chunk(total, xs):
        x_MD, targets_M, valid_M = xs
        return total + _chunk_loss(x_MD, table_PD, targets_M, valid_M, V, head)[0], None

    xs, count = _chunked_inputs(x_BTD, targets_BT, chunk, head)
    total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), xs)
    return total / count


def _chunked_loss_forward(x_BTD, table_VD, targets_BT, chunk, shards, head: _Head):
    B, T, D = x_BTD.shape
    V = table_VD.shape[0]
    out_dtypes = x_BTD.dtype, table_VD.dtype
    x_BTD, table_PD = _head_operands(x_BTD, table_VD, head)
    P = table_PD.shape[0]

    def add_chunk(carry, xs):
        total, dtable_SPD = carry
        x_MD, targets_M, valid_M = xs
        loss, dlogits_MP = _chunk_loss(x_MD, table_PD, targets_M, valid_M, V, head)
        dlogits_MP = dlogits_MP.astype(x_MD.dtype)
        if head.fp8:
            dlogits_MP = quantize_dequantize(dlogits_MP, E5M2)
        with jax.named_scope("backward"), jax.named_scope("lm_head"):  # the head's backward, done here
            dx_MD = dlogits_MP @ table_PD
            # The table's gradient sums over the rows, which are split over `shards` devices: keep one partial
            # sum per shard through the loop and add them up once after it, rather than once per chunk.
            rows = x_MD.shape[0] // shards
            dtable_SPD = dtable_SPD + jnp.einsum("SmP,SmD->SPD", dlogits_MP.reshape(shards, rows, P),
                                                 x_MD.reshape(shards, rows, D), preferred_element_type=jnp.float32)
        return (total + loss, constrain(dtable_SPD, ("batch", "vocab", None))), dx_MD

    xs, count = _chunked_inputs(x_BTD, targets_BT, chunk, head)
    partial_SPD = constrain(jnp.zeros((shards, P, D), jnp.float32), ("batch", "vocab", None))
    (total, dtable_SPD), dx_nMD = jax.lax.scan(add_chunk, (jnp.zeros((), jnp.float32), partial_SPD), xs)
    # The gradients of the mean, ready for the backward pass to scale by its cotangent (1 for a loss).
    dx_BTD = (_unchunk(dx_nMD, B, T) / count).astype(out_dtypes[0])
    dtable_VD = (dtable_SPD.sum(0)[:V] / count).astype(out_dtypes[1])
    return total / count, (dx_BTD, dtable_VD)


def _chunked_loss_backward(chunk, shards, head, residuals, cotangent):
    dx_BTD, dtable_VD = residuals
    return (cotangent * dx_BTD).astype(dx_BTD.dtype), (cotangent * dtable_VD).astype(dtable_VD.dtype), None


_chunked_loss.defvjp(_chunked_loss_forward, _chunked_loss_backward)
