"""Prepared data is trusted as checkpoints are: shards checked against their record at every use, one
preparation at a time, nothing half-written left by a failure, and a resume only on the shards it trained on."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpt.data import prepare as prepare_module
from gpt.data.prepare import STAGING, prepare
from gpt.data.shards import ShardHasher, verify_shards
from gpt.errors import ConfigError, DiskFull
from gpt.run_dir import RunLock, RunLocked

from bounds import bound
from json_fields import HOW, changed, fields
from training import ROOT, run

ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
VOCAB = 50257


def prepare_cli(*flags, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpt.data", *flags], env=ENV, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def rewrite(data: Path, name: str, ids: np.ndarray, *, record: bool = False) -> None:
    """Replace shard `name`'s ids; with `record`, update meta.json to match (a consistent forgery)."""
    (data / name).write_bytes(ids.astype(np.uint16).tobytes())
    if record:
        meta = json.loads((data / "meta.json").read_text())
        for shard in meta["shards"][name.split("_")[0]]:
            if shard["file"] == name:
                hasher = ShardHasher()
                hasher.update(ids.astype(np.uint16))
                shard["tokens"], shard["sha256"] = int(ids.size), hasher.hexdigest()
        (data / "meta.json").write_text(json.dumps(meta))


# ------------------------------------------------------------------------------------------ preparation

@pytest.mark.slow
def test_of_two_preparations_into_one_directory_the_second_is_refused_and_the_first_is_intact(tmp_path, corpus_text):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(corpus_text * 3)
    b.write_text(corpus_text[:100_000][::-1])
    out = tmp_path / "data"
    first = prepare_cli("--data", str(a), "--out_dir", str(out), "--workers", "1")
    deadline = time.time() + bound(60)
    while not (out / ".lock").is_file() or not (out / ".lock").read_text():
        assert time.time() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # held in the middle of its preparation, the lock with it
    try:
        second = subprocess.run([sys.executable, "-m", "gpt.data", "--data", str(b), "--out_dir", str(out)], env=ENV,
                                cwd=ROOT, capture_output=True, text=True, timeout=bound(120))
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=bound(300))
    assert first.returncode == 0, err
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert "in use by another corpus preparation (pid" in second.stderr and "Traceback" not in second.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert [s["path"] for s in meta["sources"]] == [str(a)]
    verify_shards(out, VOCAB)  # every shard as recorded: nothing of b's got in


def test_a_preparation_beside_a_training_run_is_refused_naming_it(tmp_path, corpus):
    out = tmp_path / "data"
    with RunLock(out, role="training run"):
        with pytest.raises(RunLocked, match=r"in use by another training run \(pid"):
            prepare([corpus], out)
    assert prepare([corpus], out)["train_tokens"] > 0  # once it is free


@pytest.mark.slow
def test_a_training_run_refuses_a_data_directory_being_prepared(tmp_path, corpus):
    out = tmp_path / "run"
    with RunLock(out / "data", role="corpus preparation"):
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--data", corpus, "--out_dir", str(out),
                               "--preset", "tiny", "--max_steps", "2"], env=ENV, capture_output=True, text=True,
                              timeout=bound(300))
    assert done.returncode == 2 and "in use by another corpus preparation (pid" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (out / "checkpoints").exists()


def test_a_failed_preparation_leaves_no_partial_shard_and_says_so_in_one_line(tmp_path, corpus, monkeypatch):
    writes = []
    original = prepare_module._ShardWriter.write

    def full_disk(self, index, tokens):
        writes.append(index)
        if len(writes) > 3:
            raise OSError(28, "No space left on device")
        return original(self, index, tokens)

    monkeypatch.setattr(prepare_module._ShardWriter, "write", full_disk)
    out = tmp_path / "data"
    with pytest.raises(DiskFull, match="No space left on device") as error:
        prepare([corpus], out, shard_tokens=2_000, workers=1)
    assert "\n" not in str(error.value) and str(out) in str(error.value)
    assert not list(out.rglob("*.tmp")) and not (out / "meta.json").exists()


