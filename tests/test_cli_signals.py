"""The command lines stop on SIGTERM or SIGINT at any moment, however many arrive: one line, status 128 + the
first signal's number, no traceback, and nothing left that the next run cannot use. And none of them starts
a TPU runtime on a host with no TPU."""

import glob
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bounds import bound
from training import ROOT

ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}


def _commands(trained_run, corpus, tmp_path) -> dict[str, tuple[list[str], str]]:
    """Each command's arguments, and a pattern of the last line of its output when it has finished."""
    big = tmp_path / "big.txt"  # ~12 MB: its preparation takes seconds, not a fraction of one
    big.write_text(open(corpus).read() * 60)
    return {
        "sample.py": ([str(ROOT / "sample.py"), "--init_from", str(trained_run), "--num_samples", "24",
                       "--max_new_tokens", "100"], r"-+$"),
        "gpt.eval": (["-m", "gpt.eval", "--init_from", str(trained_run), "--data", corpus], r"\| overall \|"),
        "gpt.export": (["-m", "gpt.export", "--out_dir", str(trained_run), "--hf_dir", str(tmp_path / "exported")],
                       r"wrote "),
        "gpt.data": (["-m", "gpt.data", "--data", str(big), "--out_dir", str(tmp_path / "prepared")], r"[\d,]+ documents -> "),
    }


def _run_signalled(args: list[str], delay: float, signals: list[int], gap: float) -> tuple[int, str, str]:
    """Starts `python *args`, sends `signals` from `delay` seconds after its start, `gap` seconds apart;
    (its status, its stdout, its stderr)."""
    # As from a terminal: started from a background job (as pytest may be), the command would ignore SIGINT.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen([sys.executable, "-X", "faulthandler", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=ENV, cwd=ROOT)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        time.sleep(delay)
        for sig in signals:
            if process.poll() is None:
                process.send_signal(sig)
            time.sleep(gap)
        try:
            stdout, stderr = process.communicate(timeout=bound(30))
        except subprocess.TimeoutExpired:  # the stacks it is stuck in, for the failure's message (-X faulthandler)
            process.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 30 s after {signals}:\n{process.communicate()[1][-8000:]}")
        return process.returncode, stdout, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sample.py", "gpt.eval", "gpt.export", "gpt.data"])
def test_signals_at_random_moments_stop_a_command_with_one_line(command, trained_run, corpus, tmp_path):
    args, finished_line = _commands(trained_run, corpus, tmp_path)[command]
    took = _warm_run_s(args, tmp_path)
    chance = random.Random(f"{command} 7")
    stopped = 0
    for _ in range(5):  # moments from the interpreter's start to well within the command's work
        delay, gap = chance.uniform(0.2, 0.7 * took), chance.choice([0.0, 0.05, 0.3])
        signals = [chance.choice([signal.SIGTERM, signal.SIGINT]) for _ in range(chance.randint(1, 4))]
        shutil.rmtree(tmp_path / "prepared", ignore_errors=True)  # prepared, a corpus is not prepared again
        status, stdout, stderr = _run_signalled(args, delay, signals, gap)
        case = f"{command}: {[signal.Signals(s).name for s in signals]} from {delay:.2f} s, {gap} s apart"
        assert "Traceback" not in stderr, f"{case}:\n{stderr[-3000:]}"
        if stdout.strip() and re.match(finished_line, stdout.strip().splitlines()[-1]):
            # Its work was done: the status is 0; the signal's own where it came during the interpreter's
            # teardown, which gives the default handlers back; or, where it came between the last line and the
            # teardown (the handlers still the command's), a stop like any other: 128 + the signal, one line.
            stopped_late = status - 128 in signals and stderr.strip().splitlines()[-1:] == [
                f"stopped by {signal.Signals(status - 128).name}"]
            assert status == 0 or -status in signals or stopped_late, \
                f"{case}: status {status} after it finished\n{stderr[-3000:]}"
            continue
        # Signals that arrive while the main thread is in a C call (a compile, a step) wait there together, and
        # Python then runs their handlers in the signals' order, not the order they came in: the one acted on
        # is one of those sent.
        assert status - 128 in signals, f"{case}: status {status}\n{stderr[-3000:]}"
        assert stderr.strip().splitlines()[-1] == f"stopped by {signal.Signals(status - 128).name}", f"{case}:\n{stderr}"
        stopped += 1
    assert stopped >= 3  # the moments fell within the command's run, not after it
    _finishes(args)  # whatever a stop left, the next run can use


def _warm_run_s(args: list[str], tmp_path) -> float:
    """Seconds a run of `args` takes once JAX's compilation cache holds its programs, as it does for the runs
    signalled after it (a first run's compiles can take longer than the whole of a later run)."""
    _finishes(args)
    shutil.rmtree(tmp_path / "prepared", ignore_errors=True)
    start = time.monotonic()
    _finishes(args)
    return time.monotonic() - start


def _finishes(args: list[str]) -> None:
    finished = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=bound(300))
    assert finished.returncode == 0, finished.stderr[-3000:]


def test_compile_only_keeps_jax_on_the_cpu(monkeypatch):
    from gpt.process_start import start_command_line

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        start_command_line(["--model.n_layer=2", "--compile_only", "v5e-8"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the `tpu` extra)")
@pytest.mark.skipif(any(glob.glob(p) for p in ("/dev/vfio/[0-9]*", "/dev/accel*", "/dev/nvidia[0-9]*", "/dev/kfd")),
                    reason="this host has an accelerator")
def test_an_installed_libtpu_without_a_tpu_prints_nothing():
    script = "from gpt.process_start import start_command_line; start_command_line([]); import jax; print(jax.devices())"
    env = {name: value for name, value in ENV.items() if name != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=bound(120))
    assert result.returncode == 0 and "CpuDevice" in result.stdout, result.stderr
    assert result.stderr == ""  # libtpu, started, printed its warnings about the TPU it did not find
