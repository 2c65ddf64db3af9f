"""Corpus preparation speed and memory, side by side on one generated corpus.

    python bench/data_bench.py --megabytes 1024

Generates a JSONL corpus of real text (slices of the running Python's standard library, each document
made unique), then times, each in a fresh process so that its peak RSS is its own:

- ours: `gpt.data.prepare.prepare` on every core (reading, tokenizing, the split, writing shards);
- the ceiling: tiktoken's `encode_ordinary_batch` on every core over the same documents, counting the
  tokenizer calls alone (no reading, no writing);
- the check every use makes of the prepared shards (`gpt.data.shards.verify_shards`: sizes, SHA-256s and
  ids, streamed), which a resume waits for;
- nanoGPT's way (its openwebtext/prepare.py): Hugging Face `datasets` `load_dataset("json")` +
  `map(num_proc=cores)`, then the tokens concatenated into an `np.memmap`.

Prints one table (MB/s of text, peak RSS) with the CPU, the date and the command. The 2-core machines
this runs on are shared and their speed drifts by 10-30% within minutes, so `--repeats N` alternates ours
and the ceiling N times and reports every pair and the median of the ratios.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import tyro

from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]

OURS = """
import resource, sys, time
from gpt.data.prepare import prepare
start = time.perf_counter()
meta = prepare([sys.argv[1]], sys.argv[2], val_fraction=0.05, workers=int(sys.argv[3]), progress="none")
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      meta["train_tokens"] + meta["val_tokens"])
"""

VERIFY = """
import json, resource, sys, time
from gpt.data.shards import verify_shards
start = time.perf_counter()
verify_shards(sys.argv[1], 50257)
meta = json.load(open(sys.argv[1] + "/meta.json"))
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      meta["train_tokens"] + meta["val_tokens"])
"""

CEILING = """
import json, resource, sys, time
import tiktoken
encoding = tiktoken.get_encoding("gpt2")
seconds, tokens, batch, size = 0.0, 0, [], 0
def run(batch):
    global seconds, tokens
    start = time.perf_counter()
    tokens += sum(map(len, encoding.encode_ordinary_batch(batch, num_threads=int(sys.argv[2]))))
    seconds += time.perf_counter() - start
with open(sys.argv[1]) as file:
    for line in file:
        batch.append(json.loads(line)["text"]); size += len(line)
        if size > 64 << 20:
            run(batch); batch, size = [], 0
if batch:
    run(batch)
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, tokens)
"""

NANOGPT = """
import os, resource, sys, time
import numpy as np, tiktoken
from datasets import load_dataset
encoding = tiktoken.get_encoding("gpt2")
start = time.perf_counter()
dataset = load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
def process(example):
    ids = encoding.encode_ordinary(example["text"]) + [encoding.eot_token]
    return {"ids": ids, "len": len(ids)}
tokenized = dataset.map(process, remove_columns=["text"], num_proc=int(sys.argv[2]))
total = int(np.sum(tokenized["len"], dtype=np.uint64))
out = np.memmap(os.path.join(sys.argv[3], "train.bin"), dtype=np.uint16, mode="w+", shape=(total,))
index = 0
for shard in range(1024):
    batch = tokenized.shard(num_shards=1024, index=shard, contiguous=True).with_format("numpy")
    ids = np.concatenate(batch["ids"])
    out[index:index + len(ids)] = ids
    index += len(ids)
out.flush()
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(time.perf_counter() - start, peak * 1024, total)
"""


@dataclasses.dataclass(frozen=True)
class Config:
    megabytes: int = 1024
    """Size of the generated JSONL corpus."""
    workers: int = os.cpu_count() or 1
    """Threads (ours, the ceiling) and processes (datasets) to use."""
    repeats: int = 1
    """Alternate ours and the ceiling this many times; the median ratio is reported."""
    skip_nanogpt: bool = False
    """Leave out the datasets baseline (it needs `pip install datasets`)."""


def generate(path: Path, megabytes: int) -> None:
    stdlib = "".join(p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    rng = np.random.default_rng(0)
    with open(path, "w") as file:
        written, number = 0, 0
        while written < megabytes << 20:
            start = int(rng.integers(0, len(stdlib) - 20_000))
            line = json.dumps({"text": f"document {number}\n" + stdlib[start:start + int(rng.integers(500, 20_000))]}) + "\n"
            file.write(line)
            written, number = written + len(line), number + 1


def measure(script: str, *args: str) -> tuple[float, int, int]:
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    seconds, peak, tokens = result.stdout.split()[-3:]
    return float(seconds), int(peak), int(tokens)


def main(config: Config) -> None:
    cpu = cpu_name()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        generate(corpus, config.megabytes)
        size_mb = corpus.stat().st_size / 2**20
        rows, ratios = [], []
        for repeat in range(config.repeats):
            ours = measure(OURS, str(corpus), str(Path(tmp) / f"ours{repeat}"), str(config.workers))
            verify = measure(VERIFY, str(Path(tmp) / f"ours{repeat}"))
            ceiling = measure(CEILING, str(corpus), str(config.workers))
            shutil.rmtree(Path(tmp) / f"ours{repeat}")
            rows += [("ours: gpt.data.prepare.prepare", ours),
                     ("the shards checked at each use: gpt.data.shards.verify_shards", verify),
                     ("ceiling: tiktoken encode_ordinary_batch (tokenizer calls only)", ceiling)]
            ratios.append(ceiling[0] / ours[0])
        if not config.skip_nanogpt:
            rows.append(("nanoGPT's way: datasets map(num_proc) + np.memmap",
                         measure(NANOGPT, str(corpus), str(config.workers), str(Path(tmp) / "hf"))))
    print(f"{cpu}, {os.cpu_count()} cores; {datetime.date.today()}; {size_mb:.0f} MB of JSONL, workers={config.workers}")
    print(f"command: python bench/data_bench.py --megabytes {config.megabytes} --repeats {config.repeats}"
          + (" --skip_nanogpt" if config.skip_nanogpt else ""))
    print("| what | seconds | MB/s | tokens | peak RSS |")
    print("| --- | --- | --- | --- | --- |")
    for name, (seconds, peak, tokens) in rows:
        print(f"| {name} | {seconds:.1f} | {size_mb / seconds:.2f} | {tokens:,} | {peak / 2**20:.0f} MiB |")
    print(f"ours / ceiling throughput, each pair: {', '.join(f'{r:.3f}x' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main(tyro.cli(Config))
