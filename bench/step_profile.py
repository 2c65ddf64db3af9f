"""Where a training step's device time goes: a JAX profiler trace as a table a terminal shows.

    python train.py --profile_steps 10:13 ...      # traces steps 10-12 into out/profile
    python bench/gpu_bench.py --profile_dir prof   # the same for the GPU benchmark's step
    python bench/step_profile.py out/profile       # the table below
    python bench/step_profile.py --roofline --preset gpt2 --micro_batch 32 --block_size 1024 --accumulation 16

Each op the trace timed is put in one category by what it computes and where in the code it came from:
the step's optimized HLO (written beside the trace) gives each op's instructions, and each instruction
carries the named scope of the code it was traced in (`qkv`, `attention`, `mlp_up`, `loss`, `optimizer`,
...; the backward pass is the transpose of the forward's scope). A matrix product takes its scope's role
and direction (`mlp_up bwd`); an op that only copies, casts or transposes is a copy; the rest take their
scope. `idle` is the time no op ran, between the first op of the traced steps and the last.

With the traced steps' shapes (`profile.json`, written with the trace) each category also gets its work
from `roofline()`: the FLOPs and the fewest bytes of device memory it must move, so its achieved TFLOP/s
and GB/s, and its floor (the larger of FLOPs over the peak rate and bytes over the memory bandwidth) on a
device of known peaks. `--roofline` prints that account alone for any shape (docs/training.md has GPT-2
124M's).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The chips' datasheet ratings (gpt.hardware); a device-to-device copy on a lent H100 measured ~3.0e12 B/s.
from gpt.hardware import chip_of  # noqa: E402
from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.transformer import num_params
from gpt.train.profile import HLO_FILE, META_FILE  # noqa: E402

GEMM_ROLES = ("qkv", "attn_proj", "mlp_up", "mlp_down", "lm_head")
SCOPES = {  # named scope in the code -> category of the ops (other than matrix products) under it
    "attention": "attention", "layer_norm": "layer_norm", "activation": "activation", "embed": "embed",
    "loss": "loss", "lm_head": "loss", "optimizer": "optimizer", "accumulate": "grad accumulation",
}
CATEGORIES = (*(f"{role} {way}" for role in GEMM_ROLES for way in ("fwd", "bwd")), "other GEMMs",
              "attention fwd", "attention bwd", "loss", "layer_norm", "activation", "embed", "grad accumulation",
              "optimizer", "copies, casts, transposes", "other fusions", "other programs", "idle")
_CONTAINERS = {"while", "conditional", "call"}  # their bodies' ops are timed on their own
_MOVES = {"copy", "transpose", "convert", "bitcast", "reshape", "parameter", "tuple", "get-tuple-element",
          "copy-start", "copy-done", "bitcast-convert", "slice", "concatenate", "pad", "dynamic-slice",
          "dynamic-update-slice", "broadcast", "constant"}


# ------------------------------------------------------------------------------------------ the HLO's ops

@dataclasses.dataclass
class Op:
    """One instruction of the optimized HLO."""

    name: str
    opcode: str
    op_name: str  # the metadata's name stack, e.g. jit(step)/while/body/.../transpose(jvp(...))/mlp_up/dot_general
    calls: list[str]
    target: str  # a custom call's target


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")


def parse_hlo(text: str) -> tuple[dict[str, Op], dict[str, list[Op]]]:
    """(every instruction by name, every computation's instructions by its name) of an HLO module's text."""
    ops, computations, current = {}, {}, None
    for line in text.splitlines():
        if not line.startswith(" ") and (match := _COMPUTATION.match(line)):
            current = computations.setdefault(match.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if match is None or current is None:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        op = Op(match.group(1), match.group(2), op_name.group(1) if op_name else "",
                re.findall(r"(?:calls|body)=%?([\w.\-]+)", line), target.group(1) if target else "")
        ops[op.name] = op
        current.append(op)
    return ops, computations


def _inside(op: Op, computations: dict[str, list[Op]]) -> list[Op]:
    """`op` and every instruction of the computations it calls, recursively."""
    found, todo = [op], list(op.calls)
    while todo:
        for inner in computations.get(todo.pop(), []):
            found.append(inner)
            todo.extend(inner.calls)
    return found


def scope(op_name: str) -> str | None:
    """The innermost known named scope in a name stack (None outside all of them). A scope inside a
    differentiated function is wrapped in its transforms (`transpose(jvp(mlp_up))`): its name is inside."""
    parts = [re.sub(r"^(?:[\w-]+\()+([^()]*)\)+$", r"\1", part) for part in op_name.split("/")]
    known = [part for part in parts if part in SCOPES or part in GEMM_ROLES]
    return known[-1] if known else None


def direction(op_name: str) -> str:
    """'bwd' for the backward pass (a transpose of the forward, or code under a `backward` scope), else 'fwd';
    a forward recomputed in the backward pass (`recompute`, remat) is forward work."""
    if "/recompute/" in op_name:
        return "fwd"
    return "bwd" if "transpose(" in op_name or "/backward/" in op_name else "fwd"


def _is_gemm(op: Op) -> bool:
    """A matrix product: XLA's dot, a library's GEMM (cuBLAS), or this project's CPU kernel for a few rows."""
    return op.opcode in ("dot", "convolution") or (
        op.opcode == "custom-call" and re.search(r"gemm|matmul|cublas|few_rows", op.target, re.I) is not None)


def _is_attention_kernel(op: Op) -> bool:
    """cuDNN's fused attention, or this project's CPU kernel for a decode step's."""
    return op.opcode == "custom-call" and re.search(r"fmha|flash|attention", op.target, re.I) is not None


def categorize(op: Op, computations: dict[str, list[Op]]) -> str | None:
    """The category of an executed op, or None for a container whose body's ops are timed themselves."""
    if op.opcode in _CONTAINERS:
        return None
    inside = _inside(op, computations)
    kernel = next((inner for inner in inside if _is_attention_kernel(inner)), None)
    if kernel is not None:
        return f"attention {direction(kernel.op_name or op.op_name)}"
    gemm = next((inner for inner in inside if _is_gemm(inner)), None)
    if gemm is not None:
        role = scope(gemm.op_name)
        if role in GEMM_ROLES:
            return f"{role} {direction(gemm.op_name)}"
        return f"attention {direction(gemm.op_name)}" if role == "attention" else "other GEMMs"
    if all(inner.opcode in _MOVES or inner.opcode == "fusion" for inner in inside):
        return "copies, casts, transposes"
    role = scope(op.op_name)
    if role is None:  # a fusion's own name may lack a scope its parts have: take theirs, the most common
        roles = collections.Counter(filter(None, (scope(inner.op_name) for inner in inside)))
        role = roles.most_common(1)[0][0] if roles else None
    if role == "attention":
        return f"attention {direction(op.op_name)}"
    return SCOPES.get(role, "other fusions")


# ------------------------------------------------------------------------------------------ the trace

def find_trace(path: Path) -> Path:
    """The newest `*.trace.json.gz` at or under `path`."""
    if path.is_file():
        return path
    traces = sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise SystemExit(f"step_profile: no *.trace.json.gz under {path} (write one with --profile_steps A:B)")
    return traces[-1]


def device_events(trace: dict) -> list[dict]:
    """The trace's timed XLA ops: complete events with an `hlo_op`. On a GPU, those of its streams (the
    kernels; its 'XLA Ops' line repeats them as ops); elsewhere every thread's (a CPU runs ops on several)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    if any((e["pid"], e.get("tid")) in streams for e in events):
        events = [e for e in events if (e["pid"], e.get("tid")) in streams]
    return events


def busy_time(events: list[dict]) -> float:
    """Microseconds in which at least one of `events` ran (their union)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile(directory: Path) -> tuple[dict[str, float], dict]:
    """(seconds per step of each category, the traced steps' description) of a `--profile_steps` directory.
    The description gains `lanes`: the threads or streams the ops ran on (a CPU runs ops on several at
    once, and their times add up to more than the step's)."""
    trace_path = find_trace(directory)
    root = directory if directory.is_dir() else trace_path.parent
    meta_path = next((p for p in (root / META_FILE, *[q / META_FILE for q in trace_path.parents]) if p.exists()), None)
    meta = json.loads(meta_path.read_text()) if meta_path else {}
    hlo_path = (meta_path.parent if meta_path else root) / HLO_FILE
    ops, computations = parse_hlo(hlo_path.read_text()) if hlo_path.exists() else ({}, {})
    module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_path.read_text(), re.M).group(1) if ops else None
    with gzip.open(trace_path) as file:
        events = device_events(json.load(file))
    if not events:
        raise SystemExit(f"step_profile: {trace_path} has no timed XLA ops")
    step_runs = {e["args"].get("run_id") for e in events if e["args"].get("hlo_module") == module}
    steps = meta.get("steps") or max(1, len(step_runs))
    seconds, timed = collections.Counter(), []
    for event in events:
        op = ops.get(event["args"]["hlo_op"]) if event["args"].get("hlo_module") == module else None
        category = "other programs" if op is None else categorize(op, computations)
        if category is not None:
            seconds[category] += event["dur"] * 1e-6
            timed.append(event)
    span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    seconds["idle"] = (span - busy_time(timed)) * 1e-6
    meta = {**meta, "lanes": len({(e["pid"], e.get("tid")) for e in timed}), "ops_per_step": len(timed) / steps}
    return {name: value / steps for name, value in seconds.items()}, meta


