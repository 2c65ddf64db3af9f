"""The training loop runs ahead of the device: it reads metrics late and batches early, and guarantees
no less for it (a non-finite step is never saved and is named, the logged losses are the steps' own, a
run directory of the synchronous loop resumes)."""

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.data.prefetch import Prefetch
from gpt.inference.sampling import GREEDY
from gpt.train import trainer as train_module
from gpt.train.checkpoint import CheckpointManager, load_model
from gpt.train.trainer import NonFiniteStep, TrainConfig, plan, setup

from bounds import bound
from training import ROOT, TINY, cli_flags, flat, run

# The last commit whose loop read every step's metrics before dispatching the next one.
SYNCHRONOUS_LOOP_COMMIT = "6c70bb5"
# The last commit of the flat package (before gpt.model, gpt.data, gpt.train and gpt.inference).
FLAT_PACKAGE_COMMIT = "0768f69"
# The last commit before each weight's facts were declared once (gpt/model/parameters.py) and the optimizer's
# settings nested in TrainConfig.
SEPARATE_DECLARATIONS_COMMIT = "6be6b79"


# ------------------------------------------------------------------------------------------ Prefetch

def test_prefetch_gives_every_item_in_order_and_never_more_than_depth_ahead():
    made, ahead = [], []

    def make(i):
        made.append(i)
        return i * 10

    for depth in (0, 1, 3):
        made.clear()
        with Prefetch(make, range(20), depth) as items:
            got = []
            for item in items:
                time.sleep(0.002)  # a slow consumer: the producer fills the queue and waits
                ahead.append(len(made) - len(got) - 1)
                got.append(item)
        assert got == [i * 10 for i in range(20)]
        # The item being handed over, `depth` in the queue, and one the producer has made but not yet put.
        assert max(ahead) <= depth + 1, (depth, max(ahead))
        ahead.clear()


def test_prefetch_raises_the_producers_error_where_its_item_is_asked_for():
    def make(i):
        if i == 3:
            raise ValueError("bad batch 3")
        return i

    with Prefetch(make, range(10), depth=2) as items:
        assert [next(items) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="bad batch 3"):
            next(items)


def test_leaving_a_prefetch_early_stops_its_thread():
    before = threading.active_count()
    with Prefetch(lambda i: i, range(10**9), depth=2) as items:
        assert next(items) == 0
    assert threading.active_count() == before


# ------------------------------------------------------------------------------------------ the loop

@pytest.mark.slow
def test_a_step_that_turns_non_finite_while_the_loop_runs_ahead_is_named_and_nothing_after_it_is_saved(
        tmp_path, corpus, monkeypatch):
    # Step 5's input parameters are made NaN on the device (no host sync). Steps 1-3 log at 3 (read after
    # step 4 is dispatched), 4 is saved; 5 turns non-finite; 6 is a log step, read after 7 is dispatched.
    calls = []
    compiled_step = train_module._compiled_within_memory  # the run's step, compiled before its first call

    def poisoned_at_step_5(*args, **kwargs):
        step = compiled_step(*args, **kwargs)

        def call(params, opt_state, batch, key):
            calls.append(len(calls) + 1)
            if len(calls) == 5:
                params = jax.tree.map(lambda p: p * jnp.nan, params)
            return step(params, opt_state, batch, key)

        return call

    monkeypatch.setattr(train_module, "_compiled_within_memory", poisoned_at_step_5)
    with pytest.raises(NonFiniteStep, match=r"^step 5 gave a non-finite loss nan, grad norm nan; it was not saved. "
                                            r"The newest checkpoint, step 4 in .*, is finite"):
        run(tmp_path, corpus, max_steps=20, log_interval=3, checkpoint_interval=4)
    assert len(calls) == 7, "step 5's flag is read only once step 7 has been dispatched"
    out = tmp_path / "run"
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [4]
    assert all(np.isfinite(leaf).all() for leaf in flat(load_model(out)))
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3], "nothing after the non-finite step is logged"