class _FullDisk:
    """A shard file on a disk that fills after `room` bytes: its writes fail there, and so does its close,
    which flushes what its buffer holds (the real file is closed all the same)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        self.room -= memoryview(data).nbytes
        if self.room < 0:
            raise OSError(28, "No space left on device")
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_disk_that_fills_mid_shard_leaves_no_temporary_file(tmp_path, corpus, monkeypatch):
    def opened(path, *args, **kwargs):
        file = open(path, *args, **kwargs)
        return _FullDisk(file, 30_000) if str(path).endswith(".bin.tmp") else file

    monkeypatch.setattr(prepare_module, "open", opened, raising=False)
    out = tmp_path / "data"
    with pytest.raises(DiskFull, match="No space left on device") as error:
        prepare([corpus], out, shard_tokens=100_000, workers=1)
    assert "\n" not in str(error.value)
    assert not list(out.rglob("*.bin*")), "a .bin.tmp had stayed (its close failed)"


def test_a_preparation_that_fails_leaves_the_previous_one_usable(tmp_path, corpus, corpus_text):
    out = tmp_path / "data"
    before = prepare([corpus], out, shard_tokens=20_000, workers=1)

    def files() -> dict[str, bytes]:  # the lock says who prepares and since when (to the second): not data
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}

    kept = files()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(corpus_text[:300])  # one section: no validation split
    with pytest.raises(ConfigError, match="split of .* is empty"):
        prepare([tiny], out, shard_tokens=20_000, workers=1)
    unbroken = tmp_path / "unbroken.txt"  # no newline to cut at: one section however long
    unbroken.write_text("word " * 4_000)
    with pytest.raises(ConfigError, match=r"is empty \(20,000 characters in 1 section, the split's unit; val_fraction"):
        prepare([unbroken], out, shard_tokens=20_000, workers=1)
    assert files() == kept and "meta.json" in kept  # its meta.json had been deleted
    assert verify_shards(out, VOCAB) and before["shards"] == json.loads((out / "meta.json").read_text())["shards"]


def _prepare_killed_after_three_shards(corpus: str, out: Path, monkeypatch) -> None:
    """A preparation of `corpus` (shards of 5,000 tokens) into `out`, stopped after its third shard, as a
    kill would stop it: after progress.json recorded that shard."""
    original = prepare_module._ShardWriter._finish
    finished = []

    def killed_after_three_shards(self):
        original(self)
        finished.append(1)
        if len(finished) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module._ShardWriter, "_finish", killed_after_three_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus], out, shard_tokens=5_000, workers=1)
    monkeypatch.setattr(prepare_module._ShardWriter, "_finish", original)


def test_an_interrupted_preparation_whose_finished_shard_was_lost_prepares_it_again(tmp_path, corpus, monkeypatch):
    whole = prepare([corpus], tmp_path / "whole", shard_tokens=5_000, workers=1)
    out = tmp_path / "data"
    _prepare_killed_after_three_shards(corpus, out, monkeypatch)
    assert (out / STAGING / "progress.json").is_file() and not list(out.rglob("*.tmp"))
    (out / STAGING / "train_00000.bin").unlink()
    meta = prepare([corpus], out, shard_tokens=5_000, workers=1)
    assert meta["shards"] == whole["shards"]  # every shard, checksums and all, as an uninterrupted run's
    verify_shards(out, VOCAB)


def test_a_progress_record_that_is_not_json_starts_the_preparation_again(tmp_path, corpus):
    out = tmp_path / "data"
    (out / STAGING).mkdir(parents=True)
    (out / STAGING / "progress.json").write_text("{not json")
    (out / "meta.json").write_text("\x00garbage")
    meta = prepare([corpus], out)
    assert meta["train_tokens"] > 0 and json.loads((out / "meta.json").read_text())["shards"] == meta["shards"]


# ------------------------------------------------------------------------------------------ the records, fuzzed

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare([corpus], out, shard_tokens=20_000, workers=1)
    return out


# Strings that any value may hold (the reader needs none of them to be one thing): not refused when long.
_FREE_TEXT = {("tokenizer",), ("text_field",), ("split_rule",)}


@pytest.mark.slow
def test_every_field_of_meta_json_changed_is_a_one_line_refusal(prepared, tmp_path):
    meta = json.loads((prepared / "meta.json").read_text())
    cases = [(path, how) for path in fields(meta) if path[0] not in ("sources", "bad_records") or len(path) == 1
             for how in HOW]
    refused = 0
    for path, how in cases:
        edited = changed(meta, path, how)
        if edited == meta or (how in ("low", "high") and path in _FREE_TEXT):
            continue
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        for shard in prepared.glob("*.bin"):
            (data / shard.name).write_bytes(shard.read_bytes())
        (data / "meta.json").write_text(json.dumps(edited))
        with pytest.raises(ConfigError) as error:  # a TypeError, KeyError or ValueError had escaped
            verify_shards(data, VOCAB)
        assert "\n" not in str(error.value) and str(data / "meta.json") in str(error.value), (path, how)
        refused += 1
    assert refused > 60
    outside = json.loads(json.dumps(meta))
    outside["shards"]["train"][0]["file"] = "../../outside.bin"
    (tmp_path / "data" / "meta.json").write_text(json.dumps(outside))
    with pytest.raises(ConfigError, match="names '../../outside.bin': not a shard file of"):
        verify_shards(tmp_path / "data", VOCAB)


@pytest.mark.slow
def test_a_progress_record_changed_in_any_field_starts_the_preparation_again(tmp_path, corpus, monkeypatch):
    whole = prepare([corpus], tmp_path / "whole", shard_tokens=5_000, workers=1)
    _prepare_killed_after_three_shards(corpus, tmp_path / "killed", monkeypatch)
    finished, original = [], prepare_module._ShardWriter._finish
    progress = json.loads((tmp_path / "killed" / STAGING / "progress.json").read_text())
    cases = [((), "unchanged")] + [(path, how) for path in fields(progress) for how in HOW]
    for path, how in cases:
        edited = progress if how == "unchanged" else changed(progress, path, how)
        if how != "unchanged" and edited == progress:
            continue
        finished.clear()
        monkeypatch.setattr(prepare_module._ShardWriter, "_finish", lambda self: (finished.append(1), original(self)))
        out = tmp_path / "out"
        (out / STAGING).mkdir(parents=True, exist_ok=True)
        for name in (tmp_path / "killed" / STAGING).glob("*.bin"):
            (out / STAGING / name.name).write_bytes(name.read_bytes())
        (out / "meta.json").unlink(missing_ok=True)
        (out / STAGING / "progress.json").write_text(json.dumps(edited))
        meta = prepare([corpus], out, shard_tokens=5_000, workers=1)  # a KeyError or TypeError had escaped
        assert meta["shards"] == whole["shards"], (path, how)  # nothing dropped or repeated by a resume point
        shards = len(whole["shards"]["train"]) + len(whole["shards"]["val"])
        assert len(finished) == (shards - 3 if how == "unchanged" else shards), (path, how)  # resumed, or anew


# ------------------------------------------------------------------------------------------ every use

@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A tiny run of 8 steps (its checkpoint records its shards' digest), kept pristine: tests copy it."""
    directory = tmp_path_factory.mktemp("trained")
    run(directory, corpus, max_steps=8)
    return directory / "run"