# ------------------------------------------------------------------------------------------ the roofline

def _gemm(m: int, k: int, n: int, width: int) -> tuple[float, float]:
    """(FLOPs, bytes) of [m, k] x [k, n]: each operand read once, the result written once."""
    return 2.0 * m * k * n, float(width * (m * k + k * n + m * n))


def _add(*works: tuple[float, float]) -> tuple[float, float]:
    return sum(w[0] for w in works), sum(w[1] for w in works)


def roofline(config: GPTConfig, micro_batch: int, block_size: int, accumulation: int = 1,
             width: int = 2) -> dict[str, tuple[float, float]]:
    """Each category's (FLOPs, bytes) in one optimizer step: the work it cannot avoid, at `width` bytes an
    activation (2 for bfloat16), float32 parameters, gradients and Adam moments.

    Matrix products: each operand read once and the result written once; the backward is two products
    (the input's gradient and the weight's). Attention as a fused causal kernel does: half the square
    score matrix (the other half is masked), q, k, v read and the output written once forward; five
    products backward (the scores again, and the gradients of the probabilities, q, k and v), reading q,
    k, v, o and its gradient and writing three. Element-wise work: one read of each input and one write
    of each output forward, inputs and the incoming gradient read and the gradient written backward. The
    loss reads the logits once and writes their gradient once (a kernel fused into the head's product
    would not write the logits at all). The optimizer reads parameters, gradients and both moments and
    writes three of them; accumulating a micro-batch's gradients reads two copies and writes one.
    """
    M, L, D, F, V = micro_batch * block_size, config.n_layer, config.n_embd, config.mlp_dim, config.vocab_size
    per_micro = {}
    for role, (k, n, layers) in {"qkv": (D, 3 * D, L), "attn_proj": (D, D, L), "mlp_up": (D, F, L),
                                 "mlp_down": (F, D, L), "lm_head": (D, V, 1)}.items():
        forward = _gemm(M, k, n, width)
        backward = _add(_gemm(M, n, k, width), _gemm(k, M, n, width))
        per_micro[f"{role} fwd"] = (forward[0] * layers, forward[1] * layers)
        per_micro[f"{role} bwd"] = (backward[0] * layers, backward[1] * layers)
    scores = 2.0 * micro_batch * block_size * block_size * D / 2  # one causal product over every head
    per_micro["attention fwd"] = (2 * scores * L, 4.0 * M * D * width * L)
    per_micro["attention bwd"] = (5 * scores * L, 8.0 * M * D * width * L)
    per_micro["loss"] = (5.0 * M * V, 2.0 * M * V * width)
    per_micro["layer_norm"] = (16.0 * M * D * (2 * L + 1), 5.0 * M * D * width * (2 * L + 1))
    per_micro["activation"] = (20.0 * M * F * L, 5.0 * M * F * width * L)
    params = num_params(config)
    per_micro["grad accumulation"] = (float(params), 12.0 * params)
    work = {name: (flops * accumulation, moved * accumulation) for name, (flops, moved) in per_micro.items()}
    # p, g, m, v read (and g once more for its norm); p, m, v written
    work["optimizer"] = (15.0 * params, 32.0 * params)
    return work


