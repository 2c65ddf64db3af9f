"""Sampling speed: gpt.generate against transformers' GPT2LMHeadModel.generate on the same weights.

    python bench/sample_bench.py                     # GPT-2 124M shapes, float32, CPU
    python bench/sample_bench.py --dtype bfloat16 --batches 1 64 --skip-torch   # on a GPU

Random weights at the real gpt2 shapes, a 64-token prompt, 128 new tokens, greedy. For each batch size:
time to the first token in a fresh process state (compile included, measured through streaming), and
decode throughput after warm-up (best of --repeats). Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from gpt import gpt2
from gpt.generate import generate


def bench_ours(directory, prompts, new_tokens, dtype, repeats):
    model = gpt2.load(directory, dtype=dtype)
    start, first = time.perf_counter(), []
    generate(model, prompts, new_tokens, temperature=0,
             on_token=lambda row, token: first or first.append(time.perf_counter()))
    ttft = first[0] - start
    generate(model, prompts, new_tokens, temperature=0)  # compile the non-streaming loop
    best = min(_timed(lambda: generate(model, prompts, new_tokens, temperature=0)) for _ in range(repeats))
    return ttft, len(prompts) * new_tokens / best


def bench_torch(directory, prompts, new_tokens, repeats):
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    ids = torch.as_tensor(np.asarray(prompts))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=50256)
    with torch.inference_mode():
        ttft = _timed(lambda: model.generate(ids, max_new_tokens=1, **kwargs))
        model.generate(ids, max_new_tokens=8, **kwargs)
        best = min(_timed(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                 **kwargs)) for _ in range(repeats))
    return ttft, len(prompts) * new_tokens / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()

    import torch
    import transformers

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    print(f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), {time.strftime('%Y-%m-%d')}")
    print("| batch | impl | first token (s, compile incl.) | tokens/s | vs torch |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(Path(tmp))
        del reference
        for batch in args.batches:
            prompts = np.random.default_rng(batch).integers(0, 50257, (batch, args.prompt_tokens)).tolist()
            jax.clear_caches()  # each batch's first call pays its own compile
            ours = bench_ours(tmp, prompts, args.new_tokens, args.dtype, args.repeats)
            theirs = None if args.skip_torch else bench_torch(tmp, prompts, args.new_tokens, args.repeats)
            ratio = f"{ours[1] / theirs[1]:.2f}x" if theirs else "-"
            print(f"| {batch} | gpt (jax, {args.dtype}) | {ours[0]:.2f} | {ours[1]:.1f} | {ratio} |", flush=True)
            if theirs:
                print(f"| {batch} | transformers (torch) | {theirs[0]:.2f} | {theirs[1]:.1f} | 1.00x |", flush=True)


if __name__ == "__main__":
    main()
