"""Progress anywhere: a bar on a terminal, a plain line (or a JSON object) every so often in a file or a pipe,
nothing with --quiet; and train.py's progress in a file its stdout is sent to."""

import io
import json
import os
import subprocess
import sys

import pytest

from gpt.progress import Progress, duration

from bounds import bound
from training import ROOT, cli_flags


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_names_the_count_its_figures_and_the_time_left():
    out = io.StringIO()
    with Progress("train", total=300, initial=100, style="lines", stream=out) as progress:
        progress.started -= 20.0  # 20 steps took 20 s: 180 are left
        progress.update(20)
        progress.report(loss=3.41234, tokens_per_s=4210.6, mfu=0.1234, grad_norm=None)
    assert out.getvalue() == "train: step 120/300 (40%), loss 3.412, 4,211 tokens/s, MFU 12.3%, ETA 3 min 0 s\n"


def test_a_report_of_an_earlier_step_names_that_step():
    out = io.StringIO()  # the trainer reads a step's figures while the next step runs
    with Progress("train", total=30, style="lines", stream=out) as progress:
        progress.update(11)
        progress.report(10, loss=2.0)
    assert out.getvalue().startswith("train: step 10/30 (33%), loss 2,")


def test_json_lines_hold_the_count_the_figures_and_the_eta():
    out = io.StringIO()
    with Progress("train", total=10, style="json", stream=out) as progress:
        progress.update(5)
        progress.report(loss=2.5)
        progress.write("step 5: val loss 2.4000", step=5, val_loss=2.4)
    first, second = map(json.loads, out.getvalue().splitlines())
    assert first["progress"] == "train" and first["step"] == 5 and first["total"] == 10 and first["loss"] == 2.5
    assert first["eta_s"] >= 0
    assert second == {"step": 5, "val_loss": 2.4}


def test_a_count_without_figures_is_a_line_once_its_interval_has_passed():
    out = io.StringIO()
    with Progress("tokenizing", total=4 * 2**20, unit="B", style="lines", stream=out, every_s=3600) as progress:
        progress.update(2**20)
        progress.tick()  # within the hour: nothing
        assert out.getvalue() == ""
        progress.every_s = 0
        progress.tick()
    assert out.getvalue().startswith("tokenizing: 1.0 of 4.0 MiB (")
    out = io.StringIO()
    with Progress("eval", unit="window", style="lines", stream=out, every_s=0) as progress:
        progress.update(1234)
        progress.tick()
    assert out.getvalue().startswith("eval: 1,234 windows, ") and out.getvalue().rstrip().endswith("windows/s")


def test_none_shows_only_the_jobs_own_lines(capsys):
    out = io.StringIO()
    with Progress("train", total=10, style="none", stream=out) as progress:
        progress.update(5)
        progress.report(loss=1.0)
        progress.tick()
        progress.write("step 5: val loss 1.0000")
    assert out.getvalue() == "step 5: val loss 1.0000\n"
    assert capsys.readouterr().err == ""


def test_auto_is_the_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Terminal())
    with Progress("train", total=10) as progress:
        assert progress.style == "bar"
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    with Progress("train", total=10) as progress:
        assert progress.style == "lines" and progress.bar is None


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (0.4, 59, 125, 3 * 3600 + 20 * 60 + 5)] == ["0 s", "59 s", "2 min 5 s", "3 h 20 min"]


@pytest.mark.slow
def test_train_py_sent_to_a_file_writes_its_steps_there(tmp_path, corpus):
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device

    def train(name: str, *flags: str) -> str:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as file:  # as `python train.py ... > log`
            done = subprocess.run([sys.executable, str(ROOT / "train.py"), *cli_flags(
                data=(corpus,), out_dir=str(tmp_path / name), max_steps=10, eval_interval=5, num_devices=None), *flags],
                env=env, stdout=file, stderr=subprocess.PIPE, text=True, timeout=bound(600))
        assert done.returncode == 0, done.stderr[-3000:]
        return log.read_text()

    text = train("lines")
    steps = [line for line in text.splitlines() if line.startswith("train: step ")]
    assert [line.split(",")[0] for line in steps] == ["train: step 5/10 (50%)", "train: step 10/10 (100%)"], text
    assert "loss" in steps[0] and "tokens/s" in steps[0] and "ETA" in steps[0]
    assert "step 5: val loss" in text and "step 10: val loss" in text
    quiet = train("quiet", "--quiet")
    assert "train: step" not in quiet and "step 10: val loss" in quiet
    records = [json.loads(line) for line in train("json", "--log_format", "json").splitlines() if line.startswith("{")]
    assert [r["step"] for r in records if r.get("progress") == "train"] == [5, 10]
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
