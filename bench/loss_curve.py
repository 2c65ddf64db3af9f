"""Draw a training run's loss curve from its metrics.jsonl (what the README shows).

    python train.py --out_dir out                      # the run (the README's figure: the default run)
    python bench/loss_curve.py --out_dir out --png bench/loss_curve.png --title "..."
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    out_dir: str = "out"
    """The training run's out_dir (its metrics.jsonl is read)."""
    png: str = "bench/loss_curve.png"
    title: str = ""
    """A caption line under the plot: say the machine, date and command."""


def main(config: CurveConfig) -> None:
    records = [json.loads(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train:
        raise SystemExit(f"{config.out_dir}/metrics.jsonl has no training records")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(*zip(*train), label="train (mean over each log interval)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    if config.title:
        fig.text(0.5, 0.01, config.title, ha="center", fontsize=7)
        fig.subplots_adjust(bottom=0.22)
    fig.savefig(config.png, dpi=120)
    print(f"wrote {config.png}: {len(train)} train and {len(val)} validation points; last val {val[-1][1]:.3f}"
          if val else f"wrote {config.png}")


if __name__ == "__main__":
    main(tyro.cli(CurveConfig))
