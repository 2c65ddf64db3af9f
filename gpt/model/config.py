"""The model's shape and numerics, as one frozen dataclass with named presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

from gpt.errors import ConfigError

__all__ = ["GPTConfig", "PRESETS"]

Position = Literal["learned", "sinusoidal", "rope"]
LAYER_KINDS = {"g": "global: every earlier position", "l": "local: the last `sliding_window` positions",
               "n": "global, with no rotary positions"}  # a layer's attention, by its letter in `layer_kinds`
Activation = Literal["gelu", "relu2", "silu"]
Norm = Literal["layernorm", "rmsnorm"]
DType = Literal["float32", "bfloat16", "float16"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check_dtype(dtype: str, name: str = "dtype") -> None:
    """Raise ConfigError naming `name` unless `dtype` is one of `DType`'s."""
    if dtype not in _DTYPES:
        raise ConfigError(f"{name} must be one of {', '.join(_DTYPES)}, got {dtype!r}")


# None: derived from the others, or none (see each's docstring)
_OPTIONAL_SIZES = ("n_kv_head", "head_size", "mlp_width", "sliding_window")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer.

    Attributes:
      vocab_size: number of token ids; 50257 for GPT-2's BPE.
      block_size: the context length, in tokens.
      n_layer: depth, the number of transformer blocks.
      n_head: attention heads per block (query heads).
      n_kv_head: key and value heads, each shared by n_head / n_kv_head query heads (grouped-query attention:
        the KV cache holds n_kv_head heads); None for n_head (every query head its own).
      n_embd: the model width (a multiple of n_head, unless `head_size` is set).
      head_size: each attention head's width, where it is not n_embd / n_head (Qwen3-0.6B: 128 over 1024 / 16);
        None for n_embd / n_head (`head_dim` is the one to read).
      position: how positions enter: a `learned` table (GPT-2), a fixed `sinusoidal` table added to the
        token embeddings, or `rope` (rotary, applied to queries and keys in every layer).
      rope_theta: the rotary base frequency.
      rope_scaling: Llama 3's slowing of the rotary's long wavelengths for a longer context, by this factor
        (1: none; `gpt.model.attention.rope_frequencies`).
      rope_scaling_low: Llama 3's low_freq_factor: wavelengths over rope_scaling_context / this are slowed.
      rope_scaling_high: Llama 3's high_freq_factor: wavelengths under rope_scaling_context / this are kept.
      rope_scaling_context: Llama 3's original_max_position_embeddings, the context it was trained at.
      layer_kinds: each layer's attention, a letter a layer (`LAYER_KINDS`), the letters repeated over the layers:
        "g" global (every earlier position), "l" local (a sliding window: the last `sliding_window` positions,
        its own included), "n" global with no rotary positions. "" is every layer global; "l" every layer
        local (Mistral 7B v0.1); "lllllg" five local layers to one global (Gemma 3).
      sliding_window: how many positions a local layer's query sees, its own included (None: no local layers).
      rope_local_theta: the rotary base frequency of local layers where it is not `rope_theta` (Gemma 3's 10,000
        beside its global layers' 1,000,000); None: `rope_theta`.
      dropout: dropout rate on embeddings and residual branches while training.
      bias: biases in linear layers and LayerNorms (GPT-2 has them).
      qkv_bias: biases on the queries, keys and values whatever `bias` says (Qwen2.5 has them alone).
      norm: `layernorm` (GPT-2) or `rmsnorm`, x / RMS(x) times a learned scale (Llama, Qwen), with no bias.
      norm_plus_one: an RMSNorm multiplies by (1 + scale), its scale starting at 0 (Gemma's), in float32.
      sandwich_norm: normalize each sublayer's output too, before it joins the residual stream (Gemma 2 and 3's
        post-attention and post-feedforward norms, each with its own scale).
      scale_embeddings: the token embeddings times sqrt(n_embd) as they enter (Gemma's); a tied head reads the
        table as stored.
      query_scale: the attention scores are q . k times this (Gemma's query_pre_attn_scalar ** -0.5); None:
        1 / sqrt(head_dim).
      qk_norm: RMS-normalize each head's queries and keys, times a learned scale per channel (one for queries,
        one for keys, shared by the heads: Qwen3's), before the position rotation and the dot product, so that
        attention logits stay bounded however large the weights grow.
      activation: the MLP's nonlinearity: `gelu` (tanh approximation, GPT-2), `relu2`, relu(x)^2, or `silu`.
      gated_mlp: the MLP's hidden units are act(x @ gate) * (x @ up) (SwiGLU with `silu`: Llama, Qwen), where
        GPT-2's are act(x @ up).
      tied_head: the LM head is the token embedding transposed (GPT-2); False gives it its own matrix.
      layer_norm_epsilon: the norms' epsilon (GPT-2's LayerNorms: 1e-5; Llama's RMSNorms: 1e-5 or 1e-6).
      mlp_ratio: hidden width of the MLP over n_embd (when `mlp_width` is None).
      mlp_width: the MLP's hidden width, where it is no multiple of n_embd (SmolLM2-135M: 1536 over 576).
      dtype: the compute dtype of activations and matmuls.
      param_dtype: the dtype parameters are stored in (float32 for training).
      fp8: the MLP's and the LM head's matrix products of the forward without a cache (training and its
        loss) in FP8 with per-tensor power-of-two scales (`gpt.model.fp8`); decoding computes in `dtype`.
      remat: recompute each block's activations in the backward pass to save memory.
      scan_layers: run the blocks of the training forward as one `lax.scan` over the stacked layers, so
        that compile time stays flat in depth. Off, they run unrolled: on CPU the step is ~5% faster
        (a scan writes every layer's saved activations into stacked buffers, and reads them back).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    n_embd: int = 768
    head_size: int | None = None
    position: Position = "learned"
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    rope_scaling_low: float = 1.0
    rope_scaling_high: float = 4.0
    rope_scaling_context: int = 8192
    layer_kinds: str = ""
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    dropout: float = 0.0
    bias: bool = True
    qkv_bias: bool = False
    norm: Norm = "layernorm"
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    query_scale: float | None = None
    activation: Activation = "gelu"
    gated_mlp: bool = False
    tied_head: bool = True
    layer_norm_epsilon: float = 1e-5
    mlp_ratio: int = 4
    mlp_width: int | None = None
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    fp8: bool = False
    remat: bool = False
    scan_layers: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.type in ("bool", bool) and not isinstance(getattr(self, field.name), bool):
                raise ConfigError(f"GPTConfig.{field.name} must be true or false, got {getattr(self, field.name)!r}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "rope_scaling_context",
                     *_OPTIONAL_SIZES):
            value = getattr(self, name)
            if (value is not None or name not in _OPTIONAL_SIZES) and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"GPTConfig.{name} must be a positive integer"
                                  f"{' or None' if name in _OPTIONAL_SIZES else ''}, got {value!r}")
        if self.head_size is None and self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by GPTConfig.n_head={self.n_head}"
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(f"GPTConfig.n_kv_head={self.n_kv_head} must divide GPTConfig.n_head={self.n_head}")
        if self.position not in ("learned", "sinusoidal", "rope"):
            raise ConfigError(
                f"GPTConfig.position must be 'learned', 'sinusoidal' or 'rope', got {self.position!r}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"GPTConfig.position='rope' needs an even head_dim, but it is {self.head_dim} "
                f"({'head_size' if self.head_size else f'n_embd/n_head = {self.n_embd}/{self.n_head}'})"
            )
        if self.activation not in ("gelu", "relu2", "silu"):
            raise ConfigError(f"GPTConfig.activation must be 'gelu', 'relu2' or 'silu', got {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"GPTConfig.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.norm_plus_one and self.norm != "rmsnorm":
            raise ConfigError(f"GPTConfig.norm_plus_one is an RMSNorm's (Gemma's), but norm is {self.norm!r}")
        if self.position == "sinusoidal" and self.n_embd % 2:
            raise ConfigError(f"GPTConfig.position='sinusoidal' needs an even n_embd, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not (1 <= self.rope_scaling < math.inf and 0 < self.rope_scaling_low < self.rope_scaling_high < math.inf):
            raise ConfigError(f"GPTConfig.rope_scaling must be >= 1 and finite, and 0 < rope_scaling_low < "
                              f"rope_scaling_high, got {self.rope_scaling}, {self.rope_scaling_low}, "
                              f"{self.rope_scaling_high}")
        self._check_layer_kinds()
        optional = tuple(name for name in ("rope_local_theta", "query_scale") if getattr(self, name) is not None)
        for name in ("rope_theta", "layer_norm_epsilon", *optional):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"GPTConfig.{name} must be positive and finite, got {getattr(self, name)}")
        for name in ("dtype", "param_dtype"):
            check_dtype(getattr(self, name), f"GPTConfig.{name}")

    def _check_layer_kinds(self) -> None:
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ConfigError(f"GPTConfig.layer_kinds must be letters of {', '.join(LAYER_KINDS)} (one a layer, "
                              f"repeated over the layers), got {self.layer_kinds!r}")
        if ("l" in self.layer_kinds) != (self.sliding_window is not None):
            raise ConfigError(f"GPTConfig.sliding_window={self.sliding_window} and layer_kinds={self.layer_kinds!r} "
                              f"disagree: a window is set exactly when some layer is local ('l')")
        if "n" in self.layer_kinds and self.position != "rope":
            raise ConfigError(f"GPTConfig.layer_kinds has layers with no rotary positions ('n'), but position is "
                              f"{self.position!r}, not 'rope'")

    def layer_kind(self, layer: int) -> str:
        """Layer `layer`'s attention, a letter of `LAYER_KINDS` (`layer_kinds` repeated over the layers)."""
        return self.layer_kinds[layer % len(self.layer_kinds)] if self.layer_kinds else "g"

    def layer_window(self, layer: int) -> int | None:
        """How many positions layer `layer`'s queries see, their own included; None: every earlier one."""
        return self.sliding_window if self.layer_kind(layer) == "l" else None

    def layer_rope_theta(self, layer: int) -> float | None:
        """Layer `layer`'s rotary base frequency; None where it has no rotary positions."""
        kind = self.layer_kind(layer)
        if self.position != "rope" or kind == "n":
            return None
        return self.rope_local_theta or self.rope_theta if kind == "l" else self.rope_theta

    @property
    def head_dim(self) -> int:
        """Each attention head's width: `head_size`, or n_embd / n_head."""
        return self.n_embd // self.n_head if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        """The key and value heads (`n_kv_head`, or n_head)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.n_embd if self.mlp_width is None else self.mlp_width

    @property
    def norm_bias(self) -> bool:
        """The norms have biases: LayerNorms with `bias` (an RMSNorm has none)."""
        return self.bias and self.norm == "layernorm"

    @property
    def has_qkv_bias(self) -> bool:
        """The queries, keys and values have biases (`bias` or `qkv_bias`)."""
        return self.bias or self.qkv_bias

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(_DTYPES[self.dtype])

    @property
    def storage_dtype(self) -> jnp.dtype:
        return jnp.dtype(_DTYPES[self.param_dtype])

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration, optionally with some fields changed.

        `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` are OpenAI's shapes; `small` trains on a CPU in
        minutes; `tiny` is for tests.
        """
        if name not in PRESETS:
            raise ConfigError(f"unknown GPTConfig preset {name!r}; known presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    # Trains on 2 CPU cores in a few minutes (the train.py default).
    "small": GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=256),
    # For tests: every code path, in milliseconds.
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32),
}