def peaks(device: str, flops: float | None = None, bandwidth: float | None = None) -> tuple[float | None, float | None]:
    """(peak bf16 FLOP/s, memory bytes/s) of a device kind, from the tables or as given."""
    chip = chip_of(device)
    return flops or (chip and chip.bf16_flops), bandwidth or (chip and chip.memory_bandwidth)


def floor_seconds(work: tuple[float, float], peak_flops: float | None, bandwidth: float | None) -> float | None:
    if peak_flops is None or bandwidth is None:
        return None
    return max(work[0] / peak_flops, work[1] / bandwidth)


# ------------------------------------------------------------------------------------------ the tables

def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(seconds: dict[str, float], work: dict[str, tuple[float, float]], peak_flops: float | None,
          bandwidth: float | None) -> str:
    """Markdown: each category's ms a step, share, achieved TFLOP/s and GB/s, floor and time over floor."""
    total = sum(seconds.values())
    lines = ["| category | ms/step | share | TFLOP/s | GB/s | floor ms | x floor |", "| --- " * 7 + "|"]
    for name in [c for c in CATEGORIES if seconds.get(c)] + sorted(set(seconds) - set(CATEGORIES)):
        time = seconds[name]
        flops, moved = work.get(name, (None, None))
        floor = floor_seconds(work[name], peak_flops, bandwidth) if name in work else None
        lines.append(f"| {name} | {time * 1e3:.2f} | {time / total:.1%} | "
                     f"{_cell(flops and flops / time / 1e12, '.1f')} | {_cell(moved and moved / time / 1e9, ',.0f')} | "
                     f"{_cell(floor and floor * 1e3, '.2f')} | {_cell(floor and time / floor, '.1f')} |")
    floors = [floor_seconds(w, peak_flops, bandwidth) for w in work.values()]
    floor_total = sum(floors) if floors and None not in floors else None
    floor_ms = _cell(floor_total and floor_total * 1e3, ".2f")
    lines.append(f"| **step** | **{total * 1e3:.2f}** | 100% | - | - | {floor_ms} "
                 f"| {_cell(floor_total and total / floor_total, '.1f')} |")
    return "\n".join(lines)