def tampered_copy(trained: Path, tmp_path: Path, tamper) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    tamper(out / "data")
    return out


def _ids(data: Path, name: str) -> np.ndarray:
    return np.fromfile(data / name, np.uint16)


TAMPERINGS = {
    "another corpus's shard": (lambda d: rewrite(d, "train_00000.bin", np.arange(_ids(d, "train_00000.bin").size)
                                                 % 1000), "does not hold what was prepared"),
    "truncated to half": (lambda d: rewrite(d, "train_00000.bin", _ids(d, "train_00000.bin")[: _ids(
        d, "train_00000.bin").size // 2]), "bytes where meta.json records"),
    "a tenth of its ids overwritten": (lambda d: rewrite(d, "train_00000.bin", np.where(
        np.arange(_ids(d, "train_00000.bin").size) % 10 == 0, 42, _ids(d, "train_00000.bin"))),
        "does not hold what was prepared"),
    "ids past the vocabulary, its record forged to match": (lambda d: rewrite(d, "train_00000.bin", np.where(
        np.arange(_ids(d, "train_00000.bin").size) == 77, 65000, _ids(d, "train_00000.bin")), record=True),
        "token id 65000 at position 77, outside the vocabulary"),
    "an odd number of bytes": (lambda d: (d / "val_00000.bin").write_bytes((d / "val_00000.bin").read_bytes()[:-1]),
                               "bytes where meta.json records"),
    "empty": (lambda d: (d / "train_00000.bin").write_bytes(b""), "has 0 bytes where meta.json records"),
    "a consistent forgery (other shards, their record to match)": (lambda d: rewrite(
        d, "train_00000.bin", _ids(d, "train_00000.bin")[::-1], record=True), "are not those step 8 was trained on"),
}


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_a_tampered_shard_is_refused_at_resume_before_the_first_step(trained, tmp_path, corpus, tampering):
    tamper, message = TAMPERINGS[tampering]
    out = tampered_copy(trained, tmp_path, tamper)
    (out.parent / "outside.bin").write_bytes(b"\x00\x01" * 64)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=message) as error:
        run(tmp_path, corpus, max_steps=10, resume_anyway=True)
    assert "\n" not in str(error.value)
    assert (out / "metrics.jsonl").read_text() == before and sorted(p.name for p in (out / "checkpoints").iterdir()
                                                                    if p.name.isdigit()) == ["8"]


@pytest.mark.slow
def test_the_cli_refuses_a_truncated_shard_in_one_line_with_exit_2(trained, tmp_path, corpus):
    out = tampered_copy(trained, tmp_path, TAMPERINGS["truncated to half"][0])
    from training import cli_flags

    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *cli_flags(data=(corpus,), out_dir=str(out),
                                                                              max_steps=10, num_devices=None),
                           "--resume_anyway"], env=ENV, capture_output=True, text=True, timeout=bound(300))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "train_00000.bin" in done.stderr and "delete" in done.stderr and "Traceback" not in done.stderr


