"""One device mesh and one table that maps the model's logical axis names onto it.

Nothing else in the code base names a mesh axis: parameters, activations and the cache carry logical
names (`batch`, `embed`, `heads`, ...), and `RULES` decides where each one lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

__all__ = ["MESH_AXES", "RULES", "logical_to_spec", "constrain"]

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes). A logical name absent here is replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # the batch is split over every data-parallel axis
    "embed": "fsdp",  # parameters are split along their model width over fsdp (ZeRO-3 style)
    "heads": "tensor",  # attention heads over tensor (Megatron-style)
    "mlp": "tensor",  # the MLP's hidden units over tensor
    "vocab": "tensor",  # the embedding/LM-head rows over tensor
    "layers": None,  # the scanned layer axis is never split
    "head_dim": None,
}


def logical_to_spec(axes: Sequence[str | None], rules: dict = RULES) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions have the logical names `axes`.

    Raises ValueError when two dimensions of one array would land on the same mesh axis.
    """
    spec, used = [], {}
    for dim, name in enumerate(axes):
        mesh_axes = rules.get(name) if name is not None else None
        if mesh_axes is None:
            spec.append(None)
            continue
        for mesh_axis in (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes:
            if mesh_axis in used:
                raise ValueError(
                    f"logical axes {used[mesh_axis]!r} and {name!r} of one array (axes {tuple(axes)}) both map "
                    f"to mesh axis {mesh_axis!r}; change gpt.sharding.RULES"
                )
            used[mesh_axis] = name
        spec.append(mesh_axes)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding to its logical axes when a mesh is active; a no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))
