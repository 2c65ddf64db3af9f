"""The GPT: Flax NNX modules used functionally (nnx.split the model, jit pure functions of its state).

Shape letters: B batch, T positions, S cache slots, D width, N heads, H head dim, F MLP width,
V vocabulary, L layers. Every parameter carries logical axis names in its `axes` metadata; gpt/sharding.py
maps them onto a device mesh.

    tokens -> embed (+ learned or sinusoidal positions) -> L x Block -> LayerNorm -> x @ wte.T -> logits
    Block:  x + Attention(LayerNorm(x)),  then  x + MLP(LayerNorm(x))       (pre-LN, GELU-tanh MLP)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gpt.attention import apply_rope, attend, sinusoidal_embedding
from gpt.config import GPTConfig
from gpt.kv_cache import KVCache
from gpt.loss import lm_head_cross_entropy
from gpt.sharding import constrain

__all__ = ["GPT"]


def _normal(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


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


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputMajor:
    """A weight matrix stored transposed, [K, D] for a map from D inputs to K outputs, so that each
    output's weights are contiguous. XLA on CPU runs the matrix-vector products of decoding a batch of
    one faster this way: GPT-2, 128 new tokens, 3.23-3.57 s against 3.37-3.89 s in alternating runs.
    `Blocks.for_decoding` makes them; training keeps the [D, ...] kernels."""

    matrix_KD: jax.Array

    def astype(self, dtype) -> OutputMajor:
        return OutputMajor(self.matrix_KD.astype(dtype))


class Blocks(nnx.Module):
    """All decoder blocks, their parameters stacked on a leading `layers` axis: one array per kind of
    weight, which one `lax.scan` can run (`GPTConfig.scan_layers`) and the optimizer updates as a whole."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        L, D, N, H, F = config.n_layer, config.n_embd, config.n_head, config.head_dim, config.mlp_dim
        dtype, std = config.storage_dtype, 0.02
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2L).
        residual_std = std / (2 * L) ** 0.5
        bias = config.bias
        self.config = config
        self.ln1_scale = _constant(1.0, (L, D), ("layers", "embed"), dtype)
        self.ln1_bias = _constant(0.0, (L, D), ("layers", "embed"), dtype) if bias else None
        self.qkv_kernel = _normal(rngs, (L, D, 3, N, H), ("layers", "embed", None, "heads", "head_dim"), dtype, std)
        self.qkv_bias = _constant(0.0, (L, 3, N, H), ("layers", None, "heads", "head_dim"), dtype) if bias else None
        self.out_kernel = _normal(rngs, (L, N, H, D), ("layers", "heads", "head_dim", "embed"), dtype, residual_std)
        self.out_bias = _constant(0.0, (L, D), ("layers", "embed"), dtype) if bias else None
        self.ln2_scale = _constant(1.0, (L, D), ("layers", "embed"), dtype)
        self.ln2_bias = _constant(0.0, (L, D), ("layers", "embed"), dtype) if bias else None
        self.fc_kernel = _normal(rngs, (L, D, F), ("layers", "embed", "mlp"), dtype, std)
        self.fc_bias = _constant(0.0, (L, F), ("layers", "mlp"), dtype) if bias else None
        self.proj_kernel = _normal(rngs, (L, F, D), ("layers", "mlp", "embed"), dtype, residual_std)
        self.proj_bias = _constant(0.0, (L, D), ("layers", "embed"), dtype) if bias else None

    NAMES = ("ln1_scale", "ln1_bias", "qkv_kernel", "qkv_bias", "out_kernel", "out_bias",
             "ln2_scale", "ln2_bias", "fc_kernel", "fc_bias", "proj_kernel", "proj_bias")

    def stacked(self) -> dict[str, jax.Array | None]:
        """The raw parameter arrays, each with its leading layer axis."""
        return {name: (None if getattr(self, name) is None else getattr(self, name)[...]) for name in self.NAMES}

    def unstacked(self) -> list[dict[str, jax.Array | None]]:
        """One dict of parameter arrays per layer, for the blocks run unrolled.

        Decoding streams every weight once per token; on CPU, XLA copies a layer's slice of a stacked
        array before each matmul, which doubles that traffic. A decode loop therefore gets its slices
        made once, outside the loop (`for_decoding`).
        """
        stacked = self.stacked()
        return [{name: (None if a is None else a[layer]) for name, a in stacked.items()}
                for layer in range(self.config.n_layer)]

    # How many leading axes of each kernel (after the layer axis) are its inputs.
    KERNEL_INPUT_AXES = {"qkv_kernel": 1, "out_kernel": 2, "fc_kernel": 1, "proj_kernel": 1}

    def for_decoding(self) -> list[dict[str, jax.Array | OutputMajor | None]]:
        """`unstacked()` with every kernel as an `OutputMajor` matrix, for a decode loop.

        Run it in a jit of its own and pass the result into the loop's (as `gpt.generate` does): inside one
        jit, XLA folds the transpose into the matmul and streams the weights in their stored order again.
        """
        layers = self.unstacked()
        for p in layers:
            for name, input_axes in self.KERNEL_INPUT_AXES.items():
                kernel = p[name]
                p[name] = OutputMajor(kernel.reshape(math.prod(kernel.shape[:input_axes]), -1).T)
        return layers