def test_the_untampered_copy_resumes(trained, tmp_path, corpus):
    """The control: a copy nobody touched trains on from its checkpoint."""
    tampered_copy(trained, tmp_path, lambda data: None)
    result = run(tmp_path, corpus, max_steps=10, resume_anyway=True)
    assert result.start_step == 8 and result.step == 10


def test_gpt_eval_checks_the_split_it_scores(trained, tmp_path):
    from gpt.eval import EvalConfig, evaluate

    out = tampered_copy(trained, tmp_path, TAMPERINGS["a tenth of its ids overwritten"][0])
    assert evaluate(EvalConfig(init_from=str(out), split="val"))["overall"]["tokens"] > 0  # val is intact
    with pytest.raises(ConfigError, match="train_00000.bin does not hold what was prepared"):
        evaluate(EvalConfig(init_from=str(out), split="train"))


# ------------------------------------------------------------------------------------------ broken inputs

def _jsonl(records: int = 400) -> bytes:
    return b"".join(json.dumps({"text": f"document {i}: " + "some words of text " * 30}).encode() + b"\n"
                    for i in range(records))


def _parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i} " + "words " * 50 for i in range(2000)]}), path)


def _saved_dataset(path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["a document " * 40] * 50}).save_to_disk(str(path))


def broken_input(kind: str, tmp_path: Path) -> Path:
    import gzip

    import zstandard

    if kind == "a truncated .jsonl.gz":
        path = tmp_path / "c.jsonl.gz"
        whole = gzip.compress(_jsonl())
        path.write_bytes(whole[: len(whole) // 2])
    elif kind == "a .gz that is not gzip":
        path = tmp_path / "c.jsonl.gz"
        path.write_bytes(_jsonl())
    elif kind == "a truncated .jsonl.zst":
        path = tmp_path / "c.jsonl.zst"
        whole = zstandard.ZstdCompressor(write_checksum=True).compress(_jsonl(4000))
        path.write_bytes(whole[: len(whole) // 2])
    elif kind == "a truncated .parquet":
        path = tmp_path / "c.parquet"
        _parquet(path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "a fake .parquet":
        path = tmp_path / "c.parquet"
        path.write_bytes(b"PAR1 this is not parquet at all PAR1")
    elif kind == "a saved dataset missing its .arrow":
        path = tmp_path / "saved"
        _saved_dataset(path)
        for arrow in path.glob("*.arrow"):
            arrow.unlink()
    return path


BROKEN = ("a truncated .jsonl.gz", "a .gz that is not gzip", "a truncated .jsonl.zst", "a truncated .parquet",
          "a fake .parquet", "a saved dataset missing its .arrow")


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_input_is_one_line_naming_it_and_leaves_nothing_behind(tmp_path, kind):
    path = broken_input(kind, tmp_path)
    out = tmp_path / "data"
    with pytest.raises(ConfigError, match=f"data input '{path}' cannot be read") as error:
        prepare([path], out)
    assert "\n" not in str(error.value)
    assert not list(out.rglob("*.bin*")) and not (out / "meta.json").exists()


@pytest.mark.slow
def test_the_cli_answers_a_broken_input_with_exit_2_and_one_line(tmp_path):
    path = broken_input("a truncated .jsonl.zst", tmp_path)
    done = subprocess.run([sys.executable, "-m", "gpt.data", "--data", str(path), "--out_dir", str(tmp_path / "d")],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=bound(120))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "truncated" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_input_is_one_line(tmp_path, corpus):
    path = tmp_path / "secret.txt"
    path.write_text(Path(corpus).read_text())
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        prepare([path], tmp_path / "data")


def test_a_lone_surrogate_in_a_jsonl_string_is_replaced_and_counted(tmp_path, corpus_text):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": corpus_text[i * 20_000:(i + 1) * 20_000]}) for i in range(20)]
    lines[3] = json.dumps({"text": "before \ud800 after " * 100})  # valid JSON; no UTF-8 can hold it
    path.write_text("\n".join(lines))
    meta = prepare([path], tmp_path / "data")
    assert meta["replaced_invalid_utf8"] == 100 and meta["documents"] == 20


def test_inputs_are_read_once_by_real_path_and_a_link_back_up_is_not_followed(tmp_path, corpus_text):
    from gpt.data.corpus import expand_inputs

    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(corpus_text[:50_000])
    (root / "sub" / "b.txt").write_text(corpus_text[50_000:100_000])
    (root / "sub" / "up").symlink_to(root)  # a loop
    (root / "sub" / "again.txt").symlink_to(root / "a.txt")
    files = expand_inputs([root, root / "a.txt", str(root / "**" / "*.txt")])
    assert sorted(p.name for p in files) == ["a.txt", "b.txt"]


def test_a_runs_out_dir_inside_its_corpus_is_never_read_as_corpus(tmp_path, corpus_text):
    (tmp_path / "text.txt").write_text(corpus_text[:200_000])
    changes = dict(data=(str(tmp_path),), out_dir=str(tmp_path / "run"))
    run(tmp_path, None, max_steps=4, **changes)  # writes run/metrics.jsonl, checkpoints, shards under the corpus
    result = run(tmp_path, None, max_steps=6, resume_anyway=True, **changes)
    assert result.start_step == 4 and result.step == 6


@pytest.mark.parametrize("seed", [-1, 2**63, 10**23])
def test_a_seed_outside_what_the_generators_take_is_refused_at_once(seed):
    from gpt.train.trainer import TrainConfig

    with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*63\)"):
        TrainConfig(seed=seed)
    TrainConfig(seed=2**63 - 1)


def test_a_file_that_decoded_with_losses_is_named_in_a_warning(tmp_path, corpus_text, capsys):
    good, lossy = tmp_path / "good.txt", tmp_path / "lossy.txt"
    good.write_text(corpus_text[:400_000])
    lossy.write_bytes(corpus_text[:100_000].encode() + b"\xff\xfe" * 500)  # invalid UTF-8
    meta = prepare([good, lossy], tmp_path / "data")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert meta["replaced_invalid_utf8"] == 1000
    assert len(warnings) == 1 and str(lossy) in warnings[0] and "1,000 of its" in warnings[0], warnings
