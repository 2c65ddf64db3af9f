"""One device mesh and one table that maps the model's logical axis names onto it.

Nothing else in the code base names a mesh axis: parameters, activations and the cache carry logical
names (`batch`, `embed`, `heads`, ...), and `RULES` decides where each one lives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gpt.errors import ConfigError

__all__ = ["MESH_AXES", "RULES", "logical_to_spec", "constrain", "make_mesh", "parse_mesh", "devices_of", "param_shardings",
           "shard_state", "abstract", "replicated", "batch_sharding", "data_parallel_size", "bytes_per_device",
           "initialize_distributed"]

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes). A logical name absent here is replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # the batch is split over every data-parallel axis
    "embed": "fsdp",  # parameters are split along their model width over fsdp (ZeRO-3 style)
    "heads": "tensor",  # attention heads over tensor (Megatron-style)
    "kv_heads": "tensor",  # key and value heads too, where the tensor axis divides them (else replicated)
    "mlp": "tensor",  # the MLP's hidden units over tensor
    "vocab": "tensor",  # the embedding/LM-head rows over tensor
    "batch_heads": ("data", "fsdp", "tensor"),  # the KV cache's rows x heads, one axis: rows major
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
                raise ConfigError(
                    f"logical axes {used[mesh_axis]!r} and {name!r} of one array (axes {tuple(axes)}) both map "
                    f"to mesh axis {mesh_axis!r}; change gpt.model.sharding.RULES"
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
            raise ConfigError(f"mesh entry {part!r} must be AXIS=SIZE with AXIS one of {MESH_AXES}")
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
            raise ConfigError(f"mesh axis {name}={size} must be >= 1 (or -1 to fill)")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"only one mesh axis may be -1, got {fill}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if len(devices) % known:
            raise ConfigError(f"mesh {sizes}: the fixed axes ({known} devices) do not divide the {len(devices)} devices")
        sizes[fill[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ConfigError(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{math.prod(sizes.values())} devices, but there are {len(devices)}"
        )
    grid = np.asarray(devices).reshape(sizes["data"], sizes["fsdp"], sizes["tensor"])
    return Mesh(grid, MESH_AXES)


# GPT-2's vocabulary (50257, a prime's multiple) divides almost nothing and is fixed by the checkpoints, and
# grouped-query attention has fewer key heads (SmolLM2-135M: 3) than a tensor axis may have devices: a `vocab`
# or `kv_heads` dimension that the mesh does not divide is replicated instead of refused.
_REPLICATED_WHEN_UNEVEN = {"vocab", "kv_heads"}


def _fit(name: str, axes: Sequence[str | None], shape, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of parameter `name` on `mesh`; raises ValueError for a dimension its mesh axes
    do not divide, except a `vocab` or `kv_heads` dimension, which is replicated (correct, at the cost of its
    memory saving; train from scratch with vocab_size=50304 to split the vocabulary)."""
    fitted = []
    for dim, (logical, axes) in enumerate(zip(axes, logical_to_spec(axes))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        ways = math.prod(mesh.shape[axis] for axis in names)
        if shape[dim] % ways == 0:
            fitted.append(axes)
        elif logical in _REPLICATED_WHEN_UNEVEN:
            fitted.append(None)
        else:
            raise ConfigError(
                f"parameter {name} {tuple(shape)}: dimension {dim} ({logical}={shape[dim]}) cannot be split "
                f"{ways} ways over mesh axes {names} ({dict(mesh.shape)}); choose mesh sizes that divide it"
            )
    return PartitionSpec(*fitted)


def param_shardings(model: nnx.Module, mesh: Mesh) -> dict:
    """A pure dict (like `nnx.to_pure_dict(nnx.state(model))`) of NamedShardings, from each parameter's
    logical `axes` metadata and RULES. Raises ValueError for a dimension the mesh cannot split."""
    shardings: dict = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Variable):
            axes = variable.get_metadata().get("axes") or (None,) * variable.ndim
            spec = _fit("/".join(map(str, path)), axes, variable.shape, mesh)
            node = shardings
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = NamedSharding(mesh, spec)
    return shardings


def shard_state(model: nnx.Module, state: nnx.State, mesh: Mesh) -> nnx.State:
    """`state` (from `nnx.split(model)`) with every parameter placed on `mesh` as RULES say; arrays already
    placed that way are not copied."""
    placed = jax.device_put(nnx.to_pure_dict(state), param_shardings(model, mesh))
    nnx.replace_by_pure_dict(state, placed)
    return state


def abstract(tree, shardings):
    """`tree`'s arrays (or shapes) as `jax.ShapeDtypeStruct`s placed by `shardings`, a tree of the same shape: what
    a program is lowered or restored for, with nothing allocated."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of `mesh` (scalars such as the loss or the optimizer's step count)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, axes: Sequence[str | None] = ("batch", None)) -> NamedSharding:
    """Token batches: the `batch` axis split over every data-parallel mesh axis."""
    return NamedSharding(mesh, logical_to_spec(axes))


def devices_of(mesh: Mesh | None) -> list:
    """The devices a program runs on: the mesh's, or the first device where there is no mesh."""
    return list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the mesh axes that `batch` maps to."""
    axes = RULES["batch"]
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s arrays stored on it}: what sharding saves, from each array's sharding
    (the shape of its shard on each of this process's devices). Reading the shards themselves fails for
    some arrays of a multi-process run with one device per process."""
    totals: dict = {}
    for leaf in jax.tree.leaves(tree):
        shard_bytes = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for device in leaf.sharding.addressable_devices:
            totals[device] = totals.get(device, 0) + shard_bytes
    return totals


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """Join a multi-process run (`jax.distributed.initialize`) before any JAX computation.

    On SLURM, Open MPI and Cloud TPU the three arguments are found automatically (pass none); elsewhere
    pass all three, the same address on every process (e.g. "host0:1234") and a distinct id per process.
    """
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("pass coordinator_address, num_processes and process_id together, or none of them "
                         f"(got {coordinator_address=}, {num_processes=}, {process_id=})")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
