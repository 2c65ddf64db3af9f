"""Every weight of a decoder block, declared once: its shape, logical axes, init, the axes its matmul reduces
over, when a model has it, and its name and shape in a Hugging Face GPT-2 checkpoint. `Blocks` builds its parameters from this table, and
GPT-2's import and export, Muon's matrix axes, decoding's kernel layout and the tests read it; nothing else
restates a block weight's facts.

Shapes are without the leading `layers` axis that `Blocks` stacks them on. Letters: D model width, N (query)
heads, K key and value heads, H head dim, F MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from gpt.model.config import GPTConfig

__all__ = ["BlockWeight", "BLOCK_WEIGHTS", "KERNELS", "block_weights", "weight_tensors"]


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """One kind of block weight.

    name: the `Blocks` attribute (and the parameter path's last part).
    shape: its letters, e.g. "D2KH" ("2" a literal 2: k and v).
    axes: its logical axis names (`gpt.model.sharding.RULES`), one per letter (None: not sharded).
    init: "normal" (std 0.02, or 0.02 / sqrt(2L) for a projection that writes into the residual stream:
      `residual`), "ones" or "zeros".
    when: the `GPTConfig` flag (or property) it exists under ("" for every model), e.g. "bias" (`exists`).
    norm: a LayerNorm's weight, which the forward reads in float32 (every other weight in the compute dtype).
    inputs: for a matrix, how many leading axes a matmul reduces over (the rest are its outputs); 0 else.
    separate: for a matrix, leading output axes that hold separate matrices (k and v), which Muon
      orthogonalizes apart.
    hf: its name in a Hugging Face GPT-2 checkpoint, {} for the layer (its shape there: `hf_dims`); "" for a
      weight GPT-2 has not (`gpt.model.gpt2` refuses a model that has one). Weights of one name are its blocks
      of columns, in this table's order (GPT-2's c_attn: the queries', then the keys' and values').
    """

    name: str
    shape: str
    axes: tuple[str | None, ...]
    init: Literal["normal", "ones", "zeros"]
    hf: str
    when: str = ""
    norm: bool = False
    residual: bool = False
    inputs: int = 0
    separate: int = 0

    def dims(self, config: GPTConfig) -> tuple[int, ...]:
        """Its shape in `config`, without the layer axis."""
        size = {"D": config.n_embd, "N": config.n_head, "K": config.kv_heads, "H": config.head_dim,
                "F": config.mlp_dim, "2": 2}
        return tuple(size[letter] for letter in self.shape)

    def exists(self, config: GPTConfig) -> bool:
        """Whether a model of `config` has this weight (the one place that says so)."""
        return not self.when or bool(getattr(config, self.when))

    def hf_dims(self, config: GPTConfig) -> tuple[int, ...]:
        """Its shape in a Hugging Face GPT-2 checkpoint, from its letters: a matrix as [inputs, outputs]
        (GPT-2's Conv1D), anything else flat."""
        dims = self.dims(config)
        if not self.inputs:
            return (math.prod(dims),)
        return math.prod(dims[: self.inputs]), math.prod(dims[self.inputs:])


BLOCK_WEIGHTS = (  # in the order `Blocks` makes them (the order its random init draws in)
    BlockWeight("ln1_scale", "D", ("embed",), "ones", "h.{}.ln_1.weight", norm=True),
    BlockWeight("ln1_bias", "D", ("embed",), "zeros", "h.{}.ln_1.bias", when="norm_bias", norm=True),
    BlockWeight("q_kernel", "DNH", ("embed", "heads", "head_dim"), "normal", "h.{}.attn.c_attn.weight", inputs=1),
    BlockWeight("kv_kernel", "D2KH", ("embed", None, "kv_heads", "head_dim"), "normal", "h.{}.attn.c_attn.weight",
                inputs=1, separate=1),
    BlockWeight("q_bias", "NH", ("heads", "head_dim"), "zeros", "h.{}.attn.c_attn.bias", when="has_qkv_bias"),
    BlockWeight("kv_bias", "2KH", (None, "kv_heads", "head_dim"), "zeros", "h.{}.attn.c_attn.bias",
                when="has_qkv_bias"),
    BlockWeight("q_norm_scale", "H", ("head_dim",), "ones", "", when="qk_norm", norm=True),
    BlockWeight("k_norm_scale", "H", ("head_dim",), "ones", "", when="qk_norm", norm=True),
    BlockWeight("out_kernel", "NHD", ("heads", "head_dim", "embed"), "normal", "h.{}.attn.c_proj.weight",
                residual=True, inputs=2),
    BlockWeight("out_bias", "D", ("embed",), "zeros", "h.{}.attn.c_proj.bias", when="bias"),
    BlockWeight("attn_out_norm_scale", "D", ("embed",), "ones", "", when="sandwich_norm", norm=True),
    BlockWeight("ln2_scale", "D", ("embed",), "ones", "h.{}.ln_2.weight", norm=True),
    BlockWeight("ln2_bias", "D", ("embed",), "zeros", "h.{}.ln_2.bias", when="norm_bias", norm=True),
    BlockWeight("gate_kernel", "DF", ("embed", "mlp"), "normal", "", when="gated_mlp", inputs=1),
    BlockWeight("fc_kernel", "DF", ("embed", "mlp"), "normal", "h.{}.mlp.c_fc.weight", inputs=1),
    BlockWeight("fc_bias", "F", ("mlp",), "zeros", "h.{}.mlp.c_fc.bias", when="bias"),
    BlockWeight("proj_kernel", "FD", ("mlp", "embed"), "normal", "h.{}.mlp.c_proj.weight", residual=True, inputs=1),
    BlockWeight("proj_bias", "D", ("embed",), "zeros", "h.{}.mlp.c_proj.bias", when="bias"),
    BlockWeight("mlp_out_norm_scale", "D", ("embed",), "ones", "", when="sandwich_norm", norm=True),
)

KERNELS = {w.name: w for w in BLOCK_WEIGHTS if w.inputs}  # the matrices, by name


def block_weights(config: GPTConfig) -> tuple[BlockWeight, ...]:
    """The block weights a model of `config` has (`BlockWeight.exists`)."""
    return tuple(w for w in BLOCK_WEIGHTS if w.exists(config))


def weight_tensors(config: GPTConfig) -> list[tuple[BlockWeight, ...]]:
    """The block weights a model of `config` has, as GPT-2 stores them: the weights of one Hugging Face name
    together, its blocks of columns in the table's order (c_attn's: the queries', then the keys' and values'),
    each other weight alone. `Blocks` draws each such tensor's init at once (a GPT-2's c_attn the one array it
    always was), and GPT-2's import and export read and write them."""
    tensors: dict[str, list[BlockWeight]] = {}
    for w in block_weights(config):
        tensors.setdefault(w.hf or w.name, []).append(w)
    return [tuple(group) for group in tensors.values()]
