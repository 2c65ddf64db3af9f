"""What fits on a TPU slice, how fast at best and how fast to expect: GPT-2's four sizes and one 7B-shaped model,
each compiled on this CPU for v5e-8, v6e-8, a 16-host v5p-128 and an Ironwood tpu7x-8 (libtpu's compiler,
`train.py --compile_only`'s path), with the first mesh that fits, a table row each.

    pip install -e ".[tpu]"
    python bench/tpu_plan.py --out bench/tpu_plan.jsonl     # a row a line, as each compile ends; then the table

Each model trains in bfloat16 (float32 parameters and Adam state), 1024 tokens a sequence, 8 sequences per chip
(so the global batch grows with the slice), GPT-2's layers unrolled as by default (XLA's cost analysis counts a
loop's body once, so a scanned step's bytes would be counted for one layer; gpt2-xl's step takes ~6 minutes to
compile on 2 cores), the 7B's scanned (its memory bound is then one layer's: marked). The meshes tried, in order: every
chip on data (parameters and optimizer state whole on each), every chip on fsdp (split along the width), fsdp with
remat; the first whose compiled program fits the chip's memory is the row. Its floor is the fastest any step could
run (`gpt.program_report`); its expected range, the MFU public runs reached on that chip with models of that size
(`gpt.measured_mfu`) at this step's FLOPs a token. Neither is a measurement: no TPU has run this code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro  # noqa: E402

from gpt.errors import ConfigError  # noqa: E402
from gpt.hardware import chip_of, parse_topology  # noqa: E402
from gpt.model.config import PRESETS, GPTConfig  # noqa: E402
from gpt.model.transformer import num_params
from gpt.train.compile_only import compile_train_step  # noqa: E402
from gpt.train.trainer import TrainConfig  # noqa: E402

MODELS = {**{name: PRESETS[name] for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")},
          # Scanned: an unrolled 7B step is too slow to compile here; its memory and FLOPs are exact, its bytes
          # accessed one layer's (the row says so).
          "7B-shaped": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304,
                                 position="rope", bias=False, tied_head=False, scan_layers=True)}


@dataclasses.dataclass
class Plan:
    models: tuple[str, ...] = tuple(MODELS)
    topologies: tuple[str, ...] = ("v5e-8", "v6e-8", "v5p-128", "tpu7x-8")
    sequences_per_chip: int = 8
    block_size: int = 1024
    out: str = ""
    """A JSONL file the rows are appended to as they come (rows already there are not compiled again)."""


def plan_row(model: str, topology: str, plan: Plan) -> dict:
    """The first mesh (data, fsdp, fsdp with remat) on which `model` fits `topology`, and its report."""
    devices = parse_topology(topology).devices()
    chips, memory = len(devices), chip_of(devices[0].device_kind).usable_bytes
    for mesh, remat in ((f"data={chips}", False), (f"fsdp={chips}", False), (f"fsdp={chips}", True)):
        if 12 * num_params(MODELS[model]) / (1 if mesh.startswith("data") else chips) > memory:
            continue  # its float32 parameters and Adam moments alone are over the chip's memory: no compile needed
        config = TrainConfig.from_flags(
            model=MODELS[model].replace(dtype="bfloat16", remat=remat), mesh=mesh,
            batch_size=plan.sequences_per_chip * chips, block_size=plan.block_size, compile_only=topology)
        start = time.perf_counter()
        try:
            report = compile_train_step(config, log=lambda *_: None)
        except ConfigError as error:  # the compiler's own refusal: too large for the chip
            print(f"  {model} on {topology}, mesh {mesh}{' + remat' * remat}: {error}", flush=True)
            continue
        seconds = report.bound_seconds()
        row = {"model": model, "topology": topology, "mesh": mesh + " + remat" * remat,
               "params": num_params(MODELS[model]), "devices": report.devices,
               "gib_per_device": report.total_bytes / 2**30, "chip_gib": report.chip.memory_bytes / 2**30,
               "fits": report.fits(), "bound": max(seconds, key=seconds.get),
               "tokens_per_s": report.tokens / max(seconds.values()), "expected": report.expected_tokens_per_s(),
               "compile_s": time.perf_counter() - start,
               "report": report.lines()}
        print("\n".join(report.lines()), flush=True)
        if report.fits():
            return row
    return {"model": model, "topology": topology, "mesh": "-", "params": num_params(MODELS[model]), "fits": False}


def table(rows: list[dict]) -> str:
    """The rows as docs/sharding.md shows them; a floor below its row's expected range would mean the floor counts
    what a step can avoid, and is marked."""
    lines = ["| model | params | topology | mesh | GiB per device (of) | floor tokens/s (set by) | expected tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['model']} | {r['params'] / 1e6:,.0f} M | {r['topology']} | does not fit | - | - | - |")
            continue
        scanned = " (scanned)" * MODELS[r["model"]].scan_layers
        expected = r.get("expected")
        below = " **below a public run**" * bool(expected and r["tokens_per_s"] < expected[1])
        expected = ("no public run" if not expected else f"about {expected[0]:,.0f}" if expected[0] == expected[1]
                    else f"{expected[0]:,.0f} - {expected[1]:,.0f}")
        lines.append(f"| {r['model']} | {r['params'] / 1e6:,.0f} M | {r['topology']} | {r['mesh']} | "
                     f"{r['gib_per_device']:.2f} ({r['chip_gib']:.0f}) | {r['tokens_per_s']:,.0f} ({r['bound']})"
                     f"{scanned}{below} | {expected} |")
    return "\n".join(lines)


def main(plan: Plan) -> None:
    done = [json.loads(line) for line in Path(plan.out).read_text().splitlines()] if plan.out and Path(
        plan.out).exists() else []
    rows = []
    for model in plan.models:
        for topology in plan.topologies:
            row = next((r for r in done if (r["model"], r["topology"]) == (model, topology)), None)
            if row is None:
                row = plan_row(model, topology, plan)
                if plan.out:
                    with open(plan.out, "a") as file:
                        file.write(json.dumps(row) + "\n")
            rows.append(row)
    print(table(rows))


if __name__ == "__main__":
    main(tyro.cli(Plan))
