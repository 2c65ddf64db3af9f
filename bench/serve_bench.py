"""Serving under load: our engine behind serve.py, our `generate` one request at a time, and transformers'
continuous batching, on the same requests and the same weights.

    python bench/serve_bench.py                 # GPT-2 124M shapes, random weights, float32, CPU
    python bench/serve_bench.py --dtype bfloat16    # on a GPU (the torch peer too)

The load: --requests requests (default 64), prompt lengths uniform in --prompt-lengths (default [16, 256])
and output lengths uniform in [16, 128], random token ids, all drawn from a fixed seed, greedy; --clients closed-loop clients
(default 8), client c sending requests c, c + clients, ... one after another. Each client times its own
requests: time to first token (TTFT, from sending), and the gaps between tokens (ITL; tokens that arrive
together share their gap). Output tokens/s is all tokens over the wall time of the whole load.

  ours, serve.py       serve.py in a process of its own (bench/serve_process.py), streamed to over HTTP
                       by the same plain client as llama-server; compiled at start-up (warm-up not
                       timed); once per --prefill-chunk
  ours, engine         the same engine without HTTP: requests submitted in process (`Engine.submit`),
                       like the transformers peer's (--engine-only runs only this and the peer)
  ours, generate       gpt.generate.generate per request, one at a time in arrival order (every
                       shape compiled before timing)
  transformers CB      transformers' in-process continuous batching (`init_continuous_batching`),
                       the engine behind `transformers serve`, called directly: its server needs
                       a hub download, which this machine cannot make
  llama-server         (--llama-cpp) llama.cpp's server, f32 and q8_0, with --slots parallel sequences,
                       its own GGUF of the same weights (bench/llama_peer.py), streaming over HTTP
Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

from gpt.generate import generate
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY
from gpt.inference.speculation import DRAFTS
from gpt.model import gpt2

from machine import cpu_name


def make_load(requests: int, prompt_lengths=(16, 256), seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    low, high = prompt_lengths
    return [(rng.integers(0, 50256, int(rng.integers(low, high + 1))).tolist(), int(rng.integers(16, 129)))
            for _ in range(requests)]


def run_load(load, clients: int, send) -> dict:
    """Run `send(prompt, max_tokens) -> (ttft, token arrival gaps)` from `clients` closed-loop threads."""
    results = [None] * len(load)

    def client(c):
        for i in range(c, len(load), clients):
            results[i] = send(*load[i])

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    ttft = np.array([r[0] for r in results])
    gaps = np.concatenate([r[1] for r in results if len(r[1])])
    tokens = sum(len(r[1]) + 1 for r in results)
    return dict(tokens=tokens, wall=wall, tokens_per_s=tokens / wall, ttft_p50=np.percentile(ttft, 50),
                ttft_p99=np.percentile(ttft, 99), itl_p50=np.percentile(gaps, 50), itl_p99=np.percentile(gaps, 99))


def gaps_of(times: list[float], counts: list[int]) -> list[float]:
    """Per-token gaps from arrival times of batches of `counts` tokens (the first batch's first token is
    the TTFT)."""
    gaps = [0.0] * (counts[0] - 1)
    for before, now, n in zip(times, times[1:], counts[1:]):
        gaps += [(now - before) / n] * n
    return gaps


def make_engine(directory, load, dtype, slots, steps_per_call, quantize, prefill_chunk, draft="none") -> Engine:
    """Our engine as serve.py builds it, with a queue that holds the whole load."""
    return Engine(gpt2.load(directory, dtype=dtype), slots=slots, steps_per_call=steps_per_call,
                  max_queue=len(load), quantize=quantize, prefill_chunk=prefill_chunk, draft=draft)


def bench_server(directory, load, clients, dtype, slots, steps_per_call, quantize, prefill_chunk, draft="none"):
    """serve.py in a process of its own, as a user runs it, and the same plain streaming client as
    llama-server's (httpx, one JSON parse an event): sharing this process, the server had shared its
    interpreter lock with the clients' threads, and the openai client builds objects for every event."""
    import httpx

    from serve_process import start_serve

    process, url = start_serve(directory, "--slots", str(slots), "--steps_per_call", str(steps_per_call),
                               "--prefill_chunk", str(prefill_chunk), "--max_queue", str(len(load)),
                               "--dtype", dtype, "--quantize", quantize, "--model_name", "gpt2", "--draft", draft)

    def send(prompt, max_tokens):
        body = {"model": "gpt2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "logprobs": 0}
        sent, times, counts = time.perf_counter(), [], []
        with httpx.stream("POST", url + "/completions", json=body, timeout=600) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {") and (logprobs := json.loads(line[6:])["choices"][0]["logprobs"]):
                    times.append(time.perf_counter())
                    counts.append(len(logprobs["tokens"]))
        return times[0] - sent, gaps_of(times, counts)

    try:
        send(*load[0])  # first-request setup outside the timing, as llama-server's
        return run_load(load, clients, send)
    finally:
        process.terminate()
        process.wait()


def bench_engine(directory, load, clients, dtype, slots, steps_per_call, quantize, prefill_chunk, draft="none"):
    engine = make_engine(directory, load, dtype, slots, steps_per_call, quantize, prefill_chunk, draft)
    engine.warmup(log=lambda line: None)
    engine.start()

    def send(prompt, max_tokens):
        sent, times, counts = time.perf_counter(), [], []

        def on_update(completion):  # on the engine's thread, after each batch of new tokens
            if new := len(completion.tokens) - sum(counts):
                times.append(time.perf_counter())
                counts.append(new)

        engine.submit(Request(prompt, max_tokens, GREEDY), on_update).done.wait()
        return times[0] - sent, gaps_of(times, counts)

    try:
        return run_load(load, clients, send)
    finally:
        engine.stop()


def bench_generate(directory, load, clients, dtype):
    model = gpt2.load(directory, dtype=dtype)
    for prompt, max_tokens in {(len(p) - 1).bit_length() * 100 + (m - 1).bit_length(): (p, m) for p, m in load}.values():
        generate(model, [prompt], max_tokens, sampling=GREEDY)  # compile every bucket the load will use
    lock = threading.Lock()

    def send(prompt, max_tokens):
        sent, times = time.perf_counter(), []
        with lock:  # one request at a time, in the order they arrive
            generate(model, [prompt], max_tokens, sampling=GREEDY,
                     on_token=lambda row, token: times.append(time.perf_counter()))
        return times[0] - sent, list(np.diff(times))

    return run_load(load, clients, send)


def bench_transformers(directory, load, clients, dtype):
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=getattr(torch, dtype)).to(device).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()

    def send(prompt, max_tokens):
        sent = time.perf_counter()
        request_id = manager.add_request(prompt, max_new_tokens=max_tokens, record_timestamps=True)
        result = next(r for r in manager.request_id_iter(request_id) if r.is_finished())
        return result.timestamps[0] - sent, list(np.diff(result.timestamps))

    try:
        with torch.inference_mode():
            send(*load[0])  # first-call setup outside the timing
            return run_load(load, clients, send)
    finally:
        manager.stop(block=True)


def bench_llama_server(directory, load, clients, slots, outtype):
    import llama_peer
    from sample_bench import write_gpt2_vocab

    write_gpt2_vocab(Path(directory))
    gguf = llama_peer.convert(Path(directory), outtype)
    longest = max(len(prompt) + max_tokens for prompt, max_tokens in load)
    with llama_peer.LlamaServer(gguf, slots, slot_context=longest, threads=len(os.sched_getaffinity(0))) as server:
        def send(prompt, max_tokens):
            sent, times, counts = time.perf_counter(), [], []
            for tokens in server.stream(prompt, max_tokens):
                times.append(time.perf_counter())
                counts.append(len(tokens))
            return times[0] - sent, gaps_of(times, counts)

        send(*load[0])  # first-request setup outside the timing, as the others'
        return run_load(load, clients, send)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=[16, 256], metavar=("LOW", "HIGH"))
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[256],
                        help="our engine's prefill chunk (1024: every prompt in one prefill)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "int4", "bf16"],
                        help="our server's weights (the peers stay float32)")
    parser.add_argument("--draft", nargs="+", default=["none"], choices=["none", *DRAFTS],
                        help="ours without a draft and/or with one (serve.py --draft)")
    parser.add_argument("--engine-only", action="store_true",
                        help="ours without HTTP (the engine in process), then the peer; not serve.py or generate")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama-server, f32 and q8_0 (built on first use)")
    args = parser.parse_args()

    import torch
    import transformers

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    load = make_load(args.requests, args.prompt_lengths)
    print(f"# {cpu_name()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {args.requests} requests, {args.clients} clients, prompts of "
          f"{args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, "
          f"{sum(m for _, m in load)} output tokens asked")
    print("| impl | output tokens/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def row(name, r):
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
              f"{1e3 * r['itl_p50']:.0f} | {1e3 * r['itl_p99']:.0f} | {r['wall']:.1f} |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(Path(tmp))
        del reference
        for quantize in args.quantize:
            for steps in args.steps_per_call:
                for chunk, draft in [(c, d) for c in args.prefill_chunk for d in args.draft]:
                    weights = "" if quantize == "none" else f", {quantize} weights"
                    chunked = f", prefill chunk {chunk}" if len(args.prefill_chunk) > 1 else ""
                    drafted = "" if draft == "none" else f", {draft} draft"
                    how, bench = ("engine in process", bench_engine) if args.engine_only else ("serve.py", bench_server)
                    row(f"ours, {how} ({args.slots} slots, {steps} step/call, {args.dtype}{weights}{chunked}{drafted})",
                        bench(tmp, load, args.clients, args.dtype, args.slots, steps, quantize, chunk, draft))
        if not (args.skip_generate or args.engine_only):
            row(f"ours, generate per request ({args.dtype})", bench_generate(tmp, load, args.clients, args.dtype))
        if not args.skip_torch:
            row(f"transformers continuous batching (torch, {args.dtype})",
                bench_transformers(tmp, load, args.clients, args.dtype))
        if args.llama_cpp:
            for outtype in ("f32", "q8_0"):
                row(f"llama-server ({args.slots} slots, {outtype})",
                    bench_llama_server(tmp, load, args.clients, args.slots, outtype))


if __name__ == "__main__":
    main()
