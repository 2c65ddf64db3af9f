"""`sample.py`'s time from its start to the first streamed token, with the persistent compilation cache warm.

    python bench/first_token.py [--runs 4] [--quantize none int8]

GPT-2 124M shapes, random weights (transformers' initialization, saved as a Hugging Face directory);
`sample.py --init_from DIR --start "Hello, my name is" --stream --max_new_tokens 8 --temperature 0`
in a fresh process each run, its compilation cache in a temporary directory: the first run fills it,
the others read it. The time runs from the process's start to the first byte after the echoed prompt.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello, my name is"


def first_token_seconds(hf_dir: Path, cache_home: Path, quantize: str) -> float:
    command = [sys.executable, str(ROOT / "sample.py"), "--init_from", str(hf_dir), "--start", PROMPT,
               "--num_samples", "1", "--stream", "--max_new_tokens", "8", "--temperature", "0",
               "--quantize", quantize]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                               env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    echoed = process.stdout.read(len(PROMPT.encode()) + 1)  # the prompt, then the first token's first byte
    seconds = time.perf_counter() - start
    process.stdout.read()
    if process.wait() != 0 or len(echoed) <= len(PROMPT):
        raise RuntimeError(f"sample.py failed (exit {process.returncode}): {' '.join(command)}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4, help="runs per setting; the first fills the cache")
    parser.add_argument("--quantize", nargs="+", default=["none", "int8"])
    args = parser.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(Path(tmp) / "hf")
        print(f"# {cpu_name()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; GPT-2 124M, random weights")
        print("| quantize | first run (fills the cache), s | runs with the cache warm, s |\n| --- | --- | --- |")
        for quantize in args.quantize:
            cache_home = Path(tmp) / f"cache-{quantize}"
            times = [first_token_seconds(Path(tmp) / "hf", cache_home, quantize) for _ in range(args.runs)]
            print(f"| {quantize} | {times[0]:.2f} | {', '.join(f'{t:.2f}' for t in times[1:])} |", flush=True)


if __name__ == "__main__":
    main()
