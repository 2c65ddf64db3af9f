"""Every weight of a decoder block, declared once: its shape, logical axes, init, the axes its matmul reduces
over and when a model has it. `Blocks` builds its parameters from this table, and each family's import and export
(which name the weights in their formats: `gpt.model.gpt2`, `gpt.model.llama`), Muon's matrix axes, decoding's
kernel layout and the tests read it; nothing else restates a block weight's facts.

Shapes are without the leading `layers` axis that `Blocks` stacks them on. Letters: D model width, N (query)
heads, K key and value heads, H head dim, F MLP width.
"""

from __future__ import annotations

import dataclasses
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
    drawn_with: the tensor whose blocks of columns it is drawn as at init, in this table's order, with the other
      weights of that name ("qkv": the queries', then the keys' and values', one array as GPT-2's c_attn is, so a
      run's initial weights are what they always were); "" for a weight drawn alone.
    """

    name: str
    shape: str
    axes: tuple[str | None, ...]
    init: Literal["normal", "ones", "zeros"]
    when: str = ""
    norm: bool = False
    residual: bool = False
    inputs: int = 0
    separate: int = 0
    drawn_with: str = ""

    def dims(self, config: GPTConfig) -> tuple[int, ...]:
        """Its shape in `config`, without the layer axis."""
        size = {"D": config.n_embd, "N": config.n_head, "K": config.kv_heads, "H": config.head_dim,
                "F": config.mlp_dim, "2": 2}
        return tuple(size[letter] for letter in self.shape)

    def exists(self, config: GPTConfig) -> bool:
        """Whether a model of `config` has this weight (the one place that says so)."""
        return not self.when or bool(getattr(config, self.when))


BLOCK_WEIGHTS = (  # in the order `Blocks` makes them (the order its random init draws in)
    BlockWeight("ln1_scale", "D", ("embed",), "ones", norm=True),
    BlockWeight("ln1_bias", "D", ("embed",), "zeros", when="norm_bias", norm=True),
    BlockWeight("q_kernel", "DNH", ("embed", "heads", "head_dim"), "normal", inputs=1, drawn_with="qkv"),
    BlockWeight("kv_kernel", "D2KH", ("embed", None, "kv_heads", "head_dim"), "normal", inputs=1, separate=1,
                drawn_with="qkv"),
    BlockWeight("q_bias", "NH", ("heads", "head_dim"), "zeros", when="has_qkv_bias", drawn_with="qkv_bias"),
    BlockWeight("kv_bias", "2KH", (None, "kv_heads", "head_dim"), "zeros", when="has_qkv_bias",
                drawn_with="qkv_bias"),
    BlockWeight("q_norm_scale", "H", ("head_dim",), "ones", when="qk_norm", norm=True),
    BlockWeight("k_norm_scale", "H", ("head_dim",), "ones", when="qk_norm", norm=True),
    BlockWeight("out_kernel", "NHD", ("heads", "head_dim", "embed"), "normal", residual=True, inputs=2),
    BlockWeight("out_bias", "D", ("embed",), "zeros", when="bias"),
    BlockWeight("attn_out_norm_scale", "D", ("embed",), "ones", when="sandwich_norm", norm=True),
    BlockWeight("ln2_scale", "D", ("embed",), "ones", norm=True),
    BlockWeight("ln2_bias", "D", ("embed",), "zeros", when="norm_bias", norm=True),
    BlockWeight("gate_kernel", "DF", ("embed", "mlp"), "normal", when="gated_mlp", inputs=1),
    BlockWeight("fc_kernel", "DF", ("embed", "mlp"), "normal", inputs=1),
    BlockWeight("fc_bias", "F", ("mlp",), "zeros", when="bias"),
    BlockWeight("proj_kernel", "FD", ("mlp", "embed"), "normal", residual=True, inputs=1),
    BlockWeight("proj_bias", "D", ("embed",), "zeros", when="bias"),
    BlockWeight("mlp_out_norm_scale", "D", ("embed",), "ones", when="sandwich_norm", norm=True),
)

KERNELS = {w.name: w for w in BLOCK_WEIGHTS if w.inputs}  # the matrices, by name


def block_weights(config: GPTConfig) -> tuple[BlockWeight, ...]:
    """The block weights a model of `config` has (`BlockWeight.exists`)."""
    return tuple(w for w in BLOCK_WEIGHTS if w.exists(config))


def weight_tensors(config: GPTConfig) -> list[tuple[BlockWeight, ...]]:
    """The block weights a model of `config` has, as they are drawn at init: the weights `drawn_with` one tensor
    together, its blocks of columns in the table's order (the queries', then the keys' and values'), each other
    weight alone. `Blocks` draws each such tensor's init at once (a GPT-2's c_attn the one array it always was),
    and GPT-2's import and export read and write them as its format stores them."""
    tensors: dict[str, list[BlockWeight]] = {}
    for w in block_weights(config):
        tensors.setdefault(w.drawn_with or w.name, []).append(w)
    return [tuple(group) for group in tensors.values()]
