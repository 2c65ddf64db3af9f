"""Llama-shaped checkpoints in the Hugging Face format (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`): load them into a GPT.

Their architecture is GPT's with newer choices, each a `GPTConfig` field: rotary positions, RMSNorm, a gated
SiLU MLP, no biases but Qwen2's on q, k and v, Qwen3's QK-norm, grouped-query attention, a head size of
its own, Llama 3's rotary scaling, a head tied or not. Their `nn.Linear` weights are stored
[out, in]: each maps onto ours by a transpose and a reshape (k and v stacked into our [D, 2, K, H]); the
table `_BLOCK_NAMES` names them. A config field this loader does not implement is a one-line error naming
it, never a silent approximation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from gpt.errors import ConfigError, MissingInput
from gpt.model.config import GPTConfig
from gpt.model.parameters import block_weights
from gpt.model.transformer import GPT, parameter

__all__ = ["FAMILIES", "config_from_hf", "load"]

FAMILIES = ("llama", "qwen2", "qwen3")  # Hugging Face model_type values this module reads

# Each block weight's Hugging Face names ({} the layer): one, or k and v to stack.
_BLOCK_NAMES = {
    "ln1_scale": "model.layers.{}.input_layernorm.weight",
    "q_kernel": "model.layers.{}.self_attn.q_proj.weight",
    "kv_kernel": tuple(f"model.layers.{{}}.self_attn.{x}_proj.weight" for x in "kv"),
    "q_bias": "model.layers.{}.self_attn.q_proj.bias",
    "kv_bias": tuple(f"model.layers.{{}}.self_attn.{x}_proj.bias" for x in "kv"),
    "q_norm_scale": "model.layers.{}.self_attn.q_norm.weight",
    "k_norm_scale": "model.layers.{}.self_attn.k_norm.weight",
    "out_kernel": "model.layers.{}.self_attn.o_proj.weight",
    "ln2_scale": "model.layers.{}.post_attention_layernorm.weight",
    "gate_kernel": "model.layers.{}.mlp.gate_proj.weight",
    "fc_kernel": "model.layers.{}.mlp.up_proj.weight",
    "proj_kernel": "model.layers.{}.mlp.down_proj.weight",
}
_MODEL_NAMES = {"wte": "model.embed_tokens.weight", "lnf_scale": "model.norm.weight", "lm_head": "lm_head.weight"}


def config_from_hf(hf: dict, **overrides) -> GPTConfig:
    """A GPTConfig from a Llama, Qwen2 or Qwen3 `config.json`; ConfigError naming the first field it cannot hold."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"config.json: model_type {family!r} is not one of {', '.join(FAMILIES)}")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    # The rotary settings: top-level rope_theta and rope_scaling (the hub's files), or one rope_parameters
    # (transformers 5's).
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}  # a scaling wins
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {  # field: (its value, the values this loader reads, what another value would be)
        "hidden_act": (hf.get("hidden_act", "silu"), ("silu",), "an activation other than SiLU"),
        "rope_type": (rope_type, ("default", "llama3"), "a rotary frequency scaling other than Llama 3's"),
        "mlp_bias": (hf.get("mlp_bias", False), (False,), "biases in the MLP"),
        "attention_bias": (hf.get("attention_bias", False), (False,), "biases on the attention's projections"),
        "use_sliding_window": (hf.get("use_sliding_window", False), (False,), "sliding-window attention"),
    }
    for field, (value, supported, what) in unsupported.items():
        if value not in supported:
            raise ConfigError(f"config.json: {field}={value!r} ({what}) is not supported; this loader reads "
                              f"{field}={' or '.join(map(repr, supported))}")
    scaling = {} if rope_type == "default" else dict(
        rope_scaling=float(rope["factor"]), rope_scaling_low=float(rope["low_freq_factor"]),
        rope_scaling_high=float(rope["high_freq_factor"]), rope_scaling_context=rope["original_max_position_embeddings"])
    fields = dict(
        vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"], n_head=heads, n_kv_head=hf.get("num_key_value_heads", heads), n_embd=width,
        mlp_width=hf["intermediate_size"],
        position="rope", rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm="rmsnorm",
        layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="silu", gated_mlp=True, bias=False,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", tied_head=bool(hf.get("tie_word_embeddings", False)),
        head_size=None if hf.get("head_dim", width // heads) == width // heads else hf["head_dim"], **scaling,
    )
    return GPTConfig(**{**fields, **overrides})


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of `model.safetensors`, or of the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(directory / shard))
        return tensors
    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    raise MissingInput(f"{directory} has neither model.safetensors nor model.safetensors.index.json")


def _ours(name: str, array: np.ndarray, config: GPTConfig) -> np.ndarray:
    """A Hugging Face block weight [out, in] (or a bias, a scale) in our layout, without the layer axis."""
    H = config.head_dim
    if name == "q_kernel":  # [N*H, D] -> [D, N, H]
        return array.T.reshape(-1, config.n_head, H)
    if name == "kv_kernel":  # k and v, each [K*H, D] -> [D, 2, K, H]
        return np.stack([a.T.reshape(-1, config.kv_heads, H) for a in array], axis=1)
    if name in ("q_bias", "kv_bias"):  # [N*H] -> [N, H]; k and v [K*H] -> [2, K, H]
        return array.reshape(*array.shape[:-1], -1, H)
    if name == "out_kernel":  # [D, N*H] -> [N, H, D]
        return array.T.reshape(config.n_head, H, -1)
    return array.T if array.ndim == 2 else array


def load(source: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None) -> GPT:
    """A GPT with the weights of a Hugging Face Llama, Qwen2 or Qwen3 checkpoint directory (config.json and
    model.safetensors, or its shards and their index); dtype the compute dtype, param_dtype the storage
    dtype (default: dtype)."""
    directory = Path(source)
    if not (directory / "config.json").is_file():
        raise MissingInput(f"{directory} has no config.json")
    config = config_from_hf(json.loads((directory / "config.json").read_text()), dtype=dtype,
                            param_dtype=param_dtype or dtype)
    tensors = _read_tensors(directory)

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ConfigError(f"{directory}: missing tensor {name!r}")
        return np.asarray(tensors.pop(name), np.float32)

    values = {"wte": take(_MODEL_NAMES["wte"]), "lnf_scale": take(_MODEL_NAMES["lnf_scale"])}
    if config.tied_head:
        tensors.pop(_MODEL_NAMES["lm_head"], None)  # a copy of the embedding where a file keeps one
    else:
        values["lm_head"] = take(_MODEL_NAMES["lm_head"])
    for w in block_weights(config):
        names = _BLOCK_NAMES[w.name]
        layers = [_ours(w.name, np.stack([take(n.format(i)) for n in names]) if isinstance(names, tuple)
                        else take(names.format(i)), config) for i in range(config.n_layer)]
        values[f"blocks.{w.name}"] = np.stack(layers)
    if tensors:
        raise ConfigError(f"{directory}: unexpected tensors {sorted(tensors)[:8]}")

    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    for path, value in values.items():
        param = parameter(model, path)
        if value.shape != param.shape:
            raise ConfigError(f"{directory}: {path} has shape {value.shape}, expected {param.shape}")
        param.set_value(jnp.asarray(value, dtype=config.storage_dtype))
    return model
