"""The package's layers hold: import-linter's contract in pyproject.toml (each layer imports only from
those below it; the packages of one layer not from each other) passes."""

import subprocess
import sys
from pathlib import Path

from training import ROOT


def test_each_layer_imports_only_from_those_below_it():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "1 kept, 0 broken" in result.stdout, result.stdout + result.stderr
