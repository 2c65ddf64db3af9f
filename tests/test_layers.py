"""The package's layers hold: import-linter's contract in pyproject.toml (each layer imports only from
those below it; the packages of one layer not from each other) passes."""

import subprocess
import sys
from pathlib import Path

import pytest

from training import ROOT


def test_each_layer_imports_only_from_those_below_it():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "1 kept, 0 broken" in result.stdout, result.stdout + result.stderr


def test_no_file_of_the_package_is_ignored_by_git():
    """A module that .gitignore hides works in the checkout that wrote it and is missing from every clone."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--", "gpt", "tests",
                             "bench", ":(glob)*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    # Compiled extensions (gpt/model/_cpu_kernels*.so) are the install's output, made again in every clone.
    hidden = [line for line in result.stdout.splitlines() if "__pycache__" not in line and not line.endswith(".so")]
    assert not hidden, f"ignored by .gitignore, so absent from a clone: {hidden}"


def test_sampling_serving_and_evaluating_import_nothing_of_the_trainer():
    """sample.py, serve.py and gpt.eval start without the trainer's packages (Orbax and the rest: a quarter
    of a second of every start); reading a training run's checkpoint imports them then."""
    modules = ("gpt.sample", "gpt.serve", "gpt.eval")
    check = f"import sys, {', '.join(modules)}; print([m for m in ('gpt.train', 'orbax.checkpoint') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
