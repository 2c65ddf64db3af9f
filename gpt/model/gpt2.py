"""OpenAI GPT-2 checkpoints in the Hugging Face format: load them into a GPT, and write a GPT back.

A checkpoint is a directory with `config.json` and `model.safetensors` (or `pytorch_model.bin`, read with
a restricted unpickler that can only rebuild tensors, so loading never executes pickled code).

Hugging Face's GPT-2 uses `Conv1D` layers whose weights are stored [in, out] -- already the layout of a
JAX kernel -- so every tensor maps onto ours by a reshape alone (the fused qkv [D, 3D] becomes
[D, 3, N, H]); the one table `_TABLE` below names them all.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import zipfile
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gpt.errors import ConfigError, MissingInput, first_line
from gpt.model.config import GPTConfig
from gpt.model.config_json import MAX_CONTEXT, integer, number
from gpt.model.families import by_model_type
from gpt.model.hf_files import check_tensor_shapes, hub_snapshot, read_config_json, read_safetensors, write_export
from gpt.model.parameters import BlockWeight, weight_tensors
from gpt.model.transformer import GPT, parameter
from gpt.tokenizer import hf_tokenizer_files

__all__ = ["load", "save", "config_from_hf", "resolve"]

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
FAMILY = by_model_type({"model_type": "gpt2"})  # its registry entry (`gpt.model.families`)

# The model's own weights: (our parameter path, Hugging Face name, its shape there). The block weights' shapes are
# `gpt.model.parameters`', their names in GPT-2's format below (`_table`).
_MODEL_WEIGHTS = (
    ("wte", "wte.weight", lambda c: (c.vocab_size, c.n_embd)),
    ("wpe", "wpe.weight", lambda c: (c.block_size, c.n_embd)),
    ("lnf_scale", "ln_f.weight", lambda c: (c.n_embd,)),
    ("lnf_bias", "ln_f.bias", lambda c: (c.n_embd,)),
)
# Buffers that older checkpoints carry (the causal mask) and the tied LM head: not parameters of ours.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# Each block weight's name in a GPT-2 checkpoint, {} for the layer; a weight missing here is one GPT-2's format has
# not (the registry's `Family.holds` refuses a model that has one). Weights drawn as one tensor (`drawn_with`) are
# one name's blocks of columns (c_attn: the queries', then the keys' and values').
BLOCK_NAMES = {
    "ln1_scale": "h.{}.ln_1.weight", "ln1_bias": "h.{}.ln_1.bias",
    "q_kernel": "h.{}.attn.c_attn.weight", "kv_kernel": "h.{}.attn.c_attn.weight",
    "q_bias": "h.{}.attn.c_attn.bias", "kv_bias": "h.{}.attn.c_attn.bias",
    "out_kernel": "h.{}.attn.c_proj.weight", "out_bias": "h.{}.attn.c_proj.bias",
    "ln2_scale": "h.{}.ln_2.weight", "ln2_bias": "h.{}.ln_2.bias",
    "fc_kernel": "h.{}.mlp.c_fc.weight", "fc_bias": "h.{}.mlp.c_fc.bias",
    "proj_kernel": "h.{}.mlp.c_proj.weight", "proj_bias": "h.{}.mlp.c_proj.bias",
}


def _hf_dims(weight: BlockWeight, config: GPTConfig) -> tuple[int, ...]:
    """A block weight's shape in a GPT-2 checkpoint, from its letters: a matrix as [inputs, outputs] (GPT-2's
    Conv1D), anything else flat."""
    dims = weight.dims(config)
    if not weight.inputs:
        return (math.prod(dims),)
    return math.prod(dims[: weight.inputs]), math.prod(dims[weight.inputs:])


def _table(config: GPTConfig) -> list[tuple[str, bool, tuple[int, ...], list[tuple[str, int]]]]:
    """(Hugging Face name with {} for the layer, is it per layer, its Hugging Face shape, our parameters in it:
    (path, how many of its last axis's columns)) for every tensor a model of `config` has: the model's own, then
    the blocks'. Block weights that share a name are its blocks of columns in their table's order (c_attn: the
    queries', then the keys' and values')."""
    table = [(hf, False, shape(config), [(path, shape(config)[-1])]) for path, hf, shape in _MODEL_WEIGHTS]
    for tensor in weight_tensors(config):
        parts = [(f"blocks.{w.name}", _hf_dims(w, config)[-1]) for w in tensor]
        shape = (*_hf_dims(tensor[0], config)[:-1], sum(width for _, width in parts))
        table.append((BLOCK_NAMES[tensor[0].name], True, shape, parts))
    return table


# ----------------------------------------------------------------------------------------------- config

def config_from_hf(hf: dict, **overrides) -> GPTConfig:
    """A GPTConfig from a Hugging Face GPT-2 `config.json`; ConfigError in one line naming a field it cannot hold,
    or another family's model."""
    family = by_model_type(hf)  # one that is no family's: a refusal naming those there are
    if family is not FAMILY:
        raise ConfigError(f"config.json: model_type {family.model_type!r} is {family.title}'s, not GPT-2's "
                          f"(gpt.model.llama reads it)")
    requirements = {
        "activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (True, (True,)),
        "scale_attn_by_inverse_layer_idx": (False, (False,)),
        "tie_word_embeddings": (True, (True,)),
    }
    for field, (default, allowed) in requirements.items():
        if hf.get(field, default) not in allowed:
            raise ConfigError(f"config.json: {field}={hf.get(field)!r} is not supported (expected one of {allowed})")
    n_embd = integer(hf, "n_embd", 768)
    n_inner = integer(hf, "n_inner", 4 * n_embd) if hf.get("n_inner") is not None else 4 * n_embd
    if n_inner % n_embd:
        raise ConfigError(f"config.json: n_inner={n_inner} must be a multiple of n_embd={n_embd}")
    fields = dict(
        vocab_size=integer(hf, "vocab_size", 50257), block_size=integer(hf, "n_positions", 1024, MAX_CONTEXT),
        n_layer=integer(hf, "n_layer", 12), n_head=integer(hf, "n_head", 12), n_embd=n_embd,
        layer_norm_epsilon=number(hf, "layer_norm_epsilon", 1e-5), mlp_ratio=n_inner // n_embd,
        position="learned", bias=True,
    )
    return GPTConfig(**{**fields, **overrides})


def config_to_hf(config: GPTConfig) -> dict:
    """The Hugging Face `config.json` of a GPT-2; ConfigError naming every field its format cannot hold (the
    registry's `Family.holds`)."""
    unlike = FAMILY.refusals(config)
    if unlike:
        raise ConfigError(f"the GPT-2 format cannot hold this model: {', '.join(unlike)}")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_inner": config.mlp_dim, "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True,
        "scale_attn_weights": True, "initializer_range": 0.02, "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------------------------- files

def resolve(source: str | os.PathLike) -> Path:
    """The checkpoint directory for a path, or for a hub name found in the local Hugging Face cache."""
    path = Path(source)
    if path.is_dir():
        return path
    if str(source) in HUB_NAMES:
        return hub_snapshot(str(source), also=f"openai-community/{source}")
    raise MissingInput(
        f"{str(source)!r} is neither a directory nor a GPT-2 hub name ({', '.join(HUB_NAMES)})"
    )


_TORCH_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def _rebuild_tensor(storage, offset, size, stride, *_unused):
    """The tensor `torch._utils._rebuild_tensor_v2` would build, after checking that every element it
    addresses lies inside its storage (a crafted file could otherwise read memory beyond it)."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise pickle.UnpicklingError("a tensor's storage is not a storage")
    size, stride = tuple(size), tuple(stride)
    numbers = (offset, *size, *stride)
    if len(size) != len(stride) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise pickle.UnpicklingError(f"a tensor has malformed offset/size/stride {offset}, {size}, {stride}")
    if offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise pickle.UnpicklingError(f"a tensor has a negative offset, size or stride: {offset}, {size}, {stride}")
    if 0 not in size:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.size:
            raise pickle.UnpicklingError(
                f"a tensor of size {size} (offset {offset}, stride {stride}) reaches element {last} of a "
                f"storage of {storage.size}")
    elif offset > storage.size:
        raise pickle.UnpicklingError(f"a tensor's offset {offset} is beyond its storage of {storage.size}")
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=tuple(s * itemsize for s in stride)
    )
    return np.array(view)


class _TensorOnlyUnpickler(pickle.Unpickler):
    """Rebuilds a PyTorch state dict as numpy arrays; any other object in the pickle is refused."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _TORCH_STORAGE_DTYPES:
            return _TORCH_STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only tensors may be in a checkpoint")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        if dtype not in _TORCH_STORAGE_DTYPES.values():
            raise pickle.UnpicklingError(f"a storage of unknown type {dtype!r}")
        try:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
        except KeyError:
            raise pickle.UnpicklingError(f"a storage names a missing record {key!r}") from None
        storage = np.frombuffer(raw, dtype=np.dtype(dtype))
        if not isinstance(numel, int) or storage.size != numel:
            raise pickle.UnpicklingError(f"storage {key!r} holds {storage.size} elements, but claims {numel!r}")
        return storage


def read_torch_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Tensors of a `torch.save` zip file as numpy arrays, without executing any pickled code; ConfigError in one
    line for a file that holds anything else, or is not such an archive."""
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"{path} is not a zip archive: it is a legacy torch pickle (torch < 1.6), which is not read; "
            f"re-save the model as model.safetensors (`model.save_pretrained(dir)` in transformers)")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ConfigError(f"{path}: not a torch.save zip archive (found {len(pickles)} data.pkl entries)")
            prefix = pickles[0][: -len("/data.pkl")]
            with archive.open(pickles[0]) as file:
                return dict(_TensorOnlyUnpickler(file, archive, prefix).load())
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError) as error:  # whatever a crafted pickle makes the restricted unpickler raise
        raise ConfigError(f"{path} is refused: {first_line(error)}") from None


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = read_safetensors(directory)
    if tensors is None and (directory / "pytorch_model.bin").is_file():
        tensors = read_torch_state_dict(directory / "pytorch_model.bin")
    elif tensors is None:
        raise MissingInput(f"{directory} has neither model.safetensors nor pytorch_model.bin")
    # GPT2LMHeadModel prefixes its names with "transformer."; GPT2Model (the hub's own files) does not.
    return {name.removeprefix("transformer."): array for name, array in tensors.items()}


# ----------------------------------------------------------------------------------------------- load / save

def read_config(source: str | os.PathLike, **overrides) -> GPTConfig:
    """The GPTConfig of a checkpoint directory or cached hub name, from its config.json alone."""
    return config_from_hf(read_config_json(resolve(source)), **overrides)


def load(source: str | os.PathLike, dtype: str = "float32", param_dtype: str | None = None,
         hf_config: dict | None = None) -> GPT:
    """A GPT with the weights of a Hugging Face GPT-2 checkpoint.

    Args:
      source: a directory (config.json + model.safetensors or pytorch_model.bin), or a hub name
        (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`) already in the local Hugging Face cache.
      dtype: the compute dtype; param_dtype: the storage dtype (defaults to dtype).
      hf_config: its config.json, where the caller has read it (`gpt.model.pretrained.Checkpoint`).
    """
    directory = resolve(source)
    hf_config = read_config_json(directory) if hf_config is None else hf_config
    config = config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype or dtype)
    expected = {hf.format(i): shape for hf, per_layer, shape, _ in _table(config)
                for i in (range(config.n_layer) if per_layer else [0])}
    check_tensor_shapes(directory, expected, rename=lambda name: name.removeprefix("transformer."),  # before the data
                       optional=lambda name: name == "lm_head.weight" or name.endswith(_IGNORED_SUFFIXES))
    tensors = _read_tensors(directory)

    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not np.array_equal(lm_head, tensors.get("wte.weight")):
        raise ConfigError("lm_head.weight differs from wte.weight, but GPT-2's LM head is tied to the embedding")
    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        del tensors[name]

    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    for hf_name, per_layer, expected, parts in _table(config):
        names = [hf_name.format(i) for i in range(config.n_layer)] if per_layer else [hf_name]
        arrays = []
        for name in names:
            if name not in tensors:
                raise ConfigError(f"{directory}: missing tensor {name!r}")
            array = tensors.pop(name)
            if array.shape != expected:
                raise ConfigError(f"{directory}: tensor {name!r} has shape {array.shape}, expected {expected}")
            arrays.append(array)
        whole = np.stack(arrays) if per_layer else arrays[0]
        columns = np.cumsum([width for _, width in parts])[:-1]
        for (path, _), value in zip(parts, np.split(whole, columns, axis=-1)):
            param = parameter(model, path)
            param.set_value(jnp.asarray(np.asarray(value.reshape(param.shape), np.float32), dtype=config.storage_dtype))
    if tensors:
        raise ConfigError(f"{directory}: unexpected tensors {sorted(tensors)[:8]}")
    return model


def save(model: GPT, out_dir: str | os.PathLike, tokenizer_files: dict[str, str] | None = None) -> Path:
    """Write `model` as a Hugging Face GPT-2 checkpoint (config.json + model.safetensors, float32) with its
    tokenizer's files (by name; default GPT-2's vocab.json, merges.txt and tokenizer_config.json:
    `gpt.tokenizer.hf_tokenizer_files`), so that transformers' `AutoModelForCausalLM` and `AutoTokenizer` load
    the directory offline.

    Never destroys, and appears whole or not at all (`gpt.model.hf_files.write_export`).
    """
    config = model.config
    hf_config = config_to_hf(config)
    tensors = {}
    for hf_name, per_layer, shape, parts in _table(config):
        layers = config.n_layer if per_layer else 1
        values = [np.asarray(parameter(model, path)[...], np.float32).reshape(layers, *shape[:-1], width)
                  for path, width in parts]
        whole = np.concatenate(values, axis=-1)
        for i in range(layers):
            name = hf_name.format(i) if per_layer else hf_name
            tensors[f"transformer.{name}"] = np.ascontiguousarray(whole[i])
    if tokenizer_files is None:
        tokenizer_files = hf_tokenizer_files(config.block_size)
    return write_export(out_dir, tensors, {"config.json": json.dumps(hf_config, indent=2) + "\n", **tokenizer_files})
