"""A GPT's weights laid out for decoding, made once and run by any number of engines and `generate` calls:
every kernel output-major in one dict per layer, optionally quantized (`--quantize`), and the int8 copy that
drafts for its own target."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig
from gpt.model.layouts import QUANTIZED_LAYOUTS, OutputMajor
from gpt.model.parameters import KERNELS
from gpt.model.sharding import shard_state
from gpt.model.transformer import GPT, Weights

__all__ = ["Decoder", "decoding_weights", "int8_draft_weights"]


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A GPT laid out for decoding, made once (at load) and run by any number of engines and `generate`
    calls: what `--quantize` chooses.

    Laying out copies (and may quantize) every matrix, the time of tens of decode steps (bench/RESULTS.md,
    "First token", under "CPU decoding: the few-rows kernels against llama.cpp"). An Engine or `generate`
    given a GPT lays it out at each construction or call; given a Decoder, never.

    Attributes:
      config: the model's shape.
      weights: `decoding_weights(model, quantize)`, sharded over `mesh` when there is one.
      quantize: "none", "int8", "int4" or "bf16".
      mesh: the device mesh the weights live on, or None for one device.
    """

    config: GPTConfig
    weights: Weights
    quantize: str
    mesh: Mesh | None

    def on_mesh(self):
        """A context in which programs over these weights run on their mesh (none without one)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @classmethod
    def of(cls, model: GPT | Decoder, quantize: str | None = None, mesh: Mesh | None = None) -> Decoder:
        """`model` laid out for decoding (quantize None means "none"), or `model` itself when it is a
        Decoder already, which must then agree with any `quantize` and `mesh` given."""
        if isinstance(model, Decoder):
            if quantize is not None and quantize != model.quantize:
                raise ConfigError(f"quantize={quantize!r} differs from the Decoder's {model.quantize!r}: "
                                  "make a Decoder with it, or leave quantize out")
            if mesh is not None and mesh is not model.mesh:
                raise ConfigError("mesh differs from the Decoder's: make a Decoder over it, or leave mesh out")
            return model
        quantize = "none" if quantize is None else quantize
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            if mesh is not None:
                graphdef, state = nnx.split(model)
                model = nnx.merge(graphdef, shard_state(model, state, mesh))
            return cls(model.config, decoding_weights(model, quantize), quantize, mesh)


def decoding_weights(model: GPT, quantize: str = "none") -> Weights:
    """The model's weights laid out for decoding, optionally quantized.

    One dict per layer, so that no stacked array is sliced inside the loop (XLA on CPU copies a layer's
    slice of a stacked array before each matmul, doubling the weight traffic that bounds a decode step),
    and every kernel `OutputMajor` ([out, in]: XLA on CPU runs the matrix-vector products of a small batch
    faster so). Made once per engine by small jitted programs, one per kind of matrix (the layer a traced
    index), so that the new layout is real memory (inside the decode jit, XLA would fold it away again) and
    each kind compiles once, not once per layer. Costs one copy of the block weights.

    quantize: "none" keeps float32 (`OutputMajor`); "int8" stores every matrix, the embedding and LM head
    included, as int8 with a float32 scale per output (`gpt.model.layouts.Int8Matrix`; the embedding
    lookup rescales the rows it reads, and a tied table is stored once for both uses); "int4" stores the blocks'
    matrices as int4 with a float32 scale per group of inputs (`Int4Matrix`) and the embedding and LM head as
    int8 (as llama.cpp's Q4_K_M keeps its output matrix at 6 bits: the logits' error is the head's); "bf16"
    stores them in bfloat16 (`Bf16Matrix`). Biases, LayerNorms, learned positions and the KV cache stay in the compute
    dtype, and so do all activations.
    """
    if quantize not in ("none", *QUANTIZED_LAYOUTS):
        raise ConfigError(f"quantize must be one of none, {', '.join(QUANTIZED_LAYOUTS)}; got {quantize!r}")
    weights = model.weights()
    layers = []
    stacked = weights.layers
    # The queries', keys' and values' kernels as the one matrix the block multiplies by (`qkv_kernel`).
    fused = jnp.concatenate([stacked["q_kernel"].reshape(*stacked["q_kernel"].shape[:2], -1),
                             stacked["kv_kernel"].reshape(*stacked["kv_kernel"].shape[:2], -1)], axis=-1)
    for layer in range(model.config.n_layer):  # each kernel sliced once, by the program that lays it out
        laid_out = {name: None if a is None or name in ("q_kernel", "kv_kernel")
                    else _kernel_layout(a, layer, quantize, KERNELS[name].inputs)
                    if name in KERNELS else _layer_of(a, layer) for name, a in stacked.items()}
        layers.append({**laid_out, "qkv_kernel": _kernel_layout(fused, layer, quantize, 1)})
    if quantize == "none":
        return dataclasses.replace(weights, layers=tuple(layers))
    table_layout = _TABLE_LAYOUT.get(quantize, quantize)
    table = _matrix_layout(weights.embedding, table_layout)  # [V, D] is already output-major for the head
    head = table if model.config.tied_head else _matrix_layout(weights.head.matrix_KD, table_layout)
    return dataclasses.replace(weights, layers=tuple(layers), embedding=table, head=head)


# The embedding's and head's layout where it is not the blocks'.
_TABLE_LAYOUT = {"int4": "int8"}


def _store(matrix_KD: jax.Array, quantize: str):
    return QUANTIZED_LAYOUTS[quantize].quantize(matrix_KD) if quantize != "none" else OutputMajor(matrix_KD)


@jax.jit
def _layer_of(stacked: jax.Array, layer: jax.Array) -> jax.Array:
    """Layer `layer` of a stacked array (a bias or a norm's scale), as an array of its own."""
    return stacked[layer]


@functools.partial(jax.jit, static_argnames=("quantize", "input_axes"))
def _kernel_layout(stacked: jax.Array, layer: jax.Array, quantize: str, input_axes: int):
    """Layer `layer` of a stacked kernel ([L, inputs..., outputs...]) as an output-major matrix [K, D] in
    the `quantize` layout."""
    kernel = stacked[layer]
    return _store(kernel.reshape(math.prod(kernel.shape[:input_axes]), -1).T, quantize)


_matrix_layout = jax.jit(_store, static_argnames="quantize")


def check_int8_draft(quantize: str | None) -> None:
    """ConfigError when a target whose weights are laid out as `quantize` cannot draft for itself in int8 (an
    int8 or int4 target reads as few bytes a token as its draft would, or fewer)."""
    if quantize in ("int8", "int4"):
        raise ConfigError(f"draft int8 needs the target's weights in float (quantize none or bf16), not {quantize}")


def int8_draft_weights(decoder: Decoder) -> Weights:
    """The decoder's float32 (or bfloat16) weights with every matrix in int8 (`decoding_weights`' "int8"
    layout), for drafting: its own tokens, a few times faster, that mostly agree with the target's.
    ConfigError for a decoder whose weights are int8 already."""
    check_int8_draft(decoder.quantize)
    float_matrix = lambda a: a.matrix_KD if isinstance(a, OutputMajor) else a.dequantize()  # noqa: E731
    weights = decoder.weights
    layers = tuple({name: _matrix_layout(float_matrix(a), "int8") if hasattr(a, "matmul") else a
                    for name, a in layer.items()} for layer in weights.layers)
    table = _matrix_layout(weights.embedding if isinstance(weights.embedding, jax.Array)
                           else weights.embedding.dequantize(), "int8")
    head = table if decoder.config.tied_head else _matrix_layout(float_matrix(weights.head), "int8")
    return dataclasses.replace(weights, layers=layers, embedding=table, head=head)
