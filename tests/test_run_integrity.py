"""A run you can trust when things go wrong: finite checkpoints only, one writer per out_dir, resume only of
the same run, corruption caught with a fallback, failures that say what happened once, and clear exits."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from gpt.errors import ConfigError, DiskFull, RunFailed
from gpt.model.config import GPTConfig
from gpt.run_dir import RunLocked
from gpt.train.checkpoint import CheckpointManager, is_finite, load_model
from gpt.train.optimizer import OptimizerConfig
from gpt.train.trainer import NonFiniteStep, TrainConfig

from bounds import bound
from json_fields import HOW, changed, fields
from training import ROOT, TINY, cli_flags, flat, free_port, run

ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}


def train_process(*flags, env=ENV, python_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """train.py with `flags`, run by `python *python_args train.py` (a `-c` script that runs train.py itself)."""
    return subprocess.Popen([sys.executable, *python_args, str(ROOT / "train.py"), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def wait_for_step(out: Path, step: int, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not logged_steps(out) or logged_steps(out)[-1] < step:
        assert process.poll() is None, process.communicate()
        assert time.time() < deadline, f"no step {step} logged in {seconds} s"
        time.sleep(0.2)


def saved_steps(out: Path) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate()


# ------------------------------------------------------------------------------------------ finite only

@pytest.mark.slow
def test_a_diverging_run_stops_and_every_saved_checkpoint_is_finite(tmp_path, corpus):
    with pytest.raises(NonFiniteStep, match=r"step \d+ gave a non-finite .*it was not saved"):
        run(tmp_path, corpus, max_steps=30, lr=1e4, min_lr=1.0, checkpoint_interval=1)
    out = tmp_path / "run"
    steps = saved_steps(out)
    assert steps, "the first steps are finite and should have been saved"
    for step in steps:
        assert all(np.isfinite(leaf).all() for leaf in flat(jax.tree.leaves(load_model(out, step=step))))
    # Its parameters are finite but already huge, so training on from them diverges again at once; what
    # matters is that the resume restores the newest (finite) step rather than refusing or falling back.
    lines = []
    with pytest.raises(NonFiniteStep, match=f"step {steps[-1] + 1} gave"):
        run(tmp_path, corpus, max_steps=30, lr=1e-3, resume_anyway=True, log=lines.append)
    assert f"resumed from {out.absolute() / 'checkpoints' / str(steps[-1])}" in lines
    assert not any("corrupt" in line for line in lines)


# ------------------------------------------------------------------------------------------ one writer

@pytest.mark.slow
def test_one_writer_per_out_dir_and_a_killed_runs_lock_does_not_block_its_resume(tmp_path, corpus):
    out = tmp_path / "run"
    flags = cli_flags(data=(corpus,), out_dir=str(out), max_steps=100000, checkpoint_interval=5, log_interval=1,
                      eval_interval=100000, num_devices=None)  # ENV: the one CPU device
    together = [train_process(*flags), train_process(*flags)]
    try:
        # Started together: one of them refuses at once, naming the holder.
        deadline = time.time() + bound(120)
        while all(p.poll() is None for p in together):
            assert time.time() < deadline, "neither trainer refused"
            time.sleep(0.2)
        refused = next(p for p in together if p.poll() is not None)
        first = next(p for p in together if p is not refused)
        _, err = refused.communicate()
        assert refused.returncode == 2, err
        assert "is in use by another training run (pid" in err and "on host" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err

        # Five steps later, a run with another lr refuses too, and leaves the first's files untouched.
        wait_for_step(out, 5, first)
        later = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags, "--lr=0.01"], env=ENV,
                               capture_output=True, text=True, timeout=bound(120))
        assert later.returncode == 2 and "is in use by another training run" in later.stderr, later.stderr
        wait_for_step(out, 12, first)
    finally:
        for process in together:
            stop(process)  # SIGKILL: the lock file stays, the kernel's lock does not
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1)), "each step logged once, by one run"
    last = saved_steps(out)[-1]
    manager = CheckpointManager(out, async_save=False)
    assert manager.metadata(last)["identity"]["training"]["lr"] == TINY["lr"]
    manager.close()
    resumed = run(tmp_path, corpus, max_steps=100000, stop_after=last + 2, checkpoint_interval=5, log_interval=1,
                  eval_interval=100000)
    assert resumed.start_step == last and resumed.step == last + 2
    assert logged_steps(out) == list(range(1, last + 3)), "the steps after the checkpoint were logged again, once"


@pytest.mark.slow
def test_a_second_run_in_the_same_process_is_refused_while_the_first_holds_the_lock(tmp_path, corpus):
    from gpt.run_dir import RunLock

    with RunLock(tmp_path / "run"):
        with pytest.raises(RunLocked, match=f"pid {os.getpid()} on host"):
            run(tmp_path, corpus)
    run(tmp_path, corpus, max_steps=3)  # released: the same out_dir is usable again


# ------------------------------------------------------------------------------------------ identity

@pytest.mark.slow
@pytest.mark.parametrize("change, field", [
    ("corpus", "corpus.sha256"),
    ("width", "model.n_embd: 64 -> 32"),
    ("lr", "training.lr: 0.003 -> 0.01"),
])
def test_resume_of_a_different_run_is_refused_naming_the_field(tmp_path, corpus, change, field):
    run(tmp_path, corpus, max_steps=4, stop_after=2)
    train_bin = tmp_path / "run" / "data" / "train_00000.bin"
    before = train_bin.read_bytes()
    other = tmp_path / "other.txt"
    other.write_text(Path(corpus).read_text()[:150_000])
    changes = {"corpus": {"corpus": str(other)},
               "width": {"model": GPTConfig.preset("small", n_layer=2, n_head=2, n_embd=32)},
               "lr": {"lr": 0.01}}[change]
    with pytest.raises(ConfigError, match=f"of a different run; these settings differ from it: .*{field}"):
        run(tmp_path, changes.pop("corpus", corpus), max_steps=4, **changes)
    assert train_bin.read_bytes() == before, "the run's tokenized corpus must not be overwritten"
    if change == "lr":  # the one a user may mean: allowed when asked for
        assert run(tmp_path, corpus, max_steps=4, lr=0.01, resume_anyway=True).start_step == 2


def test_a_record_written_before_a_setting_existed_takes_its_default():
    # A checkpoint from before the recipe's settings existed resumes with them at their defaults, and is
    # another run when one of them is set otherwise.
    from gpt.run_dir import check_identity, identity
    from gpt.train.trainer import _default_identity

    defaults = _default_identity()
    current = identity({"n_embd": 64, "qk_norm": False, "tied_head": True}, dict(defaults["training"], optimizer="adamw"),
                       {"sha256": "x"})
    older = {"model": {"n_embd": 64}, "training": {k: v for k, v in current["training"].items()
                                                   if k not in ("muon_lr", "schedule", "label_smoothing")},
             "corpus": {"sha256": "x"}}  # no optimizer group either
    check_identity(older, current, "out", 4, resume_anyway=False, defaults=defaults)
    with pytest.raises(ConfigError, match="these settings differ from it: model.qk_norm: False -> True"):
        check_identity(older, identity({"n_embd": 64, "qk_norm": True, "tied_head": True},
                                       dict(defaults["training"], optimizer="adamw"), {"sha256": "x"}),
                       "out", 4, resume_anyway=True, defaults=defaults)
    with pytest.raises(ConfigError, match="optimizer.optimizer: 'adamw' -> 'muon'"):
        check_identity(older, identity({"n_embd": 64}, dict(defaults["training"], optimizer="muon"), {"sha256": "x"}),
                       "out", 4, resume_anyway=True, defaults=defaults)


def test_every_field_of_a_runs_identity_record_changed_resumes_or_is_one_line():
    # The record a resume compares (a checkpoint's "identity"), each field removed, of another type or extreme,
    # and the whole record not an object: the run it names, another run's refusal, or an unreadable record's.
    from gpt.run_dir import check_identity
    from gpt.train.trainer import _default_identity

    current = _default_identity()
    records = [changed(current, path, how) for path in fields(current) for how in HOW] + [[], "x", 5, [current]]
    outcomes = {"resumed": 0, "refused": 0}
    for record in records:
        for resume_anyway in (False, True):
            try:
                check_identity(record, current, "out", 4, resume_anyway, log=lambda _: None, defaults=current)
                outcomes["resumed"] += 1
            except ConfigError as error:  # an AttributeError or a TypeError had been possible
                assert "\n" not in str(error) and str(error).startswith("out holds checkpoint step 4"), str(error)
                outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["resumed"] > 10, outcomes


# ------------------------------------------------------------------------------------------ corruption

def _largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)


def _edit_checksum(step_dir: Path) -> None:
    """Bytes that decode cleanly but differ: the recorded checksum of one array no longer matches."""
    path = next(p for p in (step_dir / "metadata").rglob("*") if p.is_file() and "checksums" in p.read_text())
    metadata = json.loads(path.read_text())
    name = sorted(metadata["checksums"]["params"])[0]
    metadata["checksums"]["params"][name][0] ^= 1
    path.write_text(json.dumps(metadata))


@pytest.fixture
def broken_reads_collected():
    yield
    gc.collect()


def breaks_reads(test):
    """For a test that breaks a checkpoint on purpose: a truncated array fails orbax's read with its other
    reads still pending, and Python reports those coroutines, never awaited, when they are collected. They
    are collected as the test ends, under its filter; left to the collector, they were reported as
    warnings in whichever test ran next. A pending read that completes after orbax has closed its event
    loop is reported too (its callback finds the loop closed), as an exception "ignored in: None"."""
    for reported in (r"Exception ignored in. <coroutine object _read_array_index_and_device_put",
                     r"Exception ignored in. None[\s\S]*RuntimeError. Event loop is closed"):
        test = pytest.mark.filterwarnings(f"ignore:{reported}")(test)
    return pytest.mark.usefixtures("broken_reads_collected")(test)


@pytest.mark.slow
@breaks_reads
@pytest.mark.parametrize("damage", [_flip_bytes, _truncate, _edit_checksum], ids=["flipped", "truncated", "checksum"])
def test_a_corrupt_latest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_previous(tmp_path, corpus, damage):
    straight = run(tmp_path / "a", corpus, max_steps=6)
    run(tmp_path / "b", corpus, max_steps=6, stop_after=4, checkpoint_interval=2)
    out = tmp_path / "b" / "run"
    step_dir = out / "checkpoints" / "4"
    damage(step_dir if damage is _edit_checksum else _largest_array_file(step_dir))
    lines = []
    summary = run(tmp_path / "b", corpus, max_steps=6, checkpoint_interval=2, log=lines.append)
    reports = [line for line in lines if "is corrupt" in line]
    assert len(reports) == 1 and "checkpoint step 4 is corrupt" in reports[0] and "\n" not in reports[0], lines
    assert (out / "corrupt_checkpoints" / "4").is_dir(), "moved aside, never deleted"
    assert summary.start_step == 2 and summary.step == 6
    for a, b in zip(flat(straight.params), flat(summary.params)):
        np.testing.assert_array_equal(a, b)  # the same as a run that never stopped (and so resumed from 2)


@pytest.mark.slow
@breaks_reads
def test_sampling_skips_a_corrupt_checkpoint_without_moving_it(tmp_path, corpus, capsys):
    run(tmp_path, corpus, max_steps=4, checkpoint_interval=2)
    out = tmp_path / "run"
    _truncate(_largest_array_file(out / "checkpoints" / "4"))
    model = load_model(out)
    assert "skipped corrupt checkpoint step 4" in capsys.readouterr().out
    assert is_finite(jax.tree.leaves(model)) and (out / "checkpoints" / "4").is_dir()


# ------------------------------------------------------------------------------------------ failed saves

def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_that_save_with_the_os_error_last(tmp_path, corpus):
    disk = tmp_path / "small_disk"
    if not _tmpfs(disk, "40m"):
        pytest.skip("mounting a small tmpfs is not permitted here (needs root in a namespace that allows it)")
    try:
        out = disk / "run"
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *cli_flags(data=(corpus,), out_dir=str(out), max_steps=200,
                                                               checkpoint_interval=2, keep_checkpoints=100,
                                                               eval_interval=1000, num_devices=None)],
            env=ENV, capture_output=True, text=True, timeout=bound(300))
        last_line = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2, result.stderr[-3000:]  # the user's to make room: as bad input
        assert last_line.startswith("error: saving checkpoint step") and "No space left on device" in last_line, last_line
        assert result.stderr.count("Traceback") == 0, result.stderr[-3000:]
        intact = saved_steps(out)
        assert intact, "the saves before the disk filled are kept"
        assert f"the last complete checkpoint is step {intact[-1]}" in last_line
        assert is_finite(jax.tree.leaves(load_model(out, step=intact[-1])))  # reads and verifies
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ------------------------------------------------------------------------------------------ clear failures

USER_ERRORS = [
    ("train.py", ["--data", "/no/such/file.txt"], "'/no/such/file.txt' is not a file, a directory or a matching glob"),
    ("train.py", ["--data", "/bin/ls"], "'/bin/ls' is binary (a NUL byte in its first 8192 bytes)"),
    ("train.py", ["--mesh", "data=3"], "mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but there are 1"),
    ("train.py", ["--init_from", "/no/such/dir"], "'/no/such/dir' is neither a directory nor a GPT-2 hub name"),
    ("train.py", ["--warmup_steps", "50", "--max_steps", "10"], "warmup_steps=50 must be in [0, max_steps=10)"),
    ("train.py", ["--lr", "inf"], "OptimizerConfig.lr must be positive and finite, got inf"),
    ("train.py", ["--out_dir", "/etc/hostname"], "TrainConfig.out_dir '/etc/hostname' is a file, not a directory"),
    ("train.py", ["--out_dir", "/etc/hostname/run"], "out_dir '/etc/hostname/run' cannot be made: [Errno 20]"),
    ("train.py", ["--beta2", "1.5"], "OptimizerConfig.beta2 must be in [0, 1), got 1.5"),
    ("train.py", ["--weight_decay", "nan"], "OptimizerConfig.weight_decay must be >= 0 and finite, got nan"),
    ("train.py", ["--grad_clip", "-1"], "OptimizerConfig.grad_clip must be >= 0 and finite, got -1.0"),
    ("train.py", ["--peak_flops", "nan"], "TrainConfig.peak_flops must be positive and finite, got nan"),
    ("train.py", ["--seed", "-1"], "TrainConfig.seed must be in [0, 2**63), got -1"),
    ("train.py", ["--batch_size", "100000000"], "TrainConfig.batch_size=100000000 x grad_accum=1 needs about"),
    ("sample.py", ["--num_samples", "20000000000"], "SampleConfig.num_samples=20000000000 needs about"),
    ("train.py", ["--sample_tokens", "-5"], "TrainConfig.sample_tokens must be >= 0, got -5"),
    ("sample.py", ["--temperature", "-1"], "temperature must be >= 0 (0 is greedy) and finite, got -1.0"),
    ("sample.py", ["--draft", "ngram", "--draft_tokens", "64"], "draft_tokens must be an integer in [1, 32], got 64"),
    ("sample.py", ["--init_from", "/no/such/run"], "--init_from '/no/such/run' is not a training out_dir"),
    ("sample.py", ["--draft", "/no/such/run"], "--draft '/no/such/run' is not none, ngram, int8, a training out_dir"),
]


@pytest.fixture(scope="module")
def user_error_outcomes(tmp_path_factory) -> list[dict]:
    """Each of USER_ERRORS run as `python script flags` runs it (the script as __main__), all in one fresh
    process (tests/cli_errors.py: one interpreter start for all of them), each in a working directory of its
    own: exit status, stderr (with JAX's compile log on) and whether an exception escaped the script."""
    cases, base = [], tmp_path_factory.mktemp("user_errors")
    for i, (script, flags, _) in enumerate(USER_ERRORS):
        (base / str(i)).mkdir()
        own_dir = ["--out_dir", str(base / str(i) / "o")] if script == "train.py" else []  # a flag's own wins
        cases.append([script, [*own_dir, *flags], str(base / str(i))])
    (base / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_errors.py"), str(base / "cases.json")],
                          env={**ENV, "JAX_LOG_COMPILES": "1"}, capture_output=True, text=True, timeout=bound(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(USER_ERRORS)), ids=lambda i: f"{USER_ERRORS[i][0]}-{USER_ERRORS[i][1][0]}")
def test_user_errors_are_one_line_exit_2_and_come_before_any_compile(user_error_outcomes, case):
    message, outcome = USER_ERRORS[case][2], user_error_outcomes[case]
    stderr = outcome["stderr"]
    assert outcome["status"] == 2 and not outcome["escaped"], stderr
    lines = stderr.strip().splitlines()
    assert lines[-1] == f"error: {lines[-1][7:]}" and message in lines[-1], stderr
    assert "Traceback" not in stderr
    assert "Compiling" not in stderr and "Finished XLA compilation" not in stderr, "compiled first"


@pytest.mark.slow
def test_newcomer_defaults_work(tmp_path, corpus, capsys):
    assert OptimizerConfig(max_steps=10).warmup == 1 and OptimizerConfig().warmup == 30  # short runs clamp the warmup
    with pytest.raises(ConfigError, match=r"warmup_steps=10 must be in \[0, max_steps=10\)"):
        TrainConfig.from_flags(warmup_steps=10, max_steps=10)  # no step left for the decay (optax would fail at compile)
    tiny = run(tmp_path / "tiny", corpus, model=GPTConfig.preset("tiny"), max_steps=2, block_size=None, warmup_steps=None)
    assert tiny.step == 2  # the tiny preset's vocabulary is widened to the tokenizer's
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # --no-compile_cache: main() would turn JAX's persistent cache on for the rest of this test process.
    # A context of 48, as the last run's: the two share one compiled train step.
    flags = [*cli_flags(data=(corpus,), out_dir=str(tmp_path / "again"), max_steps=3, sample_tokens=0),
             "--model.block_size=48", "--no-compile_cache"]
    assert script.main(flags) == 0
    assert script.main(flags) == 0  # a finished out_dir: nothing to do, no crash
    # The closing sample asks for no more tokens than the model's context holds (the tiny preset's is 64,
    # below the default 200): it had failed the run at its very end.
    small_context = [*cli_flags(data=(corpus,), out_dir=str(tmp_path / "sampled"), max_steps=3, sample_tokens=200),
                     "--model.block_size=48", "--no-compile_cache"]
    capsys.readouterr()
    assert script.main(small_context) == 0
    sample = capsys.readouterr().out.split("a sample:\n", 1)[1]
    assert sample.startswith("def ") and len(sample) > 40


def test_every_flag_has_help(capsys):
    from gpt.cli import parse_train_config

    with pytest.raises(SystemExit):
        parse_train_config(["--help"])
    text = capsys.readouterr().out
    import dataclasses

    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    names += [f"model.{f.name}" for f in dataclasses.fields(GPTConfig)]
    for name in names:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        after = text[text.index(flag) + len(flag):]
        entry = after[: after.find("│ --") if "│ --" in after else len(after)]
        words = entry.replace("│", " ").split("(default")[0].split()
        assert len(words) > 1, f"{flag} has no help text"  # more than its metavar


# ------------------------------------------------------------------------------------------ signals, multi-host

@pytest.mark.slow
def test_two_processes_one_device_each_stop_together_when_only_one_gets_sigterm(tmp_path, corpus):
    out = tmp_path / "run"
    port = free_port()
    env = {**ENV, "JAX_PLATFORMS": "cpu"}  # one CPU device per process: the one-GPU-per-host layout
    flags = [*cli_flags(data=(corpus,), out_dir=str(out), max_steps=100000, checkpoint_interval=100000,
                        eval_interval=100000, log_interval=1, num_devices=None),
             "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2"]
    workers = [train_process(*flags, "--process_id", str(i), env=env) for i in range(2)]
    try:
        wait_for_step(out, 3, workers[0], seconds=180)
        workers[1].send_signal(signal.SIGTERM)
        outputs = [w.communicate(timeout=bound(180)) for w in workers]
    finally:
        for worker in workers:
            stop(worker)
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps = saved_steps(out)
    assert len(steps) == 1 and steps[0] >= 3, steps  # one save, of one step, by both processes
    assert is_finite(jax.tree.leaves(load_model(out)))


@pytest.mark.slow
def test_a_process_that_waits_too_long_for_the_corpus_stops_with_a_clear_error(tmp_path, corpus_text):
    """Process 0 prepares the corpus while the others wait at a barrier; past --prepare_timeout_s they
    stop with a one-line error naming the directory and the bound, and no checkpoint is written."""
    out, big = tmp_path / "run", tmp_path / "big.txt"
    big.write_text(corpus_text * 40)  # ~48 MB: seconds of tokenizing for process 0, far past the 1 ms bound
    flags = [*cli_flags(data=(str(big),), out_dir=str(out), max_steps=3, num_devices=None),
             "--prepare_timeout_s=0.001",
             "--coordinator_address", f"127.0.0.1:{free_port()}", "--num_processes", "2"]
    workers = [train_process(*flags, "--process_id", str(i), env={**ENV, "JAX_PLATFORMS": "cpu"}) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=bound(180)) for w in workers]
    finally:
        for worker in workers:
            stop(worker)
    _, err = outputs[1]
    assert workers[1].returncode == 1, err[-3000:]
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith("error: process 0 did not finish preparing the corpus in") and \
        "within --prepare_timeout_s=0.001" in last_line, last_line
    assert workers[0].returncode != 0  # the barrier failed for it too: it does not train alone
    assert saved_steps(out) == []


