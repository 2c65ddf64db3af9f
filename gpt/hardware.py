"""The accelerators the code knows by name: each chip's rated numbers, and TPU topologies that programs can be
compiled for on any machine (libtpu's compiler, no TPU needed).

A chip's figures are its maker's ratings (NVIDIA's data sheets for the SXM parts; Google Cloud's TPU pages),
per device as JAX sees it: one GPU, or one TPU chip (v4's and v5p's two TensorCores are one device), or half a
TPU7x chip (its two TensorCores are two devices, each with half the chip's memory, FLOP/s and HBM bandwidth).
They bound what a program can do (`gpt.program_report`); they are not measurements.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

from gpt.errors import ConfigError, first_line, host_memory_bytes

__all__ = ["Chip", "CHIPS", "chip_of", "Topology", "TOPOLOGY_FAMILIES", "parse_topology", "topology_help",
           "CompileOnlyChoice", "device_memory_bytes"]


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device's rated numbers."""

    device_kind: str
    """The start of JAX's `device.device_kind` for it (the longest that matches wins)."""
    memory_bytes: int
    """Its accelerator memory (HBM)."""
    bf16_flops: float
    """Dense bfloat16 matrix FLOP/s."""
    memory_bandwidth: float
    """Bytes/s between the memory and the chip."""
    interconnect_bandwidth: float
    """Bytes/s one way over its links to the other chips (half the bidirectional rating): ICI or NVLink."""
    program_limit: int | None = None
    """The bytes TPU's compiler lets one program hold of the memory (its arguments, outputs and temporaries): the
    compiler's own "available HBM", the rest reserved. Given to the compiler as its budget
    (`gpt.program_report.compile_within_memory`); None for GPUs, whose runtime reports its allocator's limit."""

    @property
    def usable_bytes(self) -> int:
        """The bytes a program may hold: the compiler's limit where it has one, else the memory."""
        return self.program_limit or self.memory_bytes


_GB = 10**9
CHIPS: dict[str, Chip] = {chip.device_kind: chip for chip in (
    Chip("NVIDIA H100", 80 * _GB, 989e12, 3.35e12, 450e9),
    Chip("NVIDIA H200", 141 * _GB, 989e12, 4.8e12, 450e9),
    Chip("NVIDIA A100", 80 * _GB, 312e12, 2.039e12, 300e9),
    Chip("NVIDIA L4", 24 * _GB, 121e12, 300e9, 32e9),
    # The TPUs' program limits are libtpu's (0.0.42.1) own, from its refusals: "exceeds available HBM (15.75G)"
    # (v4's as one device a chip, its "megacore": 30.75G, as MaxText's logs show).
    # A v5p has 96 GiB (Cloud TPU's v5p page lists 95, the HBM its system and runtime leave to programs).
    # v4's links: Cloud TPU's v4 page gives a pod of 4,096 chips 1.1 PB/s of all-reduce bandwidth, 269 GB/s a chip
    # (six links of 45 GB/s one way, as the scaling book counts them).
    Chip("TPU v4", 32 * 2**30, 275e12, 1.2e12, 269e9, 31_488 * 2**20),
    Chip("TPU v5 lite", 16 * 2**30, 197e12, 819e9, 200e9, 16_128 * 2**20),
    Chip("TPU v5", 96 * 2**30, 459e12, 2.765e12, 600e9, 98_037 * 2**20),
    Chip("TPU v6 lite", 32 * 2**30, 918e12, 1.638e12, 400e9, 32_000 * 2**20),
    # TPU7x (Ironwood), a device: half of Cloud TPU's 192 GiB and 2,307 bf16 TFLOP/s a chip and of Google's 7.37 TB/s
    # (docs/sharding.md cites them). Its links, 1.2 TB/s both ways a chip, are given whole to each device: its two
    # devices share them, but also talk across the chip without them, and a floor must not be raised by a guess.
    Chip("TPU7x", 96 * 2**30, 2307e12 / 2, 7.37e12 / 2, 600e9, 97_024 * 2**20),
)}


def chip_of(device_kind: str) -> Chip | None:
    """The chip whose kind is the longest start of `device_kind`, with or without NVIDIA's name (so "TPU v5 lite"
    is v5e, never v5p's "TPU v5"; "NVIDIA H100 80GB HBM3" and "H100" the H100); None for anything else (a CPU)."""
    known = [kind for kind in CHIPS if device_kind.startswith((kind, kind.removeprefix("NVIDIA ")))]
    return CHIPS[max(known, key=len)] if known else None


@dataclasses.dataclass(frozen=True)
class _Family:
    """How a TPU generation names its slices and lays out its chips."""

    prefix: str
    """The name's prefix, as Cloud TPU's accelerator types spell it (`v5e` in `v5e-8`)."""
    cores_per_chip_in_name: int
    """v5p's and TPU7x's names count TensorCores (`v5p-128` is 64 chips); v5e's and v6e's count chips."""
    shapes: dict[int, tuple[int, ...]]
    """Chips -> the slice's shape, as `topology_name` takes it."""
    chips_per_host: dict[int, tuple[int, int, int]]
    """Chips in the slice -> the chips one host holds (the largest key at most the slice's size applies)."""


_CUBES = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8),
          512: (8, 8, 8)}  # a 3D torus's slices, by chips