def dense(x_BTD: jax.Array, kernel: jax.Array | OutputMajor) -> jax.Array:
    """x [B, T, D] times a kernel whose leading axes are the D inputs ([D, ...], flattened to [D, K]), or an
    `OutputMajor` [K, D]: [B, T, K], as one 2-D matmul over B*T rows. XLA on CPU runs a dot that contracts
    two axes (the kernel gradient of a 3-D matmul contracts B and T) ~3x slower than the same 2-D GEMM;
    the reshapes are free."""
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    if isinstance(kernel, OutputMajor):
        y_MK = jax.lax.dot_general(x_MD, kernel.matrix_KD, (((1,), (1,)), ((), ())))
    else:
        y_MK = x_MD @ kernel.reshape(D, -1)
    return y_MK.reshape(B, T, -1)


def block(
    config: GPTConfig,
    p: dict[str, jax.Array | None],
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    cache: KVCache | None,
    layer: int | jax.Array,
    dropout_key: jax.Array | None,
    mask_BTS: jax.Array | None = None,
) -> tuple[tuple[jax.Array, KVCache | None], tuple[jax.Array, jax.Array]]:
    """One decoder block. `p` holds this layer's parameters (no layer axis).

    With a cache, the new keys and values are written into it (`layer`, a Python int, picks its buffers)
    and attention reads the whole cache as `mask_BTS` [B, T, S] says (`cache.mask(T)`, computed once per
    forward by the caller, not once per layer). Without one, attention is over the T tokens themselves,
    plainly causal or as `mask_BTS` [B, T, T] says. Returns ((x, cache), (k, v)): the block's output [B, T, D],
    the updated cache, and its new keys and values [B, T, N, H] (for `GPT.prefill`)."""
    dtype = config.compute_dtype
    cast = lambda a: None if a is None else a.astype(dtype)  # noqa: E731
    attn_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)

    h_BTD = layer_norm(x_BTD, p["ln1_scale"], p["ln1_bias"], config.layer_norm_epsilon)
    B, T, _ = x_BTD.shape
    N, H = config.n_head, config.head_dim
    qkv_BTK = dense(h_BTD, cast(p["qkv_kernel"]))
    if p["qkv_bias"] is not None:
        qkv_BTK = qkv_BTK + cast(p["qkv_bias"]).reshape(3 * N * H)
    qkv_BT3NH = qkv_BTK.reshape(B, T, 3, N, H)
    q_BTNH, k_BTNH, v_BTNH = qkv_BT3NH[:, :, 0], qkv_BT3NH[:, :, 1], qkv_BT3NH[:, :, 2]
    if config.position == "rope":
        q_BTNH = apply_rope(q_BTNH, positions_BT, config.rope_theta)
        k_BTNH = apply_rope(k_BTNH, positions_BT, config.rope_theta)
    q_BTNH = constrain(q_BTNH, ("batch", None, "heads", None))

    if cache is None:
        k_MTH, v_MTH = (x.transpose(0, 2, 1, 3).reshape(B * N, T, H) for x in (k_BTNH, v_BTNH))
        attn_BTNH = attend(q_BTNH, k_MTH, v_MTH, mask_BTS)
    else:
        cache = cache.write(layer, k_BTNH, v_BTNH)
        k_MSH, v_MSH = cache.layer(layer)
        attn_BTNH = attend(q_BTNH, k_MSH, v_MSH, mask_BTS)

    out_BTD = dense(attn_BTNH.reshape(B, T, N * H), cast(p["out_kernel"]))
    if p["out_bias"] is not None:
        out_BTD = out_BTD + cast(p["out_bias"])
    x_BTD = x_BTD + dropout(out_BTD, config.dropout, attn_key)

    h_BTD = layer_norm(x_BTD, p["ln2_scale"], p["ln2_bias"], config.layer_norm_epsilon)
    h_BTF = dense(h_BTD, cast(p["fc_kernel"]))
    if p["fc_bias"] is not None:
        h_BTF = h_BTF + cast(p["fc_bias"])
    h_BTF = constrain(jax.nn.gelu(h_BTF, approximate=True), ("batch", None, "mlp"))
    h_BTD = dense(h_BTF, cast(p["proj_kernel"]))
    if p["proj_bias"] is not None:
        h_BTD = h_BTD + cast(p["proj_bias"])
    x_BTD = x_BTD + dropout(h_BTD, config.dropout, mlp_key)
    return (constrain(x_BTD, ("batch", None, None)), cache), (k_BTNH, v_BTNH)


