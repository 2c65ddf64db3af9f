"""Each block weight declared once (`gpt.model.parameters`): every preset and recipe builds exactly the table's
weights, and every consumer (GPT-2's names, Muon's axes, decoding's layout, the parameter count) agrees
with it."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.inference.decoder import decoding_weights
from gpt.model import gpt2
from gpt.model.config import PRESETS
from gpt.model.parameters import KERNELS, block_weights
from gpt.model.transformer import num_params
from gpt.train.optimizer import muon_axes
from gpt.train.recipes import RECIPES

# Llama's and Qwen2's choices (`gpt.model.llama`): RMSNorm, a gated MLP of its own width, biases on q, k and v alone.
LLAMA_SHAPED = dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", mlp_width=100, bias=False,
                    qkv_bias=True, tied_head=False)
# Gemma 3's (`gpt.model.families`): QK-norm, sandwich norms of 1 + scale, a GeGLU MLP, local and global layers.
GEMMA_SHAPED = dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="gelu", mlp_width=100, bias=False,
                    qk_norm=True, sandwich_norm=True, norm_plus_one=True, scale_embeddings=True, layer_kinds="lg",
                    sliding_window=8, n_kv_head=2)


def configs():
    return [pytest.param(GPTConfig.preset(preset, **RECIPES[recipe].model), id=f"{preset}-{recipe}")
            for preset in PRESETS for recipe in RECIPES] + [
        pytest.param(GPTConfig.preset("tiny", **LLAMA_SHAPED), id="tiny-llama-shaped"),
        pytest.param(GPTConfig.preset("tiny", **GEMMA_SHAPED), id="tiny-gemma-shaped")]


def as_tuple(axes):
    return (axes,) if isinstance(axes, int) else tuple(axes)


@pytest.mark.parametrize("config", configs())
def test_every_preset_builds_the_tables_weights_and_every_consumer_agrees(config):
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    blocks = nnx.state(abstract.blocks, nnx.Param)
    built = {name: param for name, param in blocks.items() if param is not None}
    declared = block_weights(config)
    assert set(built) == {w.name for w in declared}
    for w in declared:
        param = built[w.name]
        assert param.shape == (config.n_layer, *w.dims(config)) and len(w.axes) == len(w.shape)
        assert param.get_metadata()["axes"] == ("layers", *w.axes)
    # GPT-2's checkpoint names (for a model GPT-2's format holds): each block weight in the tensor of its name, as
    # its block of columns; a tensor's blocks fill it.
    if all(w.name in gpt2.BLOCK_NAMES for w in declared):
        hf = [(name, shape, parts) for name, per_layer, shape, parts in gpt2._table(config) if per_layer]
        assert [path for *_, parts in hf for path, _ in parts] == [f"blocks.{w.name}" for w in declared]
        assert [name for name, *_ in hf] == list(dict.fromkeys(gpt2.BLOCK_NAMES[w.name] for w in declared))
        for name, shape, parts in hf:
            weights = [w for w in declared if gpt2.BLOCK_NAMES[w.name] == name]
            assert sum(width for _, width in parts) == shape[-1]
            assert math.prod(shape) == sum(math.prod(w.dims(config)) for w in weights)
            assert all((len(shape) == 2) == bool(w.inputs) for w in weights)
    # Muon: the layer axis, the separate matrices, the inputs and the outputs are all of a kernel's axes, once.
    axes = muon_axes({name: jax.ShapeDtypeStruct(param.shape, param.dtype) for name, param in built.items()})
    for name, w in ((name, w) for name, w in KERNELS.items() if w.exists(config)):
        reduced, outputs = as_tuple(axes[name].reduction_axis), as_tuple(axes[name].output_axis)
        separate = tuple(range(1 + w.inputs, 1 + w.inputs + w.separate))
        assert sorted((0, *separate, *reduced, *outputs)) == list(range(1 + len(w.shape)))
        assert reduced == tuple(range(1, 1 + w.inputs))
    for name in set(built) - set(KERNELS):
        assert axes[name] is None
    # The count: every parameter the model makes, a tied head once.
    assert num_params(config) == sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("choices", [*(RECIPES[recipe].model for recipe in RECIPES), LLAMA_SHAPED, GEMMA_SHAPED],
                         ids=[*RECIPES, "llama-shaped", "gemma-shaped"])
def test_decodings_matrices_are_the_tables_kernels_read_as_inputs_by_outputs(choices):
    config = GPTConfig.preset("tiny", **choices)
    model = GPT(config, rngs=nnx.Rngs(0))
    layer = decoding_weights(model).layers[0]
    stacked = model.weights().layers
    # Each kernel read as inputs by outputs, the queries' and the keys' and values' as the one matrix the block
    # multiplies by (`qkv_kernel`: its rows theirs, in the table's order).
    fused = ("q_kernel", "kv_kernel")
    wanted = {}
    for name, w in ((name, w) for name, w in KERNELS.items() if w.exists(config)):
        dims = w.dims(config)
        inputs, outputs = math.prod(dims[: w.inputs]), math.prod(dims[w.inputs:])
        wanted[name] = np.asarray(stacked[name][0]).reshape(inputs, outputs).T
        if name not in fused:
            matrix = np.asarray(layer[name].matrix_KD)
            assert matrix.shape == (outputs, inputs)
            np.testing.assert_array_equal(matrix, wanted[name])
    np.testing.assert_array_equal(np.asarray(layer["qkv_kernel"].matrix_KD), np.concatenate([wanted[n] for n in fused]))
