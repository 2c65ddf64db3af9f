"""The GPT: Flax NNX modules used functionally (nnx.split the model, jit pure functions of its state).

Shape letters: B batch, T positions, S cache slots, D width, N heads, H head dim, F MLP width,
V vocabulary, L layers. Every parameter carries logical axis names in its `axes` metadata; gpt/model/sharding.py
maps them onto a device mesh.

    tokens -> embed (+ learned or sinusoidal positions) -> L x Block -> Norm -> x @ head.T -> logits
    Block:  x + Attention(Norm(x)),  then  x + MLP(Norm(x))       (pre-norm)

GPT-2's choices are the defaults (LayerNorm, GELU-tanh MLP, biases, the head tied to the token embedding);
the config can switch each to a newer one: rotary positions, QK-norm, RMSNorm, a relu(x)^2 or gated SiLU
MLP, biases on q, k and v alone, an untied head (Llama's and Qwen's shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt.errors import ConfigError
from gpt.model.attention import apply_rope, attend, attend_paged, rope_frequencies, sinusoidal_embedding
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache
from gpt.model.layouts import Fp8Kernel, OutputMajor, dense
from gpt.model.loss import lm_head_cross_entropy
from gpt.model.parameters import BLOCK_WEIGHTS, weight_tensors
from gpt.model.sharding import constrain

__all__ = ["GPT", "Weights", "LayerAttention", "layer_attention", "forward", "embed", "transform", "lm_head", "block",
           "layer_norm", "rms_norm",
           "normalize", "rms_normalize", "in_compute_dtype", "parameter", "num_params", "flops_per_token", "model_summary"]


@functools.partial(jax.jit, static_argnums=(1, 2))
def standard_normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """`jax.random.normal(key, shape, dtype)`, drawn flat and reshaped: the same values (the draw's counter
    is the element's flat index), but XLA compiles a 1-D draw several times faster than a 5-D one (a tiny
    model's first init took seconds in these compiles)."""
    return jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)


def _initial(rngs: nnx.Rngs, config: GPTConfig, tensor: tuple) -> list[jax.Array]:
    """The initial values of one tensor's block weights (`weight_tensors`), each stacked [L, ...]: ones or
    zeros, or one normal draw [L, inputs..., the weights' outputs together] split into them by columns, with
    std 0.02 (0.02 / sqrt(2L) for a projection that writes into the residual stream, as GPT-2 scales it)."""
    L, dtype, first = config.n_layer, config.storage_dtype, tensor[0]
    if first.init != "normal":
        return [jnp.full((L, *w.dims(config)), _constant_init(config, w.init), dtype) for w in tensor]
    widths = [math.prod(w.dims(config)[w.inputs:]) for w in tensor]
    std = 0.02 / (2 * L) ** 0.5 if first.residual else 0.02
    drawn = std * standard_normal(rngs.params(), (L, *first.dims(config)[:first.inputs], sum(widths)), jnp.dtype(dtype))
    parts = jnp.split(drawn, np.cumsum(widths)[:-1].tolist(), axis=-1)
    return [part.reshape(L, *w.dims(config)) for w, part in zip(tensor, parts)]


def _constant_init(config: GPTConfig, init: str) -> float:
    """A constant weight's first value: "ones" is a norm's scale of 1, which is 0 where the norm multiplies by
    1 + scale (`GPTConfig.norm_plus_one`)."""
    return 0.0 if init == "zeros" or config.norm_plus_one else 1.0


