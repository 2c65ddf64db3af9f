"""The package's layers hold: import-linter's contracts in pyproject.toml (each layer imports only from
those below it, the packages of one layer not from each other; a model's config imports nothing of the model)
pass; and each flag is declared once."""

import subprocess
import sys
from pathlib import Path

import pytest

from training import ROOT


def test_each_layer_imports_only_from_those_below_it():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "2 kept, 0 broken" in result.stdout, result.stdout + result.stderr


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


# Flags of the same name that mean different things in different programs, declared apart on purpose.
DIFFERENT_FLAGS_OF_ONE_NAME = {
    "data": {"CorpusChoice", "EvalConfig"},  # the corpus trained on (empty: the default one); the text scored
    "init_from": {"ModelChoice", "TrainConfig"},  # a model to run; weights to fine-tune, or "scratch"
    "mesh": {"ModelChoice", "TrainConfig"},  # empty runs on one device; empty puts every device on data
    "seed": {"SampleConfig", "TrainConfig"},  # the samples' draws; the initial weights, batches and dropout
    "batch_size": {"EvalConfig", "TrainConfig"},  # windows scored together; sequences a micro-batch
    "out_dir": {"PrepareConfig", "TrainConfig", "ExportConfig"},  # the shards'; the run's; the run exported
}


def test_each_flag_is_declared_by_one_config():
    """The commands' configs share a setting by extending the dataclass that declares it (`ModelChoice`,
    `DraftChoice`, `EngineSettings`, `CompileCacheChoice`, `CorpusChoice`, `TextFieldChoice`, TrainConfig's
    nested `OptimizerConfig`), never by declaring it again: a default or a check changed in one place is
    changed for every command."""
    import collections

    from gpt.compilation_cache import CompileCacheChoice
    from gpt.data.prepare import CorpusChoice, PrepareConfig, TextFieldChoice
    from gpt.eval import EvalConfig
    from gpt.export import ExportConfig
    from gpt.inference.engine_settings import DraftChoice, EngineSettings
    from gpt.loading import ModelChoice
    from gpt.sample import SampleConfig
    from gpt.serve import ServeConfig
    from gpt.train.optimizer import OptimizerConfig
    from gpt.train.trainer import TrainConfig

    declared = collections.defaultdict(set)
    for config in (CompileCacheChoice, CorpusChoice, PrepareConfig, TextFieldChoice, EvalConfig, ExportConfig,
                   DraftChoice, EngineSettings, ModelChoice, SampleConfig, ServeConfig, OptimizerConfig, TrainConfig):
        for name in vars(config).get("__annotations__", {}):
            declared[name].add(config.__name__)
    assert {name: owners for name, owners in declared.items() if len(owners) > 1} == DIFFERENT_FLAGS_OF_ONE_NAME
