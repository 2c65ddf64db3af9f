"""Corpus preparation at real size: formats, exact tokens, flat memory, restarts, bad records, the loader."""

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt.data.corpus import split_sections
from gpt.data.loader import Batches
from gpt.data.prepare import STAGING, in_validation, prepare
from gpt.errors import ConfigError
from gpt.tokenizer import get_tokenizer

from bounds import bound

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def documents(corpus_text) -> list[str]:
    """60 documents of 300 to 20,000 characters: code and prose, blank lines, Unicode, one with '<|endoftext|>'."""
    rng = np.random.default_rng(0)
    docs, start = [], 0
    for size in rng.integers(300, 20_000, 60):
        docs.append(corpus_text[start:start + size])
        start += size
    docs[3] = "Ünïcödé — “quotes” ½ 𝄞 emoji 🙂\n\nand a second paragraph\n" * 40
    docs[7] = "text that mentions <|endoftext|> as plain text\n" * 10
    return docs


def _write(docs, directory: Path, kind: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        for i, doc in enumerate(docs):
            (directory / f"doc_{i:03d}.txt").write_text(doc, encoding="utf-8")
        return directory
    lines = "".join(json.dumps({"text": doc, "id": i}) + "\n" for i, doc in enumerate(docs)).encode()
    if kind == "jsonl":
        (directory / "part.jsonl").write_bytes(lines)
    elif kind == "jsonl.gz":
        (directory / "part.jsonl.gz").write_bytes(gzip.compress(lines))
    elif kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        (directory / "part.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif kind == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), directory / "part.parquet", row_group_size=7)
    elif kind == "hf_dataset":
        datasets = pytest.importorskip("datasets", reason="the `datasets` package is not installed")
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(directory / "saved"))
        return directory / "saved"
    return directory


def _shard_bytes(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.glob("*_*.bin"))}


def _tokens(data_dir: Path, split: str) -> list[int]:
    meta = json.loads((data_dir / "meta.json").read_text())
    return [int(t) for s in meta["shards"][split] for t in np.fromfile(data_dir / s["file"], dtype=meta["dtype"])]


def test_every_format_gives_tiktokens_tokens_and_the_same_shards(tmp_path, documents):
    reference = pytest.importorskip("tiktoken").get_encoding("gpt2")
    eot = get_tokenizer().eot_id
    expected = {"train": [], "val": []}
    for doc in documents:
        sections = list(split_sections([doc]))
        pieces = [reference.encode_ordinary(section.text) for section in sections]
        assert sum(pieces, []) == reference.encode_ordinary(doc), "cutting at safe newlines changes no token"
        assert list(split_sections([doc[:777], doc[777:1500], doc[1500:]])) == sections, "nor does streaming"
        pieces[-1] = pieces[-1] + [eot]
        for section, piece in zip(sections, pieces):
            expected["val" if in_validation(section.text, 0.1) else "train"] += piece
    assert expected["val"] and len(expected["train"]) > 5 * len(expected["val"])

    shards = {}
    for kind in ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"):
        out = tmp_path / f"out_{kind}"
        meta = prepare([_write(documents, tmp_path / kind, kind)], out, val_fraction=0.1, shard_tokens=10_000, workers=2)
        assert meta["documents"] == len(documents) and meta["dtype"] == "uint16"
        assert meta["train_tokens"] + meta["val_tokens"] == sum(len(reference.encode_ordinary(d)) + 1 for d in documents)
        assert _tokens(out, "train") == expected["train"] and _tokens(out, "val") == expected["val"], kind
        assert all(s["tokens"] == 10_000 for s in meta["shards"]["train"][:-1]) and len(meta["shards"]["train"]) > 3
        shards[kind] = _shard_bytes(out)
    assert all(files == shards["txt"] for files in shards.values()), "each format gives the same shards"


def test_a_saved_hugging_face_dataset_gives_the_same_shards_as_jsonl(tmp_path, documents):
    saved = _write(documents, tmp_path / "hf", "hf_dataset")  # skips when `datasets` is not installed
    prepare([saved], tmp_path / "out_hf", val_fraction=0.1, shard_tokens=10_000)
    prepare([_write(documents, tmp_path / "jsonl", "jsonl")], tmp_path / "out_jsonl", val_fraction=0.1, shard_tokens=10_000)
    assert _shard_bytes(tmp_path / "out_hf") == _shard_bytes(tmp_path / "out_jsonl")


def test_the_validation_split_is_stable_when_the_corpus_grows(tmp_path, documents):
    small = prepare([_write(documents[:30], tmp_path / "a", "jsonl")], tmp_path / "out_a", val_fraction=0.1)
    grown = prepare([_write(documents, tmp_path / "b", "jsonl")], tmp_path / "out_b", val_fraction=0.1)
    before, after = _tokens(tmp_path / "out_a", "val"), _tokens(tmp_path / "out_b", "val")
    assert after[: len(before)] == before and grown["val_tokens"] > small["val_tokens"]


