"""What a compiled program needs of each device, read from the program XLA compiled (not from a formula): its
memory (arguments, outputs, temporaries), its FLOPs and the bytes it moves, the bytes each kind of collective
carries; and, against a chip's ratings (`gpt.hardware`), whether it fits and the fastest it could run.

The floor of a call's time is the largest of three terms that no implementation avoids, each as if the other two
cost nothing: the model's FLOPs by the hand count at the chip's bf16 peak; the bytes that must cross between the
memory and the chip (`floor_bytes`: a train step's parameters and optimizer moments each read and written once, a
serving program's weights read once and a decode's cache) at its memory bandwidth; and the program's collectives at
its interconnect bandwidth (a ring: an all-reduce moves each byte out and back, (n-1)/n of it twice; an all-gather
receives (n-1)/n of its result; a reduce-scatter sends n-1 results' worth). A real call is slower; none can be
faster. XLA's count of bytes accessed is no floor: it sums every fused operation's operands and results, where a
fused program reuses what sits in the chip's vector memory (openxla/xla#11934); it is shown as an upper estimate of
the traffic. Beside the floor, a train step's report gives the range public runs reached on that chip
(`gpt.measured_mfu`): what to expect, where the floor says what cannot be beaten.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import jax
import numpy as np

from gpt.errors import ConfigError, first_line
from gpt.hardware import Chip, chip_of, device_memory_bytes
from gpt.measured_mfu import SMALL_MODEL, expected_mfu

__all__ = ["ProgramReport", "collective_bytes", "sharded_bytes", "compile_within_memory", "check_compiled_fits",
           "check_held_fits", "memory_limit", "MemoryLimit", "peak_bytes", "compiling_line"]

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z\d]*)\[(?P<dims>[\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def compiling_line(setting: str, what: str, devices: list, mesh_shape: dict[str, int]) -> str:
    """The line a `--compile_only` report starts with, before the compile: what is compiled, for which devices and
    over which mesh ("--compile_only v5e-8: compiling the train step of ..., on 8 x TPU v5 lite, mesh data=8")."""
    axes = ",".join(f"{axis}={size}" for axis, size in mesh_shape.items() if size > 1) or "one device"
    return f"{setting}: compiling {what}; on {len(devices)} x {devices[0].device_kind}, mesh {axes}"


def sharded_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s arrays or `jax.ShapeDtypeStruct`s (each by its sharding's shard
    shape; the largest over devices, which is every device's for even shardings)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def peak_bytes(memory) -> int:
    """Bytes one device holds at a compiled program's peak by XLA's memory analysis
    (`compiled.memory_analysis()`): its arguments, outputs (less those written in place of donated arguments)
    and temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def compile_within_memory(lowered: jax.stages.Lowered, what: str, device_kind: str, setting: str,
                          advice: str) -> jax.stages.Compiled:
    """`lowered` compiled; the compiler's refusal of a program too large for the device's memory (TPU's compiler
    refuses at compile time) as a ConfigError naming `setting`, `what` and the device's memory, with `advice`.

    TPU's compiler is given the chip's program limit as its budget, within which it rematerializes and schedules
    to fit. Its own accounting lets through programs whose memory analysis sums over the limit (gpt2-large's step
    on a v5e-8, by up to 1 GiB): such a program is compiled once more with the budget lowered by the excess (the
    report judges the program that returns; bench/RESULTS.md, "What TPU's compiler holds, given a budget")."""
    chip = chip_of(device_kind)
    memory = f"'s {chip.usable_bytes / 2**30:,.2f} GiB" if chip else ""
    refusal = f"{setting}: the {what} does not fit the {device_kind}{memory}"
    budget = None if chip is None else chip.program_limit
    compiled = _compile_within(lowered, budget, refusal, advice)
    if budget is not None and (excess := peak_bytes(compiled.memory_analysis()) - budget) > 0:
        compiled = _compile_within(lowered, budget - excess, refusal, advice)
    return compiled