TOPOLOGY_FAMILIES = {family.prefix: family for family in (
    _Family("v5e", 1, {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
                       256: (16, 16)}, {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1), 16: (2, 2, 1)}),
    _Family("v6e", 1, {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
                       256: (16, 16)}, {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1), 16: (2, 2, 1)}),
    _Family("v5p", 2, _CUBES, {4: (2, 2, 1)}),
    _Family("tpu7x", 2, _CUBES, {4: (2, 2, 1)}),
)}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice (or several) named as Cloud TPU names it: `v5e-8`, `v5p-128`, `tpu7x-8`, `v5e-256x2` (two
    slices)."""

    name: str
    family: str
    chips: int
    """Chips in one slice."""
    slices: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return TOPOLOGY_FAMILIES[self.family].shapes[self.chips]

    def devices(self) -> list:
        """The slice's devices as JAX's TPU compiler sees them (libtpu, no TPU): programs jitted for a mesh of
        them compile, and cannot run. ConfigError when libtpu is not installed."""
        cube = len(self.shape) == 3 and all(size % 4 == 0 for size in self.shape)
        wrap = tuple(cube or (len(self.shape) == 2 and self.chips == 256 and axis < 2) for axis in range(3))
        # libtpu takes a lock file for the one process that may drive a host's TPUs; a compile drives none, and
        # must not fail beside another compile or a training run on a TPU host. Off a TPU VM it also asks the
        # environment what slice and hosts it runs on, and prints warnings where nothing says: it is told.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        one_slice = re.sub(r"x\d+$", "", self.name)
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", one_slice.replace("v5e-", "v5litepod-"))
        try:
            from jax.experimental import topologies

            description = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{self.family}:{'x'.join(map(str, self.shape))}",
                chip_config_name="default", chips_per_host_bounds=self.chips_per_host, num_slices=self.slices,
                wrap=wrap)
        except (ImportError, RuntimeError, jax.errors.JaxRuntimeError) as error:
            if isinstance(error, ImportError) or "tpu" in str(error).lower():
                raise ConfigError(f"compiling for {self.name} needs TPU's compiler, libtpu: pip install -e '.[tpu]' "
                                  f"({first_line(error, 200)})") from None
            raise
        return list(description.devices)

    @property
    def chips_per_host(self) -> tuple[int, int, int]:
        """The chips one host of the slice holds, as libtpu's `chips_per_host_bounds` takes them."""
        per_host = TOPOLOGY_FAMILIES[self.family].chips_per_host
        return per_host[max(chips for chips in per_host if chips <= self.chips)]

    @property
    def hosts(self) -> int:
        return self.slices * max(1, self.chips // math.prod(self.chips_per_host))


def topology_help() -> str:
    """The names `parse_topology` takes, for a flag's help."""
    return "; ".join(f"{prefix}-N with N in {', '.join(str(chips * f.cores_per_chip_in_name) for chips in f.shapes)}"
                     for prefix, f in TOPOLOGY_FAMILIES.items()) + "; add xS for S slices (v5e-256x2)"


MAX_CHIPS = 1 << 16  # chips in all the slices of a topology `parse_topology` takes


def parse_topology(name: str) -> Topology:
    """`v5e-8` -> Topology(family v5e, 8 chips); `v5p-128` -> 64 chips, `tpu7x-8` -> 4 (their names count
    TensorCores); `v5e-256x2` -> two slices. ConfigError naming the known sizes for anything else."""
    match = re.fullmatch(r"(v\d+[a-z]+|tpu\d+x)-(\d+)(?:x(\d+))?", name.strip())
    family = TOPOLOGY_FAMILIES.get(match.group(1)) if match else None
    if family is None:
        raise ConfigError(f"unknown TPU topology {name!r}: expected {topology_help()}")
    chips = int(match.group(2)) // family.cores_per_chip_in_name
    slices = int(match.group(3) or 1)
    if chips not in family.shapes or int(match.group(2)) % family.cores_per_chip_in_name or slices < 1:
        raise ConfigError(f"unknown TPU topology {name!r}: expected {topology_help()}")
    if chips * slices > MAX_CHIPS:  # its devices alone would take the host's memory for many minutes
        raise ConfigError(f"TPU topology {name!r} is {chips * slices:,} chips, more than the {MAX_CHIPS:,} this "
                          f"compiles for (past any multislice job run so far)")
    return Topology(name.strip(), family.prefix, chips, slices)


@dataclasses.dataclass(frozen=True)
class CompileOnlyChoice:
    """The `--compile_only` flag of train.py and serve.py."""

    compile_only: str = ""
    """A TPU topology to compile the run's programs for, on any machine, then print what each device needs
    (memory, FLOPs, collectives), the fastest they could run there and what public runs on that chip reached, and
    exit: nothing read but a config, nothing written. v5e-N and v6e-N count chips (1, 4, 8, 16, ... 256), v5p-N and tpu7x-N TensorCores (8 ... 1024);
    v5e-256x2 is two slices. Needs TPU's compiler: pip install -e '.[tpu]'."""
    verbose: bool = False
    """With --compile_only: also each program's memory by part, XLA's counts of its FLOPs and bytes, and what
    the bounds leave out."""

    def __post_init__(self):
        if self.compile_only:
            parse_topology(self.compile_only)


def device_memory_bytes(device) -> int | None:
    """The memory a device's programs may hold: the runtime's allocator limit where it reports one (GPUs,
    TPUs), the chip's rating where it does not, and on the CPU the host's physical memory (which its devices
    share); None where none of these is known."""
    try:
        stats = device.memory_stats()
    except Exception:  # a runtime without memory statistics (the CPU's, in some versions) raises
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        return host_memory_bytes()
    chip = chip_of(device.device_kind)
    return chip.usable_bytes if chip else None
