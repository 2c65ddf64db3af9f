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
    rows_path, profiles = tmp_path / "rows.json", tmp_path / "profiles"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke", "--json", str(rows_path),
                           "--profile_dir", str(profiles)], env=ENV, capture_output=True, text=True, timeout=600)
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
    # Each of our configurations traced, and its trace sorted by bench/step_profile.py.
    assert sorted(path.name for path in profiles.iterdir()) == [
        "smoke-scan0-remat0", "smoke-scan0-remat1", "smoke-scan1-remat0", "smoke-scan1-remat1"]
    for path in profiles.iterdir():
        table = subprocess.run([sys.executable, str(ROOT / "bench" / "step_profile.py"), str(path)], env=ENV,
                               capture_output=True, text=True, timeout=120)
        assert table.returncode == 0 and "| mlp_up bwd |" in table.stdout, table.stderr[-2000:]


@pytest.mark.slow
def test_gpu_check_smoke_passes_and_reports_every_check():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = [line for line in done.stdout.splitlines() if line.startswith("| ") and "| yes |" in line]
    assert len(checks) == 8, done.stdout