# The peak is this process's own high-water mark (VmHWM), not ru_maxrss: Linux carries ru_maxrss over
# from the forked parent, so after a large pytest process it reads the parent's size.
_PREPARE = """
import re, sys
from gpt.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], val_fraction=0.05, shard_tokens=int(sys.argv[3]), workers=2, progress="none")
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


# A SIGKILL at a fixed point, right after the first training shard and its progress record: killed from
# outside when that shard appeared, a preparation on a loaded machine had sometimes finished first.
_KILLED_AFTER_FIRST_SHARD = """
import os, signal, sys
from gpt.data import prepare as module
finish = module._ShardWriter._finish
def finish_then_die(self):
    finish(self)
    if self.split == "train":
        os.kill(os.getpid(), signal.SIGKILL)
module._ShardWriter._finish = finish_then_die
module.prepare([sys.argv[1]], sys.argv[2], val_fraction=0.05, shard_tokens=int(sys.argv[3]), workers=2, progress="none")
"""


def _generate(path: Path, corpus_text: str, megabytes: int) -> None:
    """`megabytes` of JSONL documents: slices of real text, each made unique by a number."""
    rng = np.random.default_rng(megabytes)
    with open(path, "w") as file:
        written, number = 0, 0
        while written < megabytes << 20:
            start = int(rng.integers(0, len(corpus_text) - 20_000))
            line = json.dumps({"text": f"document {number}\n" + corpus_text[start:start + int(rng.integers(500, 20_000))]}) + "\n"
            file.write(line)
            written, number = written + len(line), number + 1


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, corpus_text):
    peaks = {}
    for megabytes in (10, 100):
        path = tmp_path / f"corpus_{megabytes}.jsonl"
        _generate(path, corpus_text, megabytes)
        result = subprocess.run([sys.executable, "-c", _PREPARE, str(path), str(tmp_path / f"out_{megabytes}"), "5000000"],
                                capture_output=True, text=True, timeout=bound(600), env={**os.environ, "XLA_FLAGS": ""})
        assert result.returncode == 0, result.stderr[-2000:]
        peaks[megabytes] = int(result.stdout.split()[-1])
        path.unlink()
    assert peaks[100] < 1.10 * peaks[10], peaks  # 10x the corpus, < 10% more memory
    assert peaks[100] < 1 << 30, peaks


@pytest.mark.slow
def test_a_preparation_killed_after_its_first_shard_resumes_to_the_same_bytes(tmp_path, corpus_text):
    source = tmp_path / "corpus.jsonl"
    _generate(source, corpus_text, 12)
    whole = tmp_path / "whole"
    prepare([source], whole, val_fraction=0.05, shard_tokens=300_000, workers=1, progress="none")

    killed = tmp_path / "killed"
    process = subprocess.run([sys.executable, "-c", _KILLED_AFTER_FIRST_SHARD, str(source), str(killed), "300000"],
                             env={**os.environ, "XLA_FLAGS": ""}, capture_output=True, text=True, timeout=bound(120))
    assert process.returncode == -signal.SIGKILL, process.stderr
    finished = sorted(p.name for p in (killed / STAGING).glob("train_*.bin"))
    assert "meta.json" not in os.listdir(killed) and len(finished) < len(list(whole.glob("train_*.bin")))
    progress = json.loads((killed / STAGING / "progress.json").read_text())
    assert progress["train"]["next_section"] > 0  # the rerun resumes, it does not start over

    meta = prepare([source], killed, val_fraction=0.05, shard_tokens=300_000, workers=1, progress="none")
    assert _shard_bytes(killed) == _shard_bytes(whole)
    assert meta["shards"] == json.loads((whole / "meta.json").read_text())["shards"]
    assert not (killed / STAGING).exists()


def test_bad_records_are_counted_and_reported_and_a_corpus_of_only_bad_records_is_an_error(tmp_path, capsys):
    good = "\n".join(f"document number {i} has some words in it" for i in range(200))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([json.dumps({"text": good}), "{not json", json.dumps({"body": "no text field"}),
                               json.dumps({"text": 42}), json.dumps({"text": good + " again"}), "[1, 2]"]) + "\n")
    meta = prepare([path], tmp_path / "out", val_fraction=0.5)
    assert meta["documents"] == 2
    assert meta["bad_records"]["counts"] == {"lines that are not JSON": 1, "records without a 'text' field": 2,
                                             "records whose 'text' is not a string": 1}
    assert meta["bad_records"]["first"]["lines that are not JSON"] == f"{path}:2"
    assert "skipped 4 bad records" in capsys.readouterr().err and f"{path}:3" in json.dumps(meta["bad_records"])

    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"content": "wrong field"}) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"holds no documents: every record was bad: 1 lines that are not JSON "
                                          rf"\(first at {only_bad}:2\); 1 records without a 'text' field"):
        prepare([only_bad], tmp_path / "out_bad")


def test_a_missing_parquet_column_names_the_columns(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"has no column 'text' \(columns: \['body'\]\); pass --text_field"):
        prepare([tmp_path / "x.parquet"], tmp_path / "out")


def test_bad_settings_name_themselves_before_reading(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"workers must be >= 1 \(or None for every core\), got 0"):
        prepare([corpus], tmp_path / "d", workers=0)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match="out_dir '.*a_file' is a file, not a directory"):
        prepare([corpus], tmp_path / "a_file")
    with pytest.raises(ConfigError, match=r"out_dir '.*a_file/d' cannot be made: \[Errno 20\] Not a directory"):
        prepare([corpus], tmp_path / "a_file" / "d")  # had been a NotADirectoryError traceback


def test_prepare_skips_unchanged_inputs_and_redoes_changed(tmp_path, corpus):
    prepare([corpus], tmp_path)
    stamp = (tmp_path / "train_00000.bin").stat().st_mtime_ns
    prepare([corpus], tmp_path)
    assert (tmp_path / "train_00000.bin").stat().st_mtime_ns == stamp
    other = tmp_path / "other.txt"
    other.write_text("".join(f"something else entirely, line {i}\nand more\n" for i in range(5000)))
    meta = prepare([other], tmp_path)
    assert meta["sources"][0]["path"] == str(other)


def test_non_utf8_bytes_become_replacement_characters(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("".join(f"caf\xe9 number {i}\n" for i in range(5000)).encode("latin-1"))
    meta = prepare([path], tmp_path / "data", val_fraction=0.5)
    assert meta["replaced_invalid_utf8"] == 5000


@pytest.mark.slow
def test_the_cli_prepares_what_train_reads(tmp_path, corpus):
    result = subprocess.run([sys.executable, "-m", "gpt.data", "--data", corpus, "--out_dir", str(tmp_path / "d"),
                             "--workers", "2"], capture_output=True, text=True, timeout=bound(120), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "documents ->" in result.stdout and (tmp_path / "d" / "meta.json").is_file()


# ------------------------------------------------------------------------------------------ the loader

def _numbered_shards(directory: Path, sizes: list[int]) -> list[Path]:
    """Shard i holds i * 10000 + 0, 1, 2, ...: a window's values tell which shard it came from and whether
    it is contiguous."""
    paths = []
    for i, size in enumerate(sizes):
        path = directory / f"train_{i:05d}.bin"
        (i * 10_000 + np.arange(size, dtype=np.uint16)).tofile(path)
        paths.append(path)
    return paths


def test_the_loader_is_deterministic_and_never_crosses_a_shard(tmp_path):
    shards = _numbered_shards(tmp_path, [40, 500, 16, 3000, 17])  # 16: too short for a 17-token window; 17: one
    batches = Batches(shards, block_size=16, batch_size=64, seed=3)
    seen = set()
    for step in range(50):
        batch = batches[step]
        assert batch.shape == (64, 17)
        shard, offset = batch // 10_000, batch % 10_000
        assert (shard == shard[:, :1]).all() and (np.diff(offset, axis=1) == 1).all()
        seen |= set(shard[:, 0].tolist())
    assert {0, 1, 3} <= seen and 2 not in seen  # shards are drawn in proportion to the windows they hold
    np.testing.assert_array_equal(Batches(shards, 16, 64, seed=3)[7], batches[7])
    assert not np.array_equal(batches[7], batches[8])
    halves = [Batches(shards, 16, 64, seed=3, process_index=i, process_count=2) for i in range(2)]
    np.testing.assert_array_equal(batches[5], np.concatenate([h[5] for h in halves]))
    with pytest.raises(ConfigError, match=r"at most 40 tokens each, fewer than block_size \+ 1 = 41"):
        Batches(shards[:1], block_size=40, batch_size=2, seed=0)


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_a_corpus_prepared_by_the_library_call_is_what_train_reads_without_tokenizing_again(tmp_path, corpus):
    """prepare()'s defaults are train.py's: a run on the same corpus finds its shards up to date."""
    from training import run

    prepare([corpus], tmp_path / "run" / "data")
    meta = tmp_path / "run" / "data" / "meta.json"
    written = meta.stat().st_mtime_ns
    run(tmp_path, corpus, max_steps=3)
    assert meta.stat().st_mtime_ns == written


def test_a_run_directory_inside_a_corpus_directory_is_not_read_as_text(tmp_path, corpus_text):
    from gpt.data.corpus import expand_inputs
    from gpt.run_dir import RunLock

    (tmp_path / "notes.txt").write_text(corpus_text[:5_000])
    for name in ("first", "second"):  # two runs in one directory, each trained with --data .
        with RunLock(tmp_path / name):
            (tmp_path / name / "metrics.jsonl").write_text('{"step": 5, "loss": 4.2}\n')
            (tmp_path / name / "checkpoints" / "5").mkdir(parents=True)
            (tmp_path / name / "checkpoints" / "5" / "commit_success.txt").write_text("Checkpoint commit was successful")
            (tmp_path / name / "data").mkdir()
            with RunLock(tmp_path / name / "data", role="corpus preparation"):
                (tmp_path / name / "data" / "notes.txt").write_text("a prepared directory's own file")
    assert expand_inputs([tmp_path]) == [tmp_path / "notes.txt"]  # the runs' markers and metrics had been text
    with pytest.raises(ConfigError, match="no corpus files found"):
        expand_inputs([tmp_path / "first"])