def _normal(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    return nnx.Param(std * standard_normal(rngs.params(), tuple(shape), jnp.dtype(dtype)), axes=axes)


def _constant(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), axes=axes)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, epsilon: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32 and returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    variance = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(variance + epsilon) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis with a learned scale, as Llama's: x / RMS(x) in float32, returned in x's dtype,
    then times the scale. `plus_one` (Gemma's): times (1 + scale), in float32, then returned in x's dtype."""
    if plus_one:
        x32 = x.astype(jnp.float32)
        normalized = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + epsilon)
        return (normalized * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return rms_normalize(x, epsilon) * scale.astype(x.dtype)


def normalize(config: GPTConfig, x: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """The model's norm (`GPTConfig.norm`) of x [..., D] with its weights: a LayerNorm or an RMSNorm."""
    if config.norm == "rmsnorm":
        return rms_norm(x, scale, config.layer_norm_epsilon, config.norm_plus_one)
    return layer_norm(x, scale, bias, config.layer_norm_epsilon)


def rms_normalize(x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """x / RMS(x) over the last axis, without weights: computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + epsilon)).astype(x.dtype)


ACTIVATIONS = {
    "gelu": lambda h: jax.nn.gelu(h, approximate=True),  # GPT-2's tanh approximation
    "relu2": lambda h: jnp.square(jax.nn.relu(h)),  # sparse and cheap; trains faster at small scale
    "silu": jax.nn.silu,  # SwiGLU's, with a gated MLP (Llama, Qwen)
}


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Blocks(nnx.Module):
    """All decoder blocks, their parameters stacked on a leading `layers` axis: one array per kind of
    weight, which one `lax.scan` can run (`GPTConfig.scan_layers`) and the optimizer updates as a whole."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        params = {}
        for tensor in weight_tensors(config):  # in the table's order: the random draws are the table's
            for w, value in zip(tensor, _initial(rngs, config, tensor)):
                params[w.name] = nnx.Param(value, axes=("layers", *w.axes))
        for w in BLOCK_WEIGHTS:  # each as `gpt.model.parameters` declares it, in its order (None: absent)
            setattr(self, w.name, params.get(w.name))

    NAMES = tuple(w.name for w in BLOCK_WEIGHTS)

    def stacked(self) -> dict[str, jax.Array | None]:
        """The raw parameter arrays, each with its leading layer axis."""
        return {name: (None if getattr(self, name) is None else getattr(self, name)[...]) for name in self.NAMES}

    def unstacked(self) -> tuple[dict[str, jax.Array | None], ...]:
        """One dict of parameter arrays per layer (each without the layer axis)."""
        return unstack(self.stacked(), self.config.n_layer)


def unstack(stacked: dict, num_layers: int) -> tuple[dict, ...]:
    """One dict per layer from a dict of arrays stacked on a leading layer axis (None stays None)."""
    return tuple({name: None if a is None else a[layer] for name, a in stacked.items()} for layer in range(num_layers))


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's kind of attention (`GPTConfig.layer_kind`), as its forward reads it.

    Attributes:
      window: how many positions a query sees, its own included (a local layer's); None: every earlier one. An
        int32 scalar where a scan runs layers of several kinds (a global layer's larger than any context).
      inverse_freq: the rotary frequencies, float32 [H / 2] (`rope_frequencies`); None: no rotation. Zeros (no
        rotation) for a layer without positions where a scan runs layers of several kinds.
    """

    window: int | jax.Array | None
    inverse_freq: np.ndarray | jax.Array | None


def layer_attention(config: GPTConfig, layer: int) -> LayerAttention:
    """Layer `layer`'s attention: its window and its rotary frequencies."""
    theta = config.layer_rope_theta(layer)
    inverse_freq = None if theta is None else rope_frequencies(
        config.head_dim, theta, config.rope_scaling, config.rope_scaling_low, config.rope_scaling_high,
        config.rope_scaling_context)
    return LayerAttention(config.layer_window(layer), inverse_freq)


def stacked_layer_attention(config: GPTConfig) -> LayerAttention | None:
    """Every layer's attention stacked on a leading layer axis (window int32 [L], inverse_freq float32 [L, H / 2]),
    for a scan over layers of several kinds; None where every layer's is one (`layer_attention(config, 0)`)."""
    layers = [layer_attention(config, layer) for layer in range(config.n_layer)]
    first = layers[0]
    if all(a.window == first.window and (a.inverse_freq is None) == (first.inverse_freq is None) and (
            a.inverse_freq is None or np.array_equal(a.inverse_freq, first.inverse_freq)) for a in layers):
        return None
    everything = 2 ** 30  # a window no context reaches: every earlier position
    return LayerAttention(
        window=np.asarray([everything if a.window is None else a.window for a in layers], np.int32),
        inverse_freq=np.stack([np.zeros(config.head_dim // 2, np.float32) if a.inverse_freq is None
                               else a.inverse_freq for a in layers]))


def block(
    config: GPTConfig,
    p: dict,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    cache: KVCache | None,
    layer: int,
    dropout_key: jax.Array | None,
    mask_BTS: jax.Array | None = None,
    attention: LayerAttention | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """One decoder block. `p` holds this layer's weights (no layer axis), as arrays or in any layout that
    `gpt.model.layouts.dense` takes; `attention` its kind of attention (default: layer `layer`'s).

    With a cache, the new keys and values are written into layer `layer`'s buffers at `positions_BT`, and
    attention reads that whole buffer as `mask_BTS` [B, T, S] says (`cache.mask(positions_BT, layer, window)`,
    computed once per forward and window by the caller). Without one, attention is causal over the T tokens (within
    the layer's window).
    Returns the block's output [B, T, D] and the updated cache."""
    attention = layer_attention(config, layer) if attention is None else attention
    p = in_compute_dtype(config, p)
    mlp_kernel = Fp8Kernel if config.fp8 and cache is None else lambda kernel: kernel  # the MLP's products
    attn_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    B, T, _ = x_BTD.shape
    N, K, H = config.n_head, config.kv_heads, config.head_dim

    # Each part runs under a named scope: the compiled program's ops carry it, and a profile sorts its time
    # by it (bench/step_profile.py).
    with jax.named_scope("layer_norm"):
        h_BTD = normalize(config, x_BTD, p["ln1_scale"], p["ln1_bias"])
    flat = lambda bias: None if bias is None else bias.reshape(-1)  # noqa: E731
    bias = None if p["q_bias"] is None else jnp.concatenate([flat(p["q_bias"]), flat(p["kv_bias"])])
    qkv_BTK = _linear("qkv", h_BTD, qkv_kernel(p), bias)
    q_BTNH = qkv_BTK[..., :N * H].reshape(B, T, N, H)
    kv_BT2KH = qkv_BTK[..., N * H:].reshape(B, T, 2, K, H)
    k_BTKH, v_BTKH = kv_BT2KH[:, :, 0], kv_BT2KH[:, :, 1]
    with jax.named_scope("attention"):
        if config.qk_norm:  # before the rotation (Qwen3's order)
            q_BTNH = rms_norm(q_BTNH, p["q_norm_scale"], config.layer_norm_epsilon, config.norm_plus_one)
            k_BTKH = rms_norm(k_BTKH, p["k_norm_scale"], config.layer_norm_epsilon, config.norm_plus_one)
        if config.query_scale is not None and config.query_scale * H ** 0.5 != 1.0:  # attention's 1 / sqrt(H),
            q_BTNH = q_BTNH * jnp.asarray(config.query_scale * H ** 0.5, q_BTNH.dtype)  # made query_scale
        attn_BTNH, cache = _attention(attention, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache, layer, mask_BTS)
    out_BTD = _linear("attn_proj", attn_BTNH.reshape(B, T, N * H), p["out_kernel"], p["out_bias"])
    if p["attn_out_norm_scale"] is not None:  # a sandwich's outer norm (Gemma's)
        out_BTD = normalize(config, out_BTD, p["attn_out_norm_scale"], None)
    x_BTD = x_BTD + dropout(out_BTD, config.dropout, attn_key)

    with jax.named_scope("layer_norm"):
        h_BTD = normalize(config, x_BTD, p["ln2_scale"], p["ln2_bias"])
    up_BTF = _linear("mlp_up", h_BTD, mlp_kernel(p["fc_kernel"]), p["fc_bias"])
    gate_BTF = up_BTF if p["gate_kernel"] is None else _linear("mlp_gate", h_BTD, mlp_kernel(p["gate_kernel"]), None)
    with jax.named_scope("activation"):
        h_BTF = ACTIVATIONS[config.activation](gate_BTF)
        h_BTF = constrain(h_BTF if p["gate_kernel"] is None else h_BTF * up_BTF, ("batch", None, "mlp"))
    h_BTD = _linear("mlp_down", h_BTF, mlp_kernel(p["proj_kernel"]), p["proj_bias"])
    if p["mlp_out_norm_scale"] is not None:
        h_BTD = normalize(config, h_BTD, p["mlp_out_norm_scale"], None)
    x_BTD = x_BTD + dropout(h_BTD, config.dropout, mlp_key)
    return constrain(x_BTD, ("batch", None, None)), cache


def qkv_kernel(p: dict):
    """A block's queries', keys' and values' kernels as one matrix [D, (N + 2K) H] (GPT-2's c_attn), for one
    product: the same bits as the runs that stored it whole computed. The decoding layout holds it laid out
    once (`qkv_kernel`, `gpt.inference.decoder`); stored parameters are joined here (a copy of the weights,
    small beside their product over a batch of tokens)."""
    if p.get("qkv_kernel") is not None:
        return p["qkv_kernel"]
    D = p["q_kernel"].shape[0]
    return jnp.concatenate([p["q_kernel"].reshape(D, -1), p["kv_kernel"].reshape(D, -1)], axis=-1)


def in_compute_dtype(config: GPTConfig, p: dict) -> dict:
    """A block's weights (one layer's, or stacked on a layer axis) as its forward reads them: each in the compute
    dtype but the LayerNorms' (`BlockWeight.norm`), which stay as stored; None stays None. A no-op on weights
    already cast (the train step may cast them once for all its micro-batches: `params_cast_once`)."""
    dtype = config.compute_dtype
    return {name: a if a is None or name in _NORMS else a.astype(dtype) for name, a in p.items()}


_NORMS = frozenset(w.name for w in BLOCK_WEIGHTS if w.norm)  # the weights a block reads as stored


def _linear(scope: str, x_BTD: jax.Array, kernel, bias: jax.Array | None) -> jax.Array:
    """x times a kernel (`dense`), plus the bias when there is one, under the named scope `scope`."""
    with jax.named_scope(scope):
        y_BTK = dense(x_BTD, kernel)
        return y_BTK if bias is None else y_BTK + bias


def _attention(attention: LayerAttention, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
               positions_BT: jax.Array, cache: KVCache | None, layer: int,
               mask_BTS: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
    """The block's attention of its queries [B, T, N, H] over its keys and values [B, T, K, H] (as `block`
    describes): [B, T, N, H] and the cache with this layer's new keys and values written."""
    B, T, K, H = k_BTKH.shape
    window = attention.window
    if attention.inverse_freq is not None:
        q_BTNH = apply_rope(q_BTNH, positions_BT, attention.inverse_freq)
        k_BTKH = apply_rope(k_BTKH, positions_BT, attention.inverse_freq)
    q_BTNH = constrain(q_BTNH, ("batch", None, "heads", None))
    if cache is None:
        k_MTH, v_MTH = (x.transpose(0, 2, 1, 3).reshape(B * K, T, H) for x in (k_BTKH, v_BTKH))
        return attend(q_BTNH, k_MTH, v_MTH, None, window), None
    ring = cache.ring(layer)
    assert ring is None or T <= ring - window + 1, f"{T} positions a forward: a ring of {ring} for a window of {window}"
    cache = cache.write(layer, k_BTKH, v_BTKH, positions_BT)
    if T == 1:  # a decode step: read only the pages the rows have reached (one page: all, under the mask)
        return attend_paged(q_BTNH, *cache.pages(layer), positions_BT, cache.head_rows(K), window, ring), cache
    if cache.rows is not None or len(cache.k[layer]) > 1:  # a few positions a row (a draft's verification)
        return _attend_each_query(q_BTNH, cache, layer, positions_BT, K, window), cache
    mask_BTS = cache.mask(positions_BT, layer, window) if mask_BTS is None else mask_BTS
    return attend(q_BTNH, *cache.layer(layer), mask_BTS), cache


def _attend_each_query(q_BTNH: jax.Array, cache: KVCache, layer: int, positions_BT: jax.Array, K: int,
                       window: int | None) -> jax.Array:
    """Attention of T queries a row over a paged cache (of K key heads) or a view of one, as B * T decode
    queries, each reading its row's pages up to its own position (the keys of this forward's earlier positions
    are written already). [B, T, N, H]."""
    B, T, N, H = q_BTNH.shape
    rows_M = cache.head_rows(K)
    rows_BK = (jnp.arange(B * K, dtype=jnp.int32) if rows_M is None else rows_M).reshape(B, 1, K)
    rows_M = jnp.broadcast_to(rows_BK, (B, T, K)).reshape(B * T * K)  # query (b, t)'s key heads: row b's
    out = attend_paged(q_BTNH.reshape(B * T, 1, N, H), *cache.pages(layer), positions_BT.reshape(B * T, 1), rows_M,
                       window, cache.ring(layer))
    return out.reshape(B, T, N, H)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """Every array the forward reads, in the layout its owner chose.

    `GPT.weights()` gives the stored parameters (`layers` one dict of arrays stacked on a leading layer
    axis); `gpt.inference.decoding` gives a layout for fast decoding (`layers` a tuple of per-layer dicts whose
    kernels are `gpt.model.layouts` objects). The forward runs either.

    Attributes:
      embedding: the token table [V, D], read by lookup (an array, or a quantized layout with `rows`).
      positional: the learned position table [block_size, D], or None.
      layers: the blocks' weights: a dict of stacked [L, ...] arrays, or a tuple of L per-layer dicts.
      final_scale, final_bias: the last LayerNorm's [D] (bias None without biases).
      head: the LM head [V, D] as a kernel `dense` takes: `OutputMajor(embedding)` when tied (GPT-2), else its
        own matrix's.
    """

    embedding: jax.Array
    positional: jax.Array | None
    layers: dict | tuple
    final_scale: jax.Array
    final_bias: jax.Array | None
    head: object


def embed(config: GPTConfig, weights: Weights, tokens_BT: jax.Array, positions_BT: jax.Array,
          dropout_key: jax.Array | None = None) -> jax.Array:
    """Token (+ learned or sinusoidal position) embeddings, [B, T, D] in the compute dtype."""
    # Gather the table's width (split over fsdp) first, as FSDP does for every weight before use: the
    # lookup's output is split over the batch, which would otherwise claim the same mesh axis.
    table = weights.embedding
    x_BTD = (table.rows(tokens_BT) if hasattr(table, "rows")  # a quantized table (`gpt.model.layouts`)
             else constrain(table, ("vocab", None))[tokens_BT].astype(jnp.float32))
    if config.scale_embeddings:  # Gemma's: the table times sqrt(D), in its dtype
        x_BTD = x_BTD * jnp.asarray(config.n_embd ** 0.5, config.storage_dtype).astype(jnp.float32)
    # Rows that hold no request (free engine slots) may run past the table; clip them into it (their
    # output is never read).
    positions_BT = jnp.clip(positions_BT, 0, config.block_size - 1)
    if config.position == "learned":
        x_BTD = x_BTD + constrain(weights.positional, (None, None))[positions_BT].astype(jnp.float32)
    elif config.position == "sinusoidal":
        x_BTD = x_BTD + sinusoidal_embedding(positions_BT, config.n_embd)
    x_BTD = dropout(x_BTD.astype(config.compute_dtype), config.dropout, dropout_key)
    return constrain(x_BTD, ("batch", None, None))


def forward(
    config: GPTConfig,
    weights: Weights,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """The forward up to the final LayerNorm: (hidden states [B, T, D] in the compute dtype, the cache).

    Args:
      config: the model's shape.
      weights: `GPT.weights()` or a decoding layout (`gpt.inference.decoding`).
      tokens_BT: int32 token ids [B, T].
      positions_BT: int32 positions [B, T]; each row its own (a row's tokens need not start at 0). None:
        0..T-1, or with a cache each row's next T.
      cache: a KVCache to write the new keys and values into (at `positions_BT`) and read; each query
        attends to every cached slot at or before its position. None for the plain causal forward.
      dropout_key: a PRNG key to apply dropout with (training); None disables it.
    Returns:
      (hidden [B, T, D], the cache with each row's length set past its last position; None without one).
    """
    if positions_BT is None:
        T = tokens_BT.shape[1]
        positions_BT = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BT.shape) if cache is None
                        else cache.next_positions(T))
    embed_key, blocks_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    with jax.named_scope("embed"):
        x_BTD = embed(config, weights, tokens_BT, positions_BT, embed_key)
    return transform(config, weights, x_BTD, positions_BT, cache, blocks_key)


@functools.partial(jax.jit, static_argnames="config")
def _compiled_logits(config: GPTConfig, weights: Weights, tokens_BT: jax.Array, positions_BT: jax.Array | None,
                     cache: KVCache | None, dropout_key: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
    """`GPT.__call__`'s program: the forward and the head in one program per shape (apart, each eager
    call of a new shape compiled a dozen small programs around the forward)."""
    x_BTD, cache = forward(config, weights, tokens_BT, positions_BT, cache, dropout_key=dropout_key)
    return lm_head(weights, x_BTD), cache


@functools.partial(jax.jit, static_argnames=("config", "label_smoothing", "scored_only"))
def _compiled_loss(config: GPTConfig, weights: Weights, tokens_BT: jax.Array, targets_BT: jax.Array,
                   dropout_key: jax.Array | None, label_smoothing: float, scored_only: bool = False) -> jax.Array:
    """`GPT.loss`'s program, one per shape. Eager, the chunked cross-entropy's `lax.scan` compiled again
    at every call (its step is a new closure each time): ~50 ms a call for a tiny model."""
    x_BTD = forward(config, weights, tokens_BT, dropout_key=dropout_key)[0]
    table_VD = weights.head.matrix_KD.astype(x_BTD.dtype)
    return lm_head_cross_entropy(x_BTD, table_VD, targets_BT, label_smoothing=label_smoothing, fp8=config.fp8,
                                 scored_only=scored_only)


def transform(
    config: GPTConfig,
    weights: Weights,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    cache: KVCache | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Every block and the final LayerNorm over embeddings x [B, T, D]; arguments and result as `forward`'s.

    Without a cache and with `config.scan_layers`, stacked layers run as one lax.scan (compile time flat
    in depth); otherwise the blocks run unrolled, each over its own layer's weights.
    """
    num_layers = config.n_layer
    keys = None if dropout_key is None else jax.random.split(dropout_key, num_layers)
    # Each window's mask over the cache, made once for every layer of that window (and so of that ring).
    windows = {config.layer_window(layer): layer for layer in range(num_layers)}
    masks = {} if cache is None else {window: cache.mask(positions_BT, layer, window)
                                      for window, layer in windows.items()}

    def step(attention: LayerAttention):
        """A block of this attention without a cache: (x, its weights, its dropout key) -> x."""
        def run(x_BTD, p, key):
            return block(config, p, x_BTD, positions_BT, None, 0, key, attention=attention)[0]

        if config.remat:  # a training-time saving; decoding keeps no activations anyway
            return jax.checkpoint(run, prevent_cse=False) if config.scan_layers else recomputed_in_backward(run)
        return run

    stacked = isinstance(weights.layers, dict)
    if stacked and cache is None and config.scan_layers:
        kinds = stacked_layer_attention(config)  # None: every layer's attention is layer 0's
        if kinds is None:
            x_BTD, _ = jax.lax.scan(lambda x, xs: (step(layer_attention(config, 0))(x, *xs), None), x_BTD,
                                    (weights.layers, keys))
        else:  # each layer's window and frequencies scanned with its weights
            x_BTD, _ = jax.lax.scan(lambda x, xs: (step(LayerAttention(*xs[2:]))(x, *xs[:2]), None), x_BTD,
                                    (weights.layers, keys, kinds.window, kinds.inverse_freq))
    else:
        layers = unstack(weights.layers, num_layers) if stacked else weights.layers
        for layer, p in enumerate(layers):
            key = None if keys is None else keys[layer]
            if cache is None:
                x_BTD = step(layer_attention(config, layer))(x_BTD, p, key)
            else:
                x_BTD, cache = block(config, p, x_BTD, positions_BT, cache, layer, key,
                                     masks[config.layer_window(layer)])
    with jax.named_scope("layer_norm"):
        x_BTD = normalize(config, x_BTD, weights.final_scale, weights.final_bias)
    return x_BTD, None if cache is None else cache.advance(positions_BT)


def recomputed_in_backward(function):
    """`function(x, *rest)` whose backward recomputes it from its inputs, keeping none of its intermediates.

    `jax.checkpoint` does that under a `lax.scan`, but in an unrolled loop XLA drops its optimization
    barriers before it schedules, runs each block's recomputation as soon as the block's inputs exist (in
    the forward pass) and keeps as much as without it. Here the recomputation reads x through a sum with
    zero times the incoming gradient: the same x, which XLA cannot have before the backward reaches the
    block (the peak memory: `tests/test_model.py`)."""

    @jax.custom_vjp
    def run(*args):
        return function(*args)

    def forward(*args):
        return function(*args), args

    def backward(args, gradient):
        x, *rest = args
        x = x + (gradient.reshape(-1)[0] * 0).astype(x.dtype)  # x itself, once the gradient exists
        with jax.named_scope("recompute"):  # the scopes sort a profile's time (bench/step_profile.py)
            _, pullback = jax.vjp(function, x, *rest)
        with jax.named_scope("backward"):
            return pullback(gradient)

    run.defvjp(forward, backward)
    return run


def lm_head(weights: Weights, x_BTD: jax.Array) -> jax.Array:
    """The LM head: float32 logits [B, T, V] of hidden states [B, T, D]."""
    head = weights.head.astype(x_BTD.dtype)
    with jax.named_scope("lm_head"):  # the scopes sort a profile's time (bench/step_profile.py)
        return constrain(dense(x_BTD, head).astype(jnp.float32), ("batch", None, "vocab"))


class GPT(nnx.Module):
    """A decoder-only transformer.

    `model(tokens_BT)` -> float32 logits [B, T, V].
    `model(tokens_BT, positions_BT, cache)` -> (logits [B, T, V], the updated cache).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        D, dtype = config.n_embd, config.storage_dtype
        self.wte = _normal(rngs, (config.vocab_size, D), ("vocab", "embed"), dtype, 0.02)
        self.wpe = (
            _normal(rngs, (config.block_size, D), (None, "embed"), dtype, 0.02)
            if config.position == "learned" else None
        )
        self.blocks = Blocks(config, rngs=rngs)
        self.lnf_scale = _constant(_constant_init(config, "ones"), (D,), ("embed",), dtype)
        self.lnf_bias = _constant(0.0, (D,), ("embed",), dtype) if config.norm_bias else None
        # Untied, the head has its own [V, D] table (output-major, like the embedding it would be tied to).
        self.lm_head = None if config.tied_head else _normal(rngs, (config.vocab_size, D), ("vocab", "embed"), dtype, 0.02)

    def weights(self) -> Weights:
        """The parameters as the forward reads them, the blocks' stacked (no copy is made)."""
        embedding = self.wte[...]
        return Weights(
            embedding=embedding,
            positional=None if self.wpe is None else self.wpe[...],
            layers=self.blocks.stacked(),
            final_scale=self.lnf_scale[...],
            final_bias=None if self.lnf_bias is None else self.lnf_bias[...],
            head=OutputMajor(embedding if self.lm_head is None else self.lm_head[...]),
        )

    def loss(self, tokens_BT: jax.Array, targets_BT: jax.Array, *, dropout_key: jax.Array | None = None,
             label_smoothing: float = 0.0, scored_only: bool = False) -> jax.Array:
        """Mean next-token cross-entropy (float32 nats) of int32 targets [B, T] after tokens [B, T], against
        targets smoothed by `label_smoothing` (0: the plain cross-entropy); with `scored_only`, over the targets
        >= 0 alone (a target below 0 is one the model reads but is not taught: a conversation's user turn).

        Equal to the cross-entropy of `self(tokens_BT)`, but the [B, T, V] logits are never held at once
        (`gpt.model.loss.lm_head_cross_entropy`): faster on CPU, and the memory they would take on a GPU.
        """
        return _compiled_loss(self.config, self.weights(), tokens_BT, targets_BT, dropout_key, float(label_smoothing),
                              scored_only)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        dropout_key: jax.Array | None = None,
    ):
        """Logits for int32 tokens [B, T].

        Args:
          tokens_BT: int32 token ids [B, T].
          positions_BT: int32 positions [B, T]; defaults to 0..T-1, or with a cache each row's next ones.
          cache: a KVCache to read and extend; None for the plain (training) forward.
          dropout_key: a PRNG key to apply dropout with (training); None disables dropout.
        Returns:
          float32 logits [B, T, V] without a cache; (logits, updated cache) with one.
        """
        tokens_BT = tokens_BT if hasattr(tokens_BT, "shape") else jnp.asarray(tokens_BT)  # nested lists too
        self._check_tokens(tokens_BT, positions_BT is None and cache is None)
        logits_BTV, cache = _compiled_logits(self.config, self.weights(), tokens_BT, positions_BT, cache, dropout_key)
        return logits_BTV if cache is None else (logits_BTV, cache)

    def _check_tokens(self, tokens_BT, from_position_0: bool) -> None:
        """ConfigError for what a gather would silently clamp: a shape or dtype that is not ids [B, T], more
        tokens from position 0 than the context, or (for concrete arrays: a traced one has no values yet)
        an id outside the vocabulary."""
        shape, dtype = tokens_BT.shape, tokens_BT.dtype
        if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
            raise ConfigError(f"tokens must be integer ids [B, T], got shape {shape} and dtype {dtype}")
        if from_position_0 and shape[1] > self.config.block_size:
            raise ConfigError(f"{shape[1]} tokens are more than the model's context of {self.config.block_size}")
        if not isinstance(tokens_BT, jax.core.Tracer) and tokens_BT.size:
            # On the host where this process holds all of them (no program to compile for the check); else
            # on the devices. Concrete ids closed over by a jitted caller have values too.
            ids = np.asarray(tokens_BT) if getattr(tokens_BT, "is_fully_addressable", True) else tokens_BT
            with jax.ensure_compile_time_eval():
                low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ConfigError(f"token id {low if low < 0 else high} is outside the vocabulary "
                                  f"[0, {self.config.vocab_size})")


def parameter(model: GPT, path: str) -> nnx.Param | None:
    """The parameter at a dotted path of `model` ("wte", "blocks.fc_kernel"); None where the model has none."""
    target = model
    for part in path.split("."):
        target = getattr(target, part)
    return target


def num_params(config: GPTConfig) -> int:
    """Parameter count of the parameters a GPT of `config` makes (shapes only: nothing is allocated); a tied LM
    head is the token embedding, counted once."""
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def model_summary(config: GPTConfig) -> str:
    """A GPT of `config` in a phrase a user reads: "a GPT of 16.1 M parameters (6 layers x 384 wide, context 1,024,
    vocabulary 50,304)"."""
    return (f"a GPT of {num_params(config) / 1e6:,.1f} M parameters ({config.n_layer} layers x {config.n_embd} wide, "
            f"context {config.block_size:,}, vocabulary {config.vocab_size:,})")


def flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters: the LM head is one matmul, a lookup table is none)
    plus 12 x width x sequence a layer for attention's two matmuls (the PaLM paper's formula, appendix B), a local
    layer's sequence its window where that is shorter (the keys it sees)."""
    tables = (config.block_size if config.position == "learned" else 0) + (0 if config.tied_head else config.vocab_size)
    matmul_params = num_params(config) - tables * config.n_embd
    seen = sum(min(seq_len, config.layer_window(layer) or seq_len) for layer in range(config.n_layer))
    return 6 * matmul_params + 12 * config.n_head * config.head_dim * seen