def _compile_within(lowered: jax.stages.Lowered, budget: int | None, refusal: str,
                    advice: str) -> jax.stages.Compiled:
    """`lowered` compiled within `budget` bytes (TPU's compiler's; None: no budget); the compiler's refusal a
    ConfigError: `refusal`, the compiler's words, `advice`."""
    options = None if budget is None else {"xla_tpu_max_hbm_size_mib": budget // 2**20}
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise ConfigError(f"{refusal} (the compiler: {first_line(error)}); {advice}") from None


def check_compiled_fits(compiled: jax.stages.Compiled, devices: list, what: str, setting: str, advice: str,
                        held_already: int = 0) -> None:
    """ConfigError naming `setting`, the GiB `compiled` holds at its peak per device (memory_analysis's
    arguments, outputs not written in place and temporaries, with `held_already` bytes a device keeps beside
    them) and the device's memory, when it is over: before the first call, where running it would fail with
    an allocator's traceback (or, on the CPU, the kernel's OOM killer)."""
    memory = compiled.memory_analysis()
    if memory is not None:
        check_held_fits(peak_bytes(memory) + held_already, devices, what, setting, advice)


def check_held_fits(held: int, devices: list, what: str, setting: str, advice: str) -> None:
    """The one answer to "does this program fit this device", for a run's programs and compile-only's alike:
    ConfigError naming `setting`, the `held` bytes a device holds at the program's peak and the memory its programs
    may hold (`memory_limit`), when over."""
    limit = memory_limit(devices)
    if limit is not None and not limit.holds(held):
        raise ConfigError(f"{setting}: the {what} needs {held / 2**30:,.2f} GiB per device (the compiled program: "
                          f"arguments, outputs and temporaries), over {limit.whose} {limit.bytes / 2**30:,.2f} GiB: "
                          f"{advice}")


class MemoryLimit(NamedTuple):
    """The memory a program on some devices may hold."""

    bytes: int
    sharing: int
    """Devices whose programs share those bytes: a process's CPU devices share the host's memory."""
    whose: str
    """Whose memory it is, in words ("the TPU v5 lite's", "8 CPU devices on the host's")."""

    def holds(self, per_device: int) -> bool:
        return per_device * self.sharing <= self.bytes


def memory_limit(devices: list) -> MemoryLimit | None:
    """The memory a program on `devices` may hold (`device_memory_bytes`: the allocator's limit, a TPU compiler's
    program limit, or the host's memory); None where unknown (or no devices are named)."""
    device = devices[0] if devices else None
    limit = None if device is None else device_memory_bytes(device)
    if limit is None:
        return None
    sharing = sum(d.process_index == device.process_index for d in devices) if device.platform == "cpu" else 1
    return MemoryLimit(limit, sharing,
                       f"{sharing} CPU devices on the host's" if sharing > 1 else f"the {device.device_kind}'s")


def _group_size(line: str) -> int:
    """How many devices one collective of this HLO line spans, from its replica_groups (1 when absent)."""
    if match := re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<names>[^}]*)\}", line):
        sizes = {name.strip("'"): int(size) for name, size in re.findall(r"('[^']+')=(\d+)", match["axes"])}
        return math.prod(sizes[name.strip().strip("'")] for name in match["names"].split(",") if name.strip())
    if match := re.search(r"replica_groups=\[(?P<dims>[\d,]+)\]<=", line):
        return int(match["dims"].split(",")[-1])
    if match := re.search(r"replica_groups=\{\{(?P<first>[\d,]*)\}", line):
        return len(match["first"].split(","))
    if match := re.search(r"source_target_pairs=", line):
        return 2
    return 1


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """{kind: bytes one device sends or receives over its links in one run of the program} for each kind of
    collective in an optimized HLO module's text, as a ring moves them (the module docstring's rule)."""
    moved: dict[str, float] = {}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        result = sum(math.prod(int(d) for d in array["dims"].split(",") if d) * _ITEMSIZE.get(array["dtype"], 0)
                     for array in _ARRAY.finditer(match["shape"]))
        n, kind = _group_size(line), match["kind"]
        if n <= 1 and kind != "collective-permute":
            continue
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
                  "all-to-all": (n - 1) / n, "collective-permute": 1.0}[kind]
        if kind == "collective-permute" and match["shape"].startswith("("):  # (input, output, ...): the output
            result /= 2
        moved[kind] = moved.get(kind, 0.0) + factor * result
    return moved


_BOUND_NAMES = {"compute": "the chip's bf16 FLOP/s", "memory": "its memory bandwidth",
                "interconnect": "its interconnect bandwidth"}


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program, per device: what it holds, computes and moves, and what that implies on `chip`."""

    name: str
    """What the program is ("train step")."""
    devices: int
    device_kind: str
    chip: Chip | None
    held: dict[str, int]
    """Named parts of its arguments that stay on the device between calls (parameters, optimizer state), bytes."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    """Outputs written into donated arguments' buffers (counted once)."""
    temp_bytes: int
    total_bytes: int
    """Bytes one device holds at the program's peak (`peak_bytes`)."""
    flops: float
    """Per call, as XLA's cost analysis counts them: elementwise operations included, but a loop's body once
    (the loss's chunks) and a custom kernel's (splash attention) not at all."""
    bytes_accessed: float
    """Per call, XLA's sum of every fused operation's operands and results: an upper estimate of the traffic."""
    collectives: dict[str, float]
    """Kind -> bytes over the links per call (`collective_bytes`)."""
    tokens: int
    """Tokens one call processes, over all devices."""
    model_flops: float
    """The model's FLOPs per call over all devices by the hand count (`gpt.train.step.flops_per_token`)."""
    loops: int
    """While loops in the program: XLA's cost analysis counts each one's body once."""
    floor_bytes: float
    """Bytes one device must move between its memory and the chip in a call, whatever the implementation (the
    caller's count: the module docstring)."""
    trained_params: int | None = None
    """The parameters a train step trains, for the public runs it is compared with; None for other programs."""
    device_list: tuple = ()
    """The devices it was compiled for, whose memory it is checked against (`check_held_fits`)."""

    @classmethod
    def of(cls, name: str, compiled: jax.stages.Compiled, devices: list, held: dict[str, int], tokens: int,
           model_flops: float, chip: Chip | None, floor_bytes: float,
           trained_params: int | None = None) -> ProgramReport:
        memory, cost, text = compiled.memory_analysis(), compiled.cost_analysis() or {}, compiled.as_text()
        if isinstance(cost, list):  # older JAX: one dict per program
            cost = cost[0] if cost else {}
        return cls(name, len(devices), devices[0].device_kind, chip, held, memory.argument_size_in_bytes,
                   memory.output_size_in_bytes, memory.alias_size_in_bytes, memory.temp_size_in_bytes,
                   peak_bytes(memory), float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                   collective_bytes(text), tokens, model_flops, len(re.findall(r"\swhile\(", text)), floor_bytes,
                   trained_params, tuple(devices))

    def bound_seconds(self) -> dict[str, float] | None:
        """{compute, memory, interconnect: the least seconds a call can take by each alone} at the chip's ratings
        (the module docstring's floor); None with no chip."""
        if self.chip is None:
            return None
        return {"compute": self.model_flops / self.devices / self.chip.bf16_flops,
                "memory": self.floor_bytes / self.chip.memory_bandwidth,
                "interconnect": sum(self.collectives.values()) / self.chip.interconnect_bandwidth}

    def expected_tokens_per_s(self) -> tuple[float, float] | None:
        """(low, high) tokens/s a call would run at the lowest and highest MFU public runs reached on this chip
        with models of its size (`gpt.measured_mfu`); None for a program that trains nothing, or no such runs."""
        expected = None if self.trained_params is None else expected_mfu(self.device_kind, self.trained_params)
        if expected is None or self.chip is None:
            return None
        return expected[0] * self._tokens_per_s_at_full_mfu(), expected[1] * self._tokens_per_s_at_full_mfu()

    def _tokens_per_s_at_full_mfu(self) -> float:
        return self.devices * self.chip.bf16_flops * self.tokens / self.model_flops

    def _expectation_line(self) -> list[str]:
        """The expected range in a sentence, or what is missing for one; none for a program that trains nothing."""
        if self.trained_params is None or self.chip is None:
            return []
        bound = f"{SMALL_MODEL / 1e9:g}B parameters"
        size = f"under {bound}" if self.trained_params < SMALL_MODEL else f"of {bound} or more"
        expected = expected_mfu(self.device_kind, self.trained_params)
        if expected is None:
            return [f"  expected: no public run on a {self.chip.device_kind} of a model {size} is known here"]
        low, high = (mfu * self._tokens_per_s_at_full_mfu() for mfu in expected[:2])
        rate, mfu, runs = ((f"about {low:,.0f}", f"{expected[0]:.0%}", "a public run") if low == high else
                           (f"{low:,.0f} to {high:,.0f}", f"{expected[0]:.0%} to {expected[1]:.0%}", "public runs"))
        return [f"  expected: {rate} tokens/s, at the {mfu} MFU {runs} on a {self.chip.device_kind} reached with "
                f"models {size} (docs/sharding.md cites them); a range, not a promise"]

    def fits(self) -> bool | None:
        """Whether it fits the memory its devices' programs may hold (`check_fits`'s rule); None where unknown."""
        memory = memory_limit(list(self.device_list))
        return None if memory is None else memory.holds(self.total_bytes)

    def lines(self, verbose: bool = False) -> list[str]:
        """The report in sentences: the memory a device holds at the program's peak and whether it fits, the
        fastest a call could run and what bounds it, the bytes between devices; with `verbose`, the memory by
        part and XLA's counts too."""
        gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
        parts = [*(f"{name} {n / 2**30:,.2f}" for name, n in self.held.items()),
                 f"the rest {(self.total_bytes - sum(self.held.values())) / 2**30:,.2f}"]
        memory = memory_limit(list(self.device_list))
        of_chip = f" of the {gib(memory.bytes)} a program may hold" if memory else ""
        verdict = f": {'fits' if self.fits() else 'does NOT fit'}" if memory else ""
        out = [f"{self.name}: {gib(self.total_bytes)} per device at its peak{of_chip} ({', '.join(parts)} GiB){verdict}"]
        bounds = self.bound_seconds()
        if bounds is not None:
            seconds = max(bounds.values())
            limit = max(bounds, key=bounds.get)
            mfu = self.model_flops / (seconds * self.devices * self.chip.bf16_flops)
            mbu = self.floor_bytes / (seconds * self.chip.memory_bandwidth)
            estimate = self.bytes_accessed / self.chip.memory_bandwidth
            out.append(f"  no call takes less than {seconds * 1e3:,.2f} ms, set by {_BOUND_NAMES[limit]}: at most "
                       f"{self.tokens / seconds:,.0f} tokens/s (MFU {mfu:.1%}, MBU {mbu:.1%} there); XLA's bytes "
                       f"accessed, an upper estimate of the traffic, would take {estimate * 1e3:,.2f} ms")
        out += self._expectation_line()
        moved = sum(self.collectives.values())
        out.append(f"  between devices, a call: {gib(moved)} (" + ", ".join(
            f"{kind} {gib(n)}" for kind, n in sorted(self.collectives.items())) + ")" if moved else
                   "  between devices: nothing")
        return out + (self._details() if verbose else [])

    def _details(self) -> list[str]:
        """The figures behind the sentences, for the reader who checks them (`--verbose`)."""
        gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
        other = self.argument_bytes - sum(self.held.values())
        out = ["  per device, by part:"]
        out += [f"    {name:<22}{gib(n):>14}" for name, n in self.held.items()]
        out += [f"    {'other arguments':<22}{gib(other):>14}  (the batch, and the chip's tiling of small arrays)",
                f"    {'outputs (not in place)':<22}{gib(self.output_bytes - self.alias_bytes):>14}",
                f"    {'temporaries':<22}{gib(self.temp_bytes):>14}",
                f"  FLOPs per call and device: the model's by the hand count {self.model_flops / self.devices:.4g}, "
                f"XLA's count {self.flops:.4g}; bytes a call must move {self.floor_bytes:.4g}, bytes accessed by "
                f"XLA's count {self.bytes_accessed:.4g}"]
        bounds = self.bound_seconds()
        if bounds is not None:
            out.append("  each bound alone: " + ", ".join(f"{k} {v * 1e3:,.2f} ms" for k, v in bounds.items()))
        if self.loops:
            out.append(f"  XLA counts a loop's body once ({self.loops} loop{'s' * (self.loops > 1)} in this program): "
                       f"its bytes accessed and the interconnect's floor leave out what its other iterations move")
        return out

    def check_fits(self, setting: str, advice: str) -> None:
        """ConfigError naming `setting`, the bytes it needs and the device's, when it does not fit (`check_held_fits`,
        the rule a run's programs are checked by)."""
        check_held_fits(self.total_bytes, list(self.device_list), self.name, setting, advice)