def roofline_table(work: dict[str, tuple[float, float]], peak_flops: float | None, bandwidth: float | None) -> str:
    """Markdown: each category's GFLOPs, MB and floor (and which bound sets it)."""
    lines = ["| category | GFLOP | MB moved | FLOP/byte | floor ms | bound |", "| --- " * 6 + "|"]
    for name, (flops, moved) in work.items():
        floor = floor_seconds((flops, moved), peak_flops, bandwidth)
        bound = "-" if floor is None else ("compute" if flops / peak_flops >= moved / bandwidth else "memory")
        lines.append(f"| {name} | {flops / 1e9:,.1f} | {moved / 1e6:,.1f} | {flops / moved:,.0f} | "
                     f"{_cell(floor and floor * 1e3, '.2f')} | {bound} |")
    flops, moved = _add(*work.values())
    floors = [floor_seconds(w, peak_flops, bandwidth) for w in work.values()]
    total = None if None in floors else sum(floors)
    lines.append(f"| **step** | **{flops / 1e9:,.1f}** | **{moved / 1e6:,.1f}** | - | "
                 f"**{_cell(total and total * 1e3, '.2f')}** | - |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Args:
    trace: tyro.conf.Positional[str | None] = None
    """A `--profile_steps` directory (or a *.trace.json.gz in one)."""
    roofline: bool = False
    """Print the roofline account of the shape below instead of a trace's table."""
    preset: str = "gpt2"
    micro_batch: int = 32
    block_size: int = 1024
    accumulation: int = 1
    device: str = "H100"
    """The device whose peaks the roofline uses (a trace's own device otherwise)."""
    peak_flops: float | None = None
    """Peak FLOP/s, in place of the table's (e.g. a measured GEMM rate)."""
    peak_bandwidth: float | None = None
    """Memory bytes/s, in place of the table's (e.g. a measured device-to-device copy)."""


def main(args: Args) -> str:
    if args.roofline:
        config = GPTConfig.preset(args.preset, block_size=max(args.block_size, 1024))
        work = roofline(config, args.micro_batch, args.block_size, args.accumulation)
        peak, bandwidth = peaks(args.device, args.peak_flops, args.peak_bandwidth)
        heading = (f"# {args.preset}, micro-batch {args.micro_batch} x block {args.block_size} x {args.accumulation}; "
                   f"{args.device}: {peak / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s")
        return heading + "\n" + roofline_table(work, peak, bandwidth)
    if args.trace is None:
        raise SystemExit("step_profile: give a trace directory, or --roofline")
    seconds, meta = profile(Path(args.trace))
    work = {}
    if "model" in meta and "micro_batch" in meta:  # a training step's shapes: its roofline
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        config = GPTConfig(**{k: v for k, v in meta["model"].items() if k in fields})
        width = 2 if config.dtype in ("bfloat16", "float16") else 4
        work = roofline(config, meta["micro_batch"], meta["block_size"], meta.get("accumulation", 1), width)
    peak, bandwidth = peaks(meta.get("device", ""), args.peak_flops, args.peak_bandwidth)
    shape = (f"decoding {meta['decode_rows']} rows a token" if "decode_rows" in meta else "micro-batch x block x "
             "accumulation " + " x ".join(str(meta.get(key, "?")) for key in ("micro_batch", "block_size", "accumulation")))
    heading = (f"# {meta.get('device', '?')}, {meta.get('steps', '?')} steps traced; "
               f"{shape}; {meta['ops_per_step']:,.0f} ops a step, on "
               f"{meta['lanes']} threads or streams"
               + (" (their times add up: a step's wall time is less)" if meta["lanes"] > 1 else ""))
    return heading + "\n" + table(seconds, work, peak, bandwidth)


if __name__ == "__main__":
    print(main(tyro.cli(Args)))