@pytest.mark.slow
def test_the_logged_losses_are_those_of_a_synchronous_run_of_the_same_config(tmp_path, corpus):
    config = TrainConfig.from_flags(**{**TINY, "data": (corpus,), "out_dir": str(tmp_path / "run"), "max_steps": 9,
                            "log_interval": 4, "eval_interval": 100, "checkpoint_interval": 100})
    run(tmp_path, corpus, max_steps=9, log_interval=4)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [record for record in records if "loss" in record]

    # The same steps by hand: read every loss as soon as its step is dispatched, no thread, nothing ahead.
    reference_dir = tmp_path / "reference"
    checked = plan(config.replace(out_dir=str(reference_dir)), log=lambda *_: None)
    checkpoints = CheckpointManager(reference_dir)
    by_hand = setup(checked, checkpoints, log=lambda *_: None)
    losses = []
    for step in range(9):
        by_hand.params, by_hand.opt_state, metrics = by_hand.train_step(
            by_hand.params, by_hand.opt_state, by_hand.batch(step), by_hand.key(step))
        losses.append(float(metrics["loss"]))
    by_hand.writer.close()
    checkpoints.close()
    assert [r["step"] for r in logged] == [4, 8, 9]
    assert [r["loss"] for r in logged] == [float(np.mean(losses[0:4])), float(np.mean(losses[4:8])), losses[8]]


def train_with_the_code_of(commit: str, tmp_path, corpus) -> None:
    """Train.py as it was at `commit` (taken from git history into tmp_path/old-code) runs the first 4 of 8
    steps of TINY in tmp_path/resumed/run."""
    flags = cli_flags(data=(corpus,), out_dir=str(tmp_path / "resumed" / "run"), max_steps=8, stop_after=4,
                      eval_interval=100, checkpoint_interval=100)
    if shutil.which("git") is None:
        pytest.skip("needs git, to take the code of an earlier commit from history")
    old = tmp_path / "old-code"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "gpt", "train.py"], capture_output=True)
    if archive.returncode != 0:
        shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True).stdout.strip() == "true"
        pytest.skip(f"commit {commit} is not in this checkout's history"
                    + (": a shallow clone (`git fetch --unshallow` brings it)" if shallow else ""))
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    env = {**os.environ, "PYTHONPATH": str(old), "JAX_PLATFORMS": "cpu"}
    written = subprocess.run([sys.executable, str(old / "train.py"), *flags], cwd=old, env=env,
                             capture_output=True, text=True, timeout=bound(300))
    assert written.returncode == 0, written.stderr[-3000:]


def assert_it_resumes_bitwise(tmp_path, corpus) -> None:
    """This code resumes tmp_path/resumed/run at step 4 and ends where a run straight to step 8 does."""
    resumed = run(tmp_path / "resumed", corpus, max_steps=8)
    straight = run(tmp_path / "straight", corpus, max_steps=8)
    assert resumed.start_step == 4 and resumed.step == 8
    for a, b in zip(flat(straight.params), flat(resumed.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_run_directory_written_by_the_synchronous_loop_resumes_bitwise(tmp_path, corpus):
    train_with_the_code_of(SYNCHRONOUS_LOOP_COMMIT, tmp_path, corpus)
    out = tmp_path / "resumed" / "run"
    manager = CheckpointManager(out, async_save=False)
    assert "prefetch" not in manager.metadata(4)["train_config"], "written by the synchronous loop's code"
    manager.close()

    assert_it_resumes_bitwise(tmp_path, corpus)


@pytest.mark.slow
@pytest.mark.parametrize("commit", [FLAT_PACKAGE_COMMIT, SEPARATE_DECLARATIONS_COMMIT])
def test_a_run_directory_written_by_earlier_code_resumes_samples_and_exports(commit, tmp_path, corpus):
    from gpt.export import ExportConfig
    from gpt.export import main as export
    from gpt.model import gpt2
    from gpt.sample import SampleConfig, sample

    train_with_the_code_of(commit, tmp_path, corpus)
    out = tmp_path / "resumed" / "run"
    greedy = dict(init_from=str(out), start="def ", num_samples=1, max_new_tokens=8, sampling=GREEDY,
                  compile_cache=False)
    written = sample(SampleConfig(**greedy), io.StringIO())  # its step 4, read by this code
    run(tmp_path / "own", corpus, max_steps=8, stop_after=4)  # this code's own step 4 of the same run
    assert written == sample(SampleConfig(**dict(greedy, init_from=str(tmp_path / "own" / "run"))), io.StringIO())

    assert_it_resumes_bitwise(tmp_path, corpus)
    export(ExportConfig(out_dir=str(out), hf_dir=str(tmp_path / "hf"), step=4))
    exported = gpt2.load(tmp_path / "hf")
    tokens = np.asarray([[1, 2, 3, 4]], np.int32)
    np.testing.assert_array_equal(np.asarray(exported(tokens)), np.asarray(load_model(out, step=4)(tokens)))