_COMPILES_SLOWER = """
import runpy, sys, time
from gpt.train import trainer

held_s, sys.argv = float(sys.argv[1]), sys.argv[2:]  # then as train.py's own: [train.py, *flags]
compiled_within_memory = trainer._compiled_within_memory

def compiled_slower(*args):
    program = compiled_within_memory(*args)
    time.sleep(held_s)
    return program

trainer._compiled_within_memory = compiled_slower
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_process_that_compiles_slower_than_the_bound_still_trains_with_the_others(tmp_path, corpus):
    """--prepare_timeout_s bounds process 0's preparation alone: a process whose compile takes longer than
    the bound (here twice it, over the others') does not spend their wait for the corpus, and the run trains."""
    out, held_s = tmp_path / "run", 10
    flags = [*cli_flags(data=(corpus,), out_dir=str(out), max_steps=3, num_devices=None),
             f"--prepare_timeout_s={held_s / 2}",
             "--coordinator_address", f"127.0.0.1:{free_port()}", "--num_processes", "2"]
    env = {**ENV, "JAX_PLATFORMS": "cpu"}
    workers = [train_process(*flags, "--process_id", "0", env=env),
               train_process(*flags, "--process_id", "1", env=env, python_args=("-c", _COMPILES_SLOWER, str(held_s)))]
    try:
        outputs = [w.communicate(timeout=bound(180)) for w in workers]
    finally:
        for worker in workers:
            stop(worker)
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    assert saved_steps(out) == [3]


def test_a_step_too_large_for_the_devices_memory_is_one_line_from_its_compiled_program(tmp_path, corpus):
    # ~1.7 TB of activations a step: over any host's memory, found in the program compiled from the state's
    # shapes before the corpus is prepared (it had been an allocator's RESOURCE_EXHAUSTED traceback from inside
    # the first step, after a preparation that can take hours).
    with pytest.raises(ConfigError) as error:
        run(tmp_path, corpus, batch_size=2_000_000, num_devices=1)
    message = str(error.value)
    assert "\n" not in message and message.startswith("TrainConfig.batch_size=2000000 x grad_accum=1: the train step "
                                                      "needs ") and "GiB per device" in message, message
    assert "--grad_accum" in message and "--model.remat" in message and "fsdp" in message
    assert not (tmp_path / "run" / "checkpoints").exists() or saved_steps(tmp_path / "run") == []
    assert logged_steps(tmp_path / "run") == []
    assert not list((tmp_path / "run").glob("data/*.bin")) and not (tmp_path / "run" / "data" / "meta.json").exists()


# ------------------------------------------------------------------------------------------ RunFailed is one line

def test_run_failures_are_one_line_exit_1():
    from gpt.errors import cli_main

    @cli_main
    def failing():
        raise RunFailed("saving checkpoint step 4 failed; the cause: [Errno 28] No space left on device")

    with pytest.raises(SystemExit) as exit_info:
        failing()
    assert exit_info.value.code == 1


def test_memory_that_runs_out_as_a_program_runs_is_one_line_exit_2(capsys):
    import jax.numpy as jnp

    from gpt.errors import cli_main

    @cli_main
    def allocating():  # 4 TiB: XLA's allocation fails at once, past every check before it
        try:
            jnp.zeros((2**40,), jnp.float32).block_until_ready()
        except Exception as error:
            raise RuntimeError("a step failed") from error  # behind another error, as a thread may raise it

    with pytest.raises(SystemExit) as exit_info:  # a JaxRuntimeError's traceback had reached the user
        allocating()
    said = capsys.readouterr().err
    assert exit_info.value.code == 2 and said.count("\n") == 1, said
    assert said.startswith("error: the memory ran out (RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 "
                           "bytes") and "--batch_size" in said


def test_a_full_disk_anywhere_is_one_line_exit_2_and_other_failed_writes_stay_what_they_were():
    """A full disk or quota, whether an OSError, behind another error (Orbax's) or only in the text (safetensors'
    Rust error), is DiskFull: the user's to make room on, exit 2; other failed writes keep their kind."""
    import errno

    from gpt.errors import cli_main, write_failed

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("a background write failed") from None  # the context stays, as in Orbax's threads
    except RuntimeError as error:
        behind = error
    for error in (full, OSError(errno.EDQUOT, "Disk quota exceeded"), behind,
                  Exception("Error while serializing: I/O error: No space left on device (os error 28)")):
        assert type(write_failed(error, "writing failed")) is DiskFull, error
    assert type(write_failed(OSError(errno.EACCES, "Permission denied"), "m")) is RunFailed
    assert type(write_failed(OSError(errno.EACCES, "Permission denied"), "m", ConfigError)) is ConfigError

    @cli_main
    def failing():
        raise write_failed(full, "writing the export to 'hf' failed, and nothing there changed: [Errno 28] ...")

    with pytest.raises(SystemExit) as exit_info:
        failing()
    assert exit_info.value.code == 2


_SIGNALLED_CLI = """
import os, signal, sys, time
from gpt.errors import cli_main

# As run from a terminal: a job started in the background (`cmd &`, nohup) inherits SIGINT ignored, and the
# CLI rightly keeps it ignored, so the tests would see no SIGINT wherever pytest itself ran so.
signal.signal(signal.SIGINT, signal.default_int_handler)

class SignalsInItsFinalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # raises in __del__, where Python prints the error and goes on

@cli_main
def main(where):
    if where == "finalizer":
        SignalsInItsFinalizer()
        print("carried on")
        return
    if where == "deaf work":  # work that a raise does not end, as a thread pool's exit waiting for its tasks
        while True:
            try:  # "ready" once inside it: a signal before would land where a raise does end the work
                print("ready", flush=True)
                while True:
                    time.sleep(0.05)
            except BaseException:
                pass
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    print("never here")

main(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("where, status, name", [("body", 130, "SIGINT"), ("finalizer", 143, "SIGTERM")])
def test_a_signal_stops_a_cli_at_once_with_one_line(where, status, name):
    result = subprocess.run([sys.executable, "-c", _SIGNALLED_CLI, where], capture_output=True, text=True,
                            timeout=bound(60), env=ENV)
    assert result.returncode == status, result.stderr  # a finalizer's signal had been lost: status 0
    assert result.stderr.strip().splitlines()[-1] == f"stopped by {name}"
    assert "never here" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("signals", [[signal.SIGTERM, signal.SIGINT], [signal.SIGTERM]], ids=["second", "grace"])
def test_a_cli_whose_work_does_not_end_on_a_signal_stops_at_a_second_or_after_the_grace(signals):
    from gpt.signals import StopSignals

    process = subprocess.Popen([sys.executable, "-c", _SIGNALLED_CLI, "deaf work"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signals[0])
        with pytest.raises(subprocess.TimeoutExpired):  # the first is swallowed, and every repeat of it
            process.wait(timeout=1)
        for sig in signals[1:]:
            process.send_signal(sig)
        # At once after a second signal; within the grace after one alone. The first signal's status either way.
        assert process.wait(timeout=10 if len(signals) > 1 else StopSignals.GRACE_S + 10) == 128 + signals[0]
        assert process.stderr.read().strip().splitlines() == [f"stopped by {signal.Signals(signals[0]).name}"]
    finally:
        stop(process)


_PRINTING_CLI = """
import sys
from gpt.errors import cli_main

@cli_main
def main(what):
    if what == "another pipe":
        raise BrokenPipeError(32, "Broken pipe")  # stdout is fine: not the reader gone
    for line in range(10**6):
        print(f"line {line}", flush=True)

main(sys.argv[1])
"""


@pytest.mark.slow
def test_output_piped_to_a_reader_that_stops_early_ends_quietly_with_sigpipes_status():
    process = subprocess.Popen([sys.executable, "-c", _PRINTING_CLI, "lines"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    assert process.stdout.readline() == "line 0\n"
    process.stdout.close()  # as `| head -1` does
    assert process.wait(timeout=bound(60)) == 128 + signal.SIGPIPE
    assert process.stderr.read() == ""  # it had been a BrokenPipeError's traceback, exit 1
    process.stderr.close()

    other = subprocess.run([sys.executable, "-c", _PRINTING_CLI, "another pipe"], capture_output=True, text=True,
                           timeout=bound(60), env=ENV)
    assert other.returncode == 1 and "BrokenPipeError" in other.stderr  # a failure elsewhere keeps its traceback


@pytest.mark.slow
def test_when_a_process_dies_the_other_says_which_in_one_line_and_a_restart_resumes(tmp_path, corpus):
    out = tmp_path / "run"
    env = {**ENV, "JAX_PLATFORMS": "cpu"}

    def start(port, **changes):
        flags = [*cli_flags(**{"data": (corpus,), "out_dir": str(out), "max_steps": 100000, "checkpoint_interval": 3,
                               "eval_interval": 100000, "log_interval": 1, "num_devices": None, **changes}),
                 "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2"]
        return [train_process(*flags, "--process_id", str(i), env=env) for i in range(2)]

    workers = start(free_port())
    try:
        wait_for_step(out, 4, workers[0], seconds=180)
        workers[1].kill()
        _, err = workers[0].communicate(timeout=60)  # not JAX's 100 s heartbeat abort
    finally:
        for worker in workers:
            stop(worker)
    last_line = err.strip().splitlines()[-1]
    assert workers[0].returncode == 1, err[-3000:]
    assert last_line.startswith("error: process 1 died (a collective failed") and "process 0 stops too" in last_line
    newest = saved_steps(out)[-1]
    assert f"the newest checkpoint is step {newest}: restart every process" in last_line

    workers = start(free_port(), stop_after=newest + 2)
    outputs = [w.communicate(timeout=bound(180)) for w in workers]
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    assert saved_steps(out)[-1] == newest + 2


def test_a_failed_first_save_says_none_was_kept_and_removes_its_partial_directory(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    try:
        partial = manager.directory / "4.orbax-checkpoint-tmp-1764230000"
        (partial / "params").mkdir(parents=True)
        (partial / "params" / "data").write_bytes(b"\0" * 1024)
        manager._saving = 4
        error = manager._save_failed(OSError(28, "No space left on device"))
        assert isinstance(error, DiskFull) and "no checkpoint was saved before it" in str(error)
        assert "step None" not in str(error) and str(error).endswith("No space left on device") and not partial.exists()
        assert type(manager._save_failed(OSError(13, "Permission denied"))) is RunFailed
    finally:
        manager.close()


def test_an_errors_first_line_is_its_first_nonblank_line_or_its_type():
    from gpt.errors import first_line

    assert first_line(ValueError("\n  tree structures do not match:\n  - Source: ...")) == "tree structures do not match:"
    assert first_line(KeyError(), limit=5) == "KeyError" and first_line(OSError("x" * 9), limit=5) == "xxxxx"


def test_a_full_disk_while_metrics_are_written_is_one_line(tmp_path):
    from gpt.train.metrics import MetricsWriter

    class FullDisk:
        def write(self, *text):
            raise OSError(28, "No space left on device")

        flush = close = write

    writer = MetricsWriter(tmp_path, resume_step=0)
    writer.write({"step": 1, "loss": 4.0})
    writer.jsonl.close()
    writer.jsonl = FullDisk()
    with pytest.raises(DiskFull, match=r"^writing step 2's metrics to .*metrics.jsonl failed \(\[Errno 28\] No space "
                                        r"left on device\); the run stopped") as error:  # an OSError had escaped
        writer.write({"step": 2, "loss": 3.9})
    assert "\n" not in str(error.value)
    writer.close()  # its last flush fails again: nothing more to say
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


@pytest.mark.slow
def test_a_checkpoint_whose_record_has_no_checksums_is_not_trusted(trained_run, tmp_path):
    """Checksums of null (or gone) leave nothing to verify the arrays by: the step is corrupt, as one whose
    checksums differ, never loaded unverified."""
    from gpt.errors import UserError

    newest = max(int(p.name) for p in (trained_run / "checkpoints").iterdir() if p.name.isdigit())
    record_path = Path("checkpoints") / str(newest) / "metadata" / "metadata"
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(trained_run / "checkpoints" / str(newest), tmp_path / "run" / "checkpoints" / str(newest))
    record = json.loads((trained_run / record_path).read_text())
    for checksums in (None, [], {"opt_state": record["checksums"]["opt_state"]}):
        (tmp_path / "run" / record_path).write_text(json.dumps({**record, "checksums": checksums}))
        with pytest.raises(UserError, match=f"no intact checkpoint .*step {newest}: ValueError: its record holds no "
                                            f"checksums of params: it cannot be verified"):
            load_model(tmp_path / "run")


@pytest.mark.slow
def test_every_field_of_a_checkpoints_record_changed_loads_the_same_model_or_is_one_line(trained_run, tmp_path):
    from gpt.errors import UserError

    newest = max(int(p.name) for p in (trained_run / "checkpoints").iterdir() if p.name.isdigit())
    record_path = Path("checkpoints") / str(newest) / "metadata" / "metadata"
    record = json.loads((trained_run / record_path).read_text())
    want = flat(load_model(trained_run))
    outcomes = {"loaded": 0, "refused": 0}
    # The arrays' checksums are alike, a tree's entries read by one rule: each tree's first one is changed.
    alike_once = {**record, "checksums": {tree: dict(list(sums.items())[:1]) for tree, sums in record["checksums"].items()}}
    for path in fields(alike_once, every_item=False):
        for how in HOW:
            out = tmp_path / "run"
            if not out.exists():
                (out / "checkpoints").mkdir(parents=True)
                shutil.copytree(trained_run / "checkpoints" / str(newest), out / "checkpoints" / str(newest))
            (out / record_path).write_text(json.dumps(changed(record, path, how)))
            try:
                got = flat(load_model(out))
            except UserError as error:  # a TypeError or a hang had been possible
                assert "\n" not in str(error), (path, how, str(error))
                outcomes["refused"] += 1
                continue
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (path, how)
            outcomes["loaded"] += 1
    assert outcomes["refused"] > 40 and outcomes["loaded"] > 10, outcomes


@pytest.mark.slow
def test_a_record_of_a_billion_layers_is_refused_with_nothing_reported_behind_it(trained_run, tmp_path, caplog):
    """A record whose shapes the stored arrays cannot have is refused before orbax starts a read: a read it
    refuses midway leaves tasks whose errors asyncio logs as "never retrieved" once they are collected, and
    callbacks that find its event loop closed (an "Exception ignored" block): the refusal is all that is said."""
    from gpt.errors import UserError

    newest = max(int(p.name) for p in (trained_run / "checkpoints").iterdir() if p.name.isdigit())
    step_dir = tmp_path / "run" / "checkpoints" / str(newest)
    shutil.copytree(trained_run / "checkpoints" / str(newest), step_dir)
    record_path = step_dir / "metadata" / "metadata"
    record = json.loads(record_path.read_text())
    record["model_config"]["n_layer"] = 10**9
    record_path.write_text(json.dumps(record))
    unraisable, hook = [], sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with pytest.raises(UserError, match=rf"no intact checkpoint .*step {newest}: ValueError: .*\(1000000000, "):
            load_model(tmp_path / "run")
        time.sleep(0.5)  # for reads still running on orbax's threads
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []
    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == []
