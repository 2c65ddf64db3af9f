"""What public training runs measured on each chip, as model FLOPs utilization (MFU) by model size: the expected
range a `--compile_only` report gives beside its floor. A range read from other people's runs of other code, never a
promise: the floor (`gpt.program_report`) says what no run can beat; this says where runs that were tuned landed.

Each figure is as its source states it, for the chip JAX names (`gpt.hardware.CHIPS`); docs/sharding.md cites each
with its address. A chip and size with no public measurement read here has no range (TPU7x; models under 1B
parameters on v4 and v5p), and the report says so.
"""

from __future__ import annotations

import dataclasses

from gpt.hardware import chip_of

__all__ = ["Measurement", "MEASUREMENTS", "SMALL_MODEL", "expected_mfu"]

SMALL_MODEL = 1e9
"""Parameters below which a model is compared only with small models' runs: MFU falls with the width (a small
model's matrices feed the chip's systolic arrays less well), so a 16B model's MFU says little of a 124M one's."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One public training run's MFU."""

    device_kind: str
    """`gpt.hardware.Chip.device_kind` of the chip it ran on."""
    params: float
    mfu: float
    """Model FLOPs over the chip's bf16 peak, as the source computed it."""
    source: str
    """Who measured it and where (docs/sharding.md, "What to expect", gives each address and date)."""


_MAXTEXT_V5E = "MaxText README, TPU v5e table (1x v5e-256)"
_MAXTEXT_V5P = "MaxText README, TPU v5p table"
_MAXTEXT_TIERS = "MaxText docs, optimized models tiering (v6e-256, gold)"
_MAXTEXT_V4 = "MaxText README (2023), TPU v4 tables"
MEASUREMENTS = (
    Measurement("TPU v5 lite", 16e9, 0.6110, _MAXTEXT_V5E),
    Measurement("TPU v5 lite", 32e9, 0.6686, _MAXTEXT_V5E),
    Measurement("TPU v5 lite", 64e9, 0.5990, _MAXTEXT_V5E),
    Measurement("TPU v5 lite", 128e9, 0.5606, _MAXTEXT_V5E),
    Measurement("TPU v5 lite", 164e6, 0.74, "vorushin.github.io, its v5e run"),
    Measurement("TPU v6 lite", 164e6, 0.465, "vorushin.github.io, its v6e run"),
    Measurement("TPU v6 lite", 124e6, 0.23, "nor-blog.pages.dev, modded-nanogpt in JAX on v6e-8"),
    Measurement("TPU v6 lite", 8e9, 0.4546, _MAXTEXT_TIERS),
    Measurement("TPU v6 lite", 70e9, 0.438, _MAXTEXT_TIERS),
    Measurement("TPU v6 lite", 70e9, 0.5033, _MAXTEXT_TIERS),
    Measurement("TPU v5", 32e9, 0.7147, "MaxText configs/v5p README (1x v5p-128)"),
    Measurement("TPU v5", 64e9, 0.7031, _MAXTEXT_V5P),
    Measurement("TPU v5", 128e9, 0.6868, _MAXTEXT_V5P),
    Measurement("TPU v5", 512e9, 0.6399, _MAXTEXT_V5P),
    Measurement("TPU v5", 70e9, 0.654, "MaxText docs, optimized models tiering (Llama 2 70B, v5p, gold)"),
    Measurement("TPU v4", 22e9, 0.567, _MAXTEXT_V4),
    Measurement("TPU v4", 52e9, 0.560, _MAXTEXT_V4),
)


def expected_mfu(device_kind: str, params: float) -> tuple[float, float, list[Measurement]] | None:
    """(lowest, highest MFU, the runs) of the public runs on `device_kind`'s chip of models on `params`' side of
    `SMALL_MODEL`; None where there are none."""
    chip = chip_of(device_kind)
    if chip is None:
        return None
    runs = [m for m in MEASUREMENTS
            if m.device_kind == chip.device_kind and (m.params < SMALL_MODEL) == (params < SMALL_MODEL)]
    if not runs:
        return None
    return min(m.mfu for m in runs), max(m.mfu for m in runs), runs
