"""llm.c (`train_gpt2cu`, built with cuDNN: `USE_CUDNN=1`) as the peer of bench/gpu_bench.py: the same model
shape, micro-batch, block and tokens a step, on random tokens in llm.c's own file format.

The binary is given by path (`gpu_bench.py --llmc PATH`, `LLMC=PATH bash bench/gpu.sh train`): built from
llm.c's source as its README says, on the GPU machine, before the call's benchmark. It initializes GPT-2's
shape at random (`-e d12` for 124M, `d24` for 350M), trains `steps` steps and prints each one's time; its
figure is the median step after the first two (its own warm-up).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["MAGIC", "write_tokens", "read_tokens", "command", "step_times", "device_name", "run"]

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256  # llm.c's token files: a 256 x int32 header, then uint16 ids
WARMUP_STEPS = 2


def write_tokens(path: Path, tokens: np.ndarray) -> None:
    """Token ids (< 65536) as an llm.c token file: header (magic, version, count), then the ids as uint16."""
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = MAGIC, VERSION, len(tokens)
    with open(path, "wb") as file:
        file.write(header.tobytes())
        file.write(np.asarray(tokens, np.uint16).tobytes())


def read_tokens(path: Path) -> np.ndarray:
    """The ids of an llm.c token file (ValueError for another format)."""
    data = Path(path).read_bytes()
    header = np.frombuffer(data[:HEADER_INTS * 4], np.int32)
    if header[0] != MAGIC or header[1] != VERSION:
        raise ValueError(f"{path} is not an llm.c token file (header {header[:3].tolist()})")
    tokens = np.frombuffer(data[HEADER_INTS * 4:], np.uint16)
    if len(tokens) != header[2]:
        raise ValueError(f"{path} holds {len(tokens)} tokens where its header says {header[2]}")
    return tokens


def command(binary: str, train: Path, val: Path, *, depth: int, micro_batch: int, block_size: int,
            tokens_per_step: int, steps: int) -> list[str]:
    """The run: GPT-2's shape of `depth` layers at random init, AdamW at GPT-2's 6e-4, no evaluation or
    sampling inside the timed steps, no checkpoints."""
    return [binary, "-i", str(train), "-j", str(val), "-e", f"d{depth}", "-b", str(micro_batch), "-t", str(block_size),
            "-d", str(tokens_per_step), "-x", str(steps), "-v", "1000", "-m", "1", "-s", "0", "-l", "6e-4",
            "-u", "2", "-r", "1", "-z", "0"]


_STEP = re.compile(r"^step\s+(\d+)/\d+ \|.*?\|\s*(?:comp_t\s*)?([\d.]+)\s*ms", re.M)


def step_times(output: str) -> list[float]:
    """Each step's time in seconds, in order, from llm.c's log ("step    3/10 | loss ... | 998.12 ms | ...")."""
    return [float(ms) / 1e3 for _, ms in _STEP.findall(output)]


def device_name(output: str) -> str:
    match = re.search(r"\|\s*device\s*\|\s*(.+?)\s*\|", output)
    return match.group(1) if match else "?"


def run(binary: str, *, depth: int, vocab_size: int, micro_batch: int, block_size: int, accumulation: int,
        steps: int, timeout_s: float) -> dict:
    """Train `steps` (+ its warm-up) steps with llm.c; {step_s (median after the warm-up), first_step_s,
    device}. Raises RuntimeError with its output's tail if it fails or prints no step."""
    tokens_per_step = micro_batch * block_size * accumulation
    total = steps + WARMUP_STEPS
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="llmc-") as folder:
        train, val = Path(folder) / "train.bin", Path(folder) / "val.bin"
        write_tokens(train, rng.integers(0, vocab_size, total * tokens_per_step + 1))
        write_tokens(val, rng.integers(0, vocab_size, 20 * micro_batch * block_size + 1))
        done = subprocess.run(command(binary, train, val, depth=depth, micro_batch=micro_batch,
                                      block_size=block_size, tokens_per_step=tokens_per_step, steps=total),
                              capture_output=True, text=True, timeout=timeout_s, cwd=folder)
    output = done.stdout + done.stderr
    times = step_times(done.stdout)
    if done.returncode != 0 or len(times) <= WARMUP_STEPS:
        raise RuntimeError(f"llm.c exited {done.returncode} after {len(times)} steps:\n{output[-3000:]}")
    return {"step_s": statistics.median(times[WARMUP_STEPS:]), "first_step_s": times[0],
            "device": device_name(done.stdout)}