class GPT(nnx.Module):
    """A decoder-only transformer with a tied LM head.

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
        self.lnf_scale = _constant(1.0, (D,), ("embed",), dtype)
        self.lnf_bias = _constant(0.0, (D,), ("embed",), dtype) if config.bias else None

    def embed(self, tokens_BT: jax.Array, positions_BT: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """Token (+ learned or sinusoidal position) embeddings, [B, T, D] in the compute dtype."""
        config = self.config
        # Gather the table's width (split over fsdp) first, as FSDP does for every weight before use: the
        # lookup's output is split over the batch, which would otherwise claim the same mesh axis.
        x_BTD = constrain(self.wte[...], ("vocab", None))[tokens_BT].astype(jnp.float32)
        # Padding slots of ragged batches have negative positions; clip them into the table (they are
        # masked out of attention anyway).
        positions_BT = jnp.clip(positions_BT, 0, config.block_size - 1)
        if config.position == "learned":
            x_BTD = x_BTD + constrain(self.wpe[...], (None, None))[positions_BT].astype(jnp.float32)
        elif config.position == "sinusoidal":
            x_BTD = x_BTD + sinusoidal_embedding(positions_BT, config.n_embd)
        x_BTD = dropout(x_BTD.astype(config.compute_dtype), config.dropout, dropout_key)
        return constrain(x_BTD, ("batch", None, None))

    def transform(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        dropout_key: jax.Array | None = None,
        layers: list[dict] | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Run every block and the final LayerNorm.

        Without a cache and with `config.scan_layers`, one lax.scan runs over the stacked layers (compile
        time flat in depth). Otherwise the blocks run unrolled, each over its own layer's weights (sliced
        here, or given as `layers`: a decode loop passes `self.blocks.for_decoding()`, made once outside
        the loop) and, with a cache, its own cache buffers.
        """
        config = self.config
        keys = None if dropout_key is None else jax.random.split(dropout_key, config.n_layer)
        mask_BTS = None if cache is None else cache.mask(x_BTD.shape[1])  # the same for every layer

        def step(carry, xs):
            x_BTD, cache = carry
            p, layer, key = xs
            return block(config, p, x_BTD, positions_BT, cache, layer, key, mask_BTS)[0], None

        if config.remat and cache is None:  # a training-time saving; decoding keeps no activations anyway
            step = jax.checkpoint(step, prevent_cse=False)
        if layers is None and cache is None and config.scan_layers:
            indices = jnp.arange(config.n_layer, dtype=jnp.int32)
            (x_BTD, cache), _ = jax.lax.scan(step, (x_BTD, cache), (self.blocks.stacked(), indices, keys))
        else:
            for layer, p in enumerate(self.blocks.unstacked() if layers is None else layers):
                (x_BTD, cache), _ = step((x_BTD, cache), (p, layer, None if keys is None else keys[layer]))
        return self.final_norm(x_BTD), cache

    def final_norm(self, x_BTD: jax.Array) -> jax.Array:
        bias = None if self.lnf_bias is None else self.lnf_bias[...]
        return layer_norm(x_BTD, self.lnf_scale[...], bias, self.config.layer_norm_epsilon)

    def prefill(self, tokens_BT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Fill an empty cache (index 0) with a left-padded prompt batch, as `self(tokens, cache=cache,
        last_only=True)` would, but with the layers run as one `lax.scan` (one block to compile instead
        of one per layer). Each layer attends within the prompt; the keys and values it makes are written
        into the cache's per-layer buffers after the scan.

        Args:
          tokens_BT: int32 [B, T], rows left-padded as `cache.start` says.
          cache: a KVCache with nothing written yet.
        Returns:
          (float32 logits of the last position [B, 1, V], the cache advanced by T).
        """
        T = tokens_BT.shape[1]
        positions_BT = cache.positions(T)
        mask_BTT = cache.mask(T)[:, :, :T]  # the cache is empty: its first T slots are the prompt

        def step(x_BTD, p):
            (x_BTD, _), kv = block(self.config, p, x_BTD, positions_BT, None, 0, None, mask_BTT)
            return x_BTD, kv

        x_BTD, (k_LBTNH, v_LBTNH) = jax.lax.scan(step, self.embed(tokens_BT, positions_BT), self.blocks.stacked())
        for layer in range(self.config.n_layer):
            cache = cache.write(layer, k_LBTNH[layer], v_LBTNH[layer])
        return self.logits(self.final_norm(x_BTD[:, -1:])), cache.advance(T)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """The tied LM head: float32 logits [B, T, V]."""
        # The table [V, D] already is an output-major matrix: contract over its own D axis. Spelled as
        # `x @ wte.T`, XLA on CPU copies the transposed 154 MB table before every decode step.
        logits_BTV = dense(x_BTD, OutputMajor(self.wte[...].astype(x_BTD.dtype)))
        return constrain(logits_BTV.astype(jnp.float32), ("batch", None, "vocab"))

    def hidden(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        dropout_key: jax.Array | None = None,
        layers: list[dict] | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """The final hidden states [B, T, D] (after the last LayerNorm, in the compute dtype), and the
        cache advanced past the tokens (None without one). Arguments as for `__call__`."""
        num_tokens = tokens_BT.shape[1]
        if positions_BT is None:
            positions_BT = (
                jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), tokens_BT.shape)
                if cache is None else cache.positions(num_tokens)
            )
        embed_key, blocks_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x_BTD = self.embed(tokens_BT, positions_BT, embed_key)
        x_BTD, cache = self.transform(x_BTD, positions_BT, cache, blocks_key, layers)
        return x_BTD, None if cache is None else cache.advance(num_tokens)

    def loss(self, tokens_BT: jax.Array, targets_BT: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy (float32 nats) of int32 targets [B, T] after tokens [B, T].

        Equal to the cross-entropy of `self(tokens_BT)`, but the [B, T, V] logits are never held at once
        (`gpt.loss.lm_head_cross_entropy`): faster on CPU, and the memory they would take on a GPU.
        """
        x_BTD, _ = self.hidden(tokens_BT, dropout_key=dropout_key)
        return lm_head_cross_entropy(x_BTD, self.wte[...].astype(x_BTD.dtype), targets_BT)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        dropout_key: jax.Array | None = None,
        last_only: bool = False,
        layers: list[dict] | None = None,
    ):
        """Logits for int32 tokens [B, T].

        Args:
          tokens_BT: int32 token ids [B, T].
          positions_BT: int32 positions [B, T]; defaults to 0..T-1 (or, with a cache, the cache's next slots).
          cache: a KVCache to read and extend; None for the plain (training) forward.
          dropout_key: a PRNG key to apply dropout with (training); None disables dropout.
          last_only: only the last position's logits ([B, 1, V]), as a prefill needs.
          layers: per-layer parameters to run unrolled (`Blocks.unstacked` or `Blocks.for_decoding`; see
            `transform`).
        Returns:
          float32 logits [B, T, V] without a cache; (logits, updated cache) with one.
        """
        x_BTD, new_cache = self.hidden(tokens_BT, positions_BT, cache, dropout_key=dropout_key, layers=layers)
        logits_BTV = self.logits(x_BTD[:, -1:] if last_only else x_BTD)
        return logits_BTV if cache is None else (logits_BTV, new_cache)
