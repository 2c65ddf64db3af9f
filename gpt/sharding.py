"""One device mesh and one table that maps the model's logical axis names onto it.

Nothing else in the code base names a mesh axis: parameters, activations and the cache carry logical
names (`batch`, `embed`, `heads`, ...), and `RULES` decides where each one lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MESH_AXES", "RULES", "logical_to_spec", "constrain", "make_mesh", "parse_mesh", "param_shardings",
           "batch_sharding", "data_parallel_size"]

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


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,fsdp=2,tensor=2"` -> {"data": 2, "fsdp": 2, "tensor": 2}; "" -> {}."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in MESH_AXES or not value.lstrip("-").isdigit():
            raise ValueError(f"mesh entry {part!r} must be AXIS=SIZE with AXIS one of {MESH_AXES}")
        sizes[name] = int(value)
    return sizes


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor) over `devices` (default: every device of every process).

    One size may be -1: it takes whatever the others leave. The product must equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ValueError(f"mesh axis {name}={size} must be >= 1 (or -1 to fill)")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {fill}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if len(devices) % known:
            raise ValueError(f"mesh {sizes}: the fixed axes ({known} devices) do not divide the {len(devices)} devices")
        sizes[fill[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{math.prod(sizes.values())} devices, but there are {len(devices)}"
        )
    grid = np.asarray(devices).reshape(sizes["data"], sizes["fsdp"], sizes["tensor"])
    return Mesh(grid, MESH_AXES)


def _fit(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """Replicate any dimension that the mesh axes assigned to it do not divide (e.g. GPT-2's vocabulary
    of 50257 over tensor=2): correct everywhere, at the cost of that array's memory saving."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        size = math.prod(mesh.shape[name] for name in names)
        fitted.append(axes if dim % size == 0 else None)
    return PartitionSpec(*fitted)


def param_shardings(model: nnx.Module, mesh: Mesh) -> dict:
    """A pure dict (like `nnx.to_pure_dict(nnx.state(model))`) of NamedShardings, from each parameter's
    logical `axes` metadata and RULES."""
    shardings: dict = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Variable):
            axes = variable.get_metadata().get("axes") or (None,) * variable.ndim
            spec = _fit(logical_to_spec(axes), variable.shape, mesh)
            node = shardings
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = NamedSharding(mesh, spec)
    return shardings


def batch_sharding(mesh: Mesh, axes: Sequence[str | None] = ("batch", None)) -> NamedSharding:
    """Token batches: the `batch` axis split over every data-parallel mesh axis."""
    return NamedSharding(mesh, logical_to_spec(axes))


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the mesh axes that `batch` maps to."""
    axes = RULES["batch"]
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
