"""The GPU session's scripts run on the CPU at tiny shapes, so that they cannot rot between GPU runs."""

import json
import math
import os
import subprocess
import sys

import pytest

from training import ROOT

ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_gpu_bench_smoke_measures_every_configuration_and_the_torch_peer(tmp_path):
    rows_path = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke", "--json", str(rows_path)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_path.read_text())
    ours = [row for row in rows if row["impl"] == "jax"]
    assert sorted((row["scan_layers"], row["remat"]) for row in ours) == [(False, False), (False, True),
                                                                          (True, False), (True, True)]
    assert [row["impl"] for row in rows if row["impl"] == "torch"] == ["torch"]
    for row in rows:
        assert row["micro_batch"] * row["accumulation"] * row["block_size"] == 4 * 2 * 64
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert row["first_step_s"] > 0
    assert "| gpt (jax) | smoke | True | True | 4 x 2 |" in done.stdout


@pytest.mark.slow
def test_gpu_check_smoke_passes_and_reports_every_check():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = [line for line in done.stdout.splitlines() if line.startswith("| ") and "| yes |" in line]
    assert len(checks) == 8, done.stdout
