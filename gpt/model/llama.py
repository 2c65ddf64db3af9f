"""Checkpoints of the Llama-shaped families (`gpt.model.families`: Llama, Mistral, Qwen2, Qwen3, Gemma 3) in the
Hugging Face format: load them into a GPT, and write a GPT of their shape back.

Their architecture is GPT's with newer choices, each a `GPTConfig` field (their config.json:
`gpt.model.llama_config`): rotary positions, RMSNorm (Gemma's of 1 + its scale), a gated MLP, no biases but
Qwen2's on q, k and v, QK-norm, grouped-query attention, a head size of its own, sliding windows, Gemma's
sandwich norms. Their `nn.Linear` weights are stored [out, in]: each maps onto ours by a transpose and a
reshape (k and v stacked into our [D, 2, K, H]); the table `_BLOCK_NAMES` names them, and a family renames a few
of its own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt.errors import ConfigError, MissingInput
from gpt.model.config import GPTConfig
from gpt.model.families import Family, by_model_type, holding
from gpt.model.hf_files import check_tensor_shapes, read_config_json, read_safetensors, write_export
from gpt.model.llama_config import config_from_hf, config_to_hf
from gpt.model.parameters import BlockWeight, block_weights
from gpt.model.transformer import GPT, parameter
from gpt.tokenizer_json import TokenizerJson

__all__ = ["config_from_hf", "config_to_hf", "read_config", "load", "save"]

# Each block weight's Hugging Face names in Llama's files ({} the layer): one, or k and v to stack. A family
# names some of its own (`Family.renamed`: Gemma's sandwich norms).
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


def _block_names(family: Family) -> dict[str, str | tuple[str, ...]]:
    """Each block weight's names in `family`'s files: Llama's, less those it renames."""
    return {**_BLOCK_NAMES, **family.renamed}


def _ours(w: BlockWeight, array: np.ndarray, config: GPTConfig) -> np.ndarray:
    """A Hugging Face block weight in our layout (`w.dims`, without the layer axis): a matrix stored [outputs,
    inputs] (torch's Linear; k's and v's stacked on a leading axis) or a vector (k's and v's biases stacked)."""
    if w.inputs:
        array = np.stack([a.T for a in array], axis=w.inputs) if w.separate else array.T  # [inputs, (2,) outputs]
    return array.reshape(w.dims(config))


def _theirs(w: BlockWeight, value: np.ndarray, config: GPTConfig) -> np.ndarray:
    """`_ours` undone: a block weight of ours (without the layer axis) as Hugging Face stores it (k's and v's
    stacked on a leading axis)."""
    if not w.inputs:
        return value.reshape(2, -1) if w.shape.startswith("2") else value.reshape(-1)
    inputs = math.prod(w.dims(config)[:w.inputs])
    if w.separate:  # [inputs, 2, outputs] -> k and v, each [outputs, inputs]
        return value.reshape(inputs, 2, -1).transpose(1, 2, 0)
    return value.reshape(inputs, -1).T


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
    names_of = _block_names(holding(config, reader="llama"))
    for w in block_weights(config):
        names, stacked = names_of[w.name], value(f"blocks.{w.name}")
        for i in range(config.n_layer):
            theirs = _theirs(w, stacked[i], config)
            for name, array in zip(names, theirs) if isinstance(names, tuple) else [(names, theirs)]:
                tensors[name.format(i)] = np.ascontiguousarray(array)
    return write_export(out_dir, tensors, {"config.json": json.dumps(hf_config, indent=2) + "\n",
                                           **(tokenizer_files or {})})


def _sizes(model: GPT, names_of: dict[str, str | tuple[str, ...]]) -> dict[str, int]:
    """How many values each of a Llama-shaped file's tensors holds for `model`'s (abstract) parameters: a block
    weight's per layer, split evenly between the names stacked into it (k and v)."""
    config = model.config
    sizes = {_MODEL_NAMES[path]: math.prod(parameter(model, path).shape)
             for path in ("wte", "lnf_scale", *(() if config.tied_head else ("lm_head",)))}
    for w in block_weights(config):
        names = names_of[w.name] if isinstance(names_of[w.name], tuple) else (names_of[w.name],)
        each = math.prod(parameter(model, f"blocks.{w.name}").shape[1:]) // len(names)
        sizes.update({name.format(i): each for name in names for i in range(config.n_layer)})
    return sizes


def read_config(source: str | os.PathLike, **overrides) -> GPTConfig:
    """The GPTConfig of a checkpoint directory, from its config.json alone."""
    return config_from_hf(read_config_json(Path(source)), **overrides)


def load(source: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None,
         hf_config: dict | None = None) -> GPT:
    """A GPT with the weights of a Hugging Face checkpoint directory of a Llama-shaped family (config.json and
    model.safetensors, or its shards and their index); dtype the compute dtype, param_dtype the storage
    dtype (default: dtype); `hf_config` its config.json where the caller has read it
    (`gpt.model.pretrained.Checkpoint`)."""
    directory = Path(source)
    hf = read_config_json(directory) if hf_config is None else hf_config
    config = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype or dtype)
    names_of = _block_names(by_model_type(hf))
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    check_tensor_shapes(directory, _sizes(model, names_of),  # before a byte of data is read
                       optional=lambda name: config.tied_head and name == _MODEL_NAMES["lm_head"])
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
        names = names_of[w.name]
        layers = [_ours(w, np.stack([take(n.format(i)) for n in names]) if isinstance(names, tuple)
                        else take(names.format(i)), config) for i in range(config.n_layer)]
        values[f"blocks.{w.name}"] = np.stack(layers)
    if tensors:
        raise ConfigError(f"{directory}: unexpected tensors {sorted(tensors)[:8]}")

    for path, value in values.items():
        param = parameter(model, path)
        if value.shape != param.shape:
            raise ConfigError(f"{directory}: {path} has shape {value.shape}, expected {param.shape}")
        param.set_value(jnp.asarray(value, dtype=config.storage_dtype))
    return model
