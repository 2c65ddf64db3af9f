"""Llama-shaped checkpoints in the Hugging Face format (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`): load them into a GPT, and write a GPT of their shape back.

Their architecture is GPT's with newer choices, each a `GPTConfig` field: rotary positions, RMSNorm, a gated
SiLU MLP, no biases but Qwen2's on q, k and v, Qwen3's QK-norm, grouped-query attention, a head size of
its own, Llama 3's rotary scaling, a head tied or not, Mistral's sliding window (every layer local) and
Qwen's (the layers from `max_window_layers` on, or as `layer_types` lists them). Their `nn.Linear` weights are stored
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

from gpt.errors import ConfigError, MissingInput
from gpt.model.config import GPTConfig
from gpt.model.hf_files import read_config_json, read_safetensors, write_export
from gpt.model.parameters import block_weights
from gpt.model.transformer import GPT, parameter
from gpt.tokenizer_json import TokenizerJson

__all__ = ["FAMILIES", "config_from_hf", "config_to_hf", "read_config", "load", "save"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type values this module reads

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
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
_LAYER_TYPES = {"full_attention": "g", "sliding_attention": "l"}  # transformers' `layer_types`, as `layer_kinds`
# What these formats hold, whatever the family: (field, the value it needs).
_LLAMA_ARCHITECTURE = (("position", "rope"), ("norm", "rmsnorm"), ("gated_mlp", True), ("activation", "silu"),
                       ("bias", False))


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
    }
    for field, (value, supported, what) in unsupported.items():
        if value not in supported:
            raise ConfigError(f"config.json: {field}={value!r} ({what}) is not supported; this loader reads "
                              f"{field}={' or '.join(map(repr, supported))}")
    scaling = {} if rope_type == "default" else dict(
        rope_scaling=float(rope["factor"]), rope_scaling_low=float(rope["low_freq_factor"]),
        rope_scaling_high=float(rope["high_freq_factor"]), rope_scaling_context=rope["original_max_position_embeddings"])
    fields = dict(
        **_windows(family, hf),
        vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"], n_head=heads, n_kv_head=hf.get("num_key_value_heads", heads), n_embd=width,
        mlp_width=hf["intermediate_size"],
        position="rope", rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm="rmsnorm",
        layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="silu", gated_mlp=True, bias=False,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", tied_head=bool(hf.get("tie_word_embeddings", False)),
        head_size=None if hf.get("head_dim", width // heads) == width // heads else hf["head_dim"], **scaling,
    )
    return GPTConfig(**{**fields, **overrides})


def _windows(family: str, hf: dict) -> dict:
    """The `layer_kinds` and `sliding_window` of a config.json: Mistral's window on every layer (none where
    `sliding_window` is null); Qwen's on the layers `layer_types` names (transformers 5 writes them), else on those
    from `max_window_layers` on, where `use_sliding_window`; none for Llama."""
    layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if family == "mistral":
        kinds = "l" if window is not None else ""
    elif family in ("qwen2", "qwen3") and (hf.get("use_sliding_window") or hf.get("layer_types")):
        types = hf.get("layer_types") or ["sliding_attention" if hf.get("use_sliding_window") and
                                          i >= hf.get("max_window_layers", 28) else "full_attention"
                                          for i in range(layers)]
        unknown = sorted(set(map(str, types)) - set(_LAYER_TYPES))
        if unknown or len(types) != layers:
            raise ConfigError(f"config.json: layer_types must list {layers} of {', '.join(_LAYER_TYPES)}, got "
                              f"{unknown or len(types)}")
        kinds = "".join(_LAYER_TYPES[t] for t in types)
    else:
        kinds = ""
    kinds = "l" if set(kinds) == {"l"} else "" if "l" not in kinds else kinds
    if kinds and window is None:
        raise ConfigError("config.json: some layers use a sliding window, but sliding_window is null")
    return dict(layer_kinds=kinds, sliding_window=window if kinds else None)


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


def _theirs(name: str, value: np.ndarray, config: GPTConfig) -> np.ndarray:
    """`_ours` undone: a block weight of ours (without the layer axis) as Hugging Face stores it (k and v
    stacked on a leading axis)."""
    D = config.n_embd
    if name == "q_kernel":  # [D, N, H] -> [N*H, D]
        return value.reshape(D, -1).T
    if name == "kv_kernel":  # [D, 2, K, H] -> k and v, each [K*H, D]
        return np.stack([value[:, i].reshape(D, -1).T for i in range(2)])
    if name in ("q_bias", "kv_bias"):  # [N, H] -> [N*H]; [2, K, H] -> k and v [K*H]
        return value.reshape(*value.shape[:-2], -1)
    if name == "out_kernel":  # [N, H, D] -> [D, N*H]
        return value.reshape(-1, D).T
    return value.T if value.ndim == 2 else value


def family_of(config: GPTConfig) -> str:
    """The Hugging Face model_type that holds a model of `config`: Qwen2's with q, k and v biases, Qwen3's with
    QK-norm (either with local layers anywhere), Mistral's with every layer local, else Llama's; ConfigError
    naming every field none can hold."""
    unlike = [f"{name}={getattr(config, name)!r} (these formats have {value!r})"
              for name, value in _LLAMA_ARCHITECTURE if getattr(config, name) != value]
    if config.qkv_bias and config.qk_norm:
        unlike.append("qkv_bias=True with qk_norm=True (Qwen2 has the one, Qwen3 the other)")
    if "n" in config.layer_kinds:
        unlike.append(f"layer_kinds={config.layer_kinds!r} (layers without positions)")
    if config.rope_local_theta not in (None, config.rope_theta):
        unlike.append(f"rope_local_theta={config.rope_local_theta} (one rotary base for every layer)")
    mixed = config.layer_kinds not in ("", "l")
    if mixed and not (config.qkv_bias or config.qk_norm):
        unlike.append(f"layer_kinds={config.layer_kinds!r} (Mistral has every layer local, Llama none; Qwen2's "
                      f"and Qwen3's some)")
    if unlike:
        raise ConfigError(f"the Llama, Mistral and Qwen formats cannot hold this model: {', '.join(unlike)}")
    if config.qkv_bias or config.qk_norm:
        return "qwen2" if config.qkv_bias else "qwen3"
    return "mistral" if config.layer_kinds == "l" else "llama"


def config_to_hf(config: GPTConfig) -> dict:
    """The Hugging Face `config.json` of a Llama-shaped GPT (`config_from_hf` undone), of its `family_of`."""
    family = family_of(config)
    scaling = None if config.rope_scaling == 1.0 else dict(
        rope_type="llama3", factor=config.rope_scaling, low_freq_factor=config.rope_scaling_low,
        high_freq_factor=config.rope_scaling_high, original_max_position_embeddings=config.rope_scaling_context)
    return {
        "architectures": [_CLASSES[family]], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd, "intermediate_size": config.mlp_dim, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.layer_norm_epsilon,
        "rope_theta": config.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": config.tied_head,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        **_windows_to_hf(family, config),
    }


def _windows_to_hf(family: str, config: GPTConfig) -> dict:
    """`_windows` undone: the fields of a config.json that say which layers are local, and their window."""
    if family == "mistral":
        return {"sliding_window": config.sliding_window}
    if family == "llama":
        return {}
    kinds = [config.layer_kind(layer) for layer in range(config.n_layer)]
    types = {letter: name for name, letter in _LAYER_TYPES.items()}
    return {"use_sliding_window": "l" in kinds, "sliding_window": config.sliding_window,
            "max_window_layers": kinds.index("l") if "l" in kinds else config.n_layer,
            "layer_types": [types[kind] for kind in kinds]}


def save(model: GPT, out_dir: str | os.PathLike, tokenizer_files: dict[str, str] | None = None) -> Path:
    """Write a Llama-shaped `model` as a Hugging Face checkpoint (config.json + model.safetensors, float32) that
    transformers' `AutoModelForCausalLM` loads, and `load` reads back to the same weights, with its tokenizer's
    files where given (by name: `TokenizerJson.files`, or GPT-2's), whose BOS and EOS ids config.json then holds
    (transformers' `generate` stops at that EOS). Never destroys, and appears whole or not at
    all (`gpt.model.hf_files.write_export`)."""
    config = model.config
    hf_config = config_to_hf(config)
    if tokenizer_files and "tokenizer.json" in tokenizer_files:  # its BOS and EOS, where generate stops
        hf_config.update(TokenizerJson(tokenizer_files).config_ids)
    value = lambda path: np.asarray(parameter(model, path)[...], np.float32)  # noqa: E731
    tensors = {_MODEL_NAMES[path]: value(path) for path in ("wte", "lnf_scale", *(() if config.tied_head
                                                                                  else ("lm_head",)))}
    for w in block_weights(config):
        names, stacked = _BLOCK_NAMES[w.name], value(f"blocks.{w.name}")
        for i in range(config.n_layer):
            theirs = _theirs(w.name, stacked[i], config)
            for name, array in zip(names, theirs) if isinstance(names, tuple) else [(names, theirs)]:
                tensors[name.format(i)] = np.ascontiguousarray(array)
    return write_export(out_dir, tensors, {"config.json": json.dumps(hf_config, indent=2) + "\n",
                                           **(tokenizer_files or {})})


def read_config(source: str | os.PathLike, **overrides) -> GPTConfig:
    """The GPTConfig of a checkpoint directory, from its config.json alone."""
    return config_from_hf(read_config_json(Path(source)), **overrides)


def load(source: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None) -> GPT:
    """A GPT with the weights of a Hugging Face Llama, Qwen2 or Qwen3 checkpoint directory (config.json and
    model.safetensors, or its shards and their index); dtype the compute dtype, param_dtype the storage
    dtype (default: dtype)."""
    directory = Path(source)
    config = read_config(directory, dtype=dtype, param_dtype=param_dtype or dtype)
    tensors = read_safetensors(directory)
    if tensors is None:
        raise MissingInput(f"{directory} has neither model.safetensors nor model.safetensors.index.json")

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
