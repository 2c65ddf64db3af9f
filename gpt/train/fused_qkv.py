"""Checkpoints written before grouped-query attention, read into today's parameters.

Those runs kept the queries', keys' and values' kernel as one parameter, `qkv_kernel` [L, D, 3, N, H] (and
`qkv_bias` [L, 3, N, H]); today's are `q_kernel` [L, D, N, H] and `kv_kernel` [L, D, 2, K, H] with K = N
for such a model (`gpt.model.parameters`). The split is exact, and the same for every tree that mirrors the
parameters (Adam's moments, Muon's momentum), so an older run restores, resumes bitwise, samples and exports.
A checkpoint's record says which it is: the model config of an older one has no `n_kv_head`.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["written_fused", "fused", "unfused"]

# The older parameter: (today's query part, today's key-value part, the axis of q, k and v in it).
_PARTS = {"qkv_kernel": ("q_kernel", "kv_kernel", 2), "qkv_bias": ("q_bias", "kv_bias", 1)}


def written_fused(record: dict) -> bool:
    """Whether a checkpoint's JSON record is of a run that kept `qkv_kernel` (no `n_kv_head` in its config)."""
    return "n_kv_head" not in record.get("model_config", {"n_kv_head": None})


def fused(tree):
    """An abstract tree of today's layout (`jax.ShapeDtypeStruct`s with shardings) as the older layout's: each
    mapping that holds `q_kernel` and `kv_kernel` holds `qkv_kernel` instead, sharded as `q_kernel`."""

    def fuse(node):
        if not _holds(node, "q_kernel"):
            return node
        node = dict(node)
        for old, (q, kv, axis) in _PARTS.items():
            if q in node:
                q_leaf, _ = node.pop(q), node.pop(kv)
                node[old] = q_leaf if not hasattr(q_leaf, "shape") else jax.ShapeDtypeStruct(
                    (*q_leaf.shape[:axis], 3, *q_leaf.shape[axis:]), q_leaf.dtype,
                    sharding=_with_axis(q_leaf.sharding, axis, q_leaf.ndim))
        return node

    return jax.tree.map(fuse, tree, is_leaf=lambda node: _holds(node, "q_kernel"))


def unfused(tree, shardings):
    """A restored tree of the older layout in today's, placed on `shardings` (today's layout's)."""

    def split(node):
        if not _holds(node, "qkv_kernel"):
            return node
        node = dict(node)
        for old, (q, kv, axis) in _PARTS.items():
            if old in node:
                whole = node.pop(old)
                if hasattr(whole, "shape"):
                    index = lambda part: (slice(None),) * axis + (part,)  # noqa: E731
                    node[q], node[kv] = whole[index(0)], whole[index(slice(1, 3))]
                else:  # a masked optimizer's placeholder: the same for both parts
                    node[q] = node[kv] = whole
        return node

    return jax.device_put(jax.tree.map(split, tree, is_leaf=lambda node: _holds(node, "qkv_kernel")), shardings)


def _holds(node, name: str) -> bool:
    return isinstance(node, dict) and name in node


def _with_axis(sharding, axis: int, ndim: int):
    """`sharding` of an array with one more, unsplit, axis at `axis`."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:axis], None, *spec[axis:]))
