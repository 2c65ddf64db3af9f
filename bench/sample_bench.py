"""Sampling speed: gpt.generate against transformers' `generate` on the same weights, and
(with --ctranslate2) CTranslate2's Generator in float32 and int8, (with --llama-cpp) llama.cpp in f32 and
q8_0, or the types --llama-cpp-types names (Q4_K_M and Q4_0 by its llama-quantize) (bench/llama_peer.py: its own
GGUF of the same weights, llama-batched-bench's timing, greedy tokens
from llama-server; its first-token column is its prefill, there being nothing to compile).

    python bench/sample_bench.py                     # GPT-2 124M shapes, float32, CPU
    python bench/sample_bench.py --shape smollm2-135m --quantize none int8 --llama-cpp   # a Llama shape
    python bench/sample_bench.py --shape gemma3-270m --quantize none int8 --llama-cpp    # Gemma 3's, local layers
    python bench/sample_bench.py --shape llama-1b --quantize none int8 int4 --skip-torch --llama-cpp \
        --llama-cpp-types q8_0 Q4_K_M Q4_0                                               # 4-bit at 1B
    python bench/sample_bench.py --quantize none int8 --ctranslate2 --llama-cpp     # the CPU peers
    python bench/sample_bench.py --dtype bfloat16 --batches 1 8 64   # on a GPU (the torch peer too)
    python bench/sample_bench.py --dtype bfloat16 --variants baseline chunk16 command_buffers all   # decode levers
    python bench/sample_bench.py --smoke --variants baseline all      # tiny shapes, the code path (the suite)

Random weights at the real gpt2 shapes (or SmolLM2-135M's, `--shape`: grouped-query attention, RMSNorm, a gated
MLP, with GPT-2's vocabulary and tokenizer so that every peer reads the same ids; or Gemma 3 270M's, five local
layers of a 512-position window to one global, its 262,144-row table tied, GPT-2's tokenizer padded to it; or
Llama 3.2 1B's, 1.08 B parameters with GPT-2's vocabulary), a 64-token prompt, 128 new tokens, greedy. For each batch size:
time to the first token in a fresh process state (compile and our weight layout included, measured
through streaming), and decode throughput after warm-up (best of --repeats, llama-batched-bench's runs too),
and for ours the bytes a decode step reads (every weight once, and the KV cache at the decode's mean length) and
MBU: those bytes x steps a second over the device's rated memory bandwidth (`gpt.hardware.CHIPS`; none for a CPU).
Each of our variants (`--variants`: `decode_levers()`, as bench/variants.py composes them) runs in a process of
its own, since XLA reads its flags as it starts. The last line is the rows in JSON.
Ours decodes through a `gpt.inference.decoder.Decoder` made once per configuration, as the peers load (and
CTranslate2 converts) once. Prints a Markdown table for bench/RESULTS.md.

With --rounds R every batch's comparison runs R times in turn (ours, then each peer, again), and a last table
gives each pair's ratio per round: on a shared machine whose memory bandwidth drifts by tens of percent within
minutes, one round's ratio can land anywhere in that spread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from gpt.generate import generate
from gpt.inference.decoder import Decoder
from gpt.inference.sampling import GREEDY
from gpt.loading import load

from machine import cpu_name
from variants import Lever, Levers, ran_with, report, run_worker

# XLA's command buffers (CUDA graphs) over every kind of op, loops and conditionals included, from one op up:
# a decode chunk, its sampler's branches and its loop replay as one graph with no host round trip.
COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                   "--xla_gpu_graph_min_graph_size=1")


def decode_levers() -> Levers:
    """The decode step's levers: decode steps unrolled between the loop's checks (the backend's `decode_chunk`),
    command buffers, XLA's O1, attention over the cache without a transposed copy of it; `all` is command
    buffers and O1 (a chunk length and the attention are named alongside: `all+chunk32+plain_attention`)."""
    known = {f"chunk{n}": Lever(choices={"decode_chunk": n}) for n in (1, 8, 16, 32)}
    known |= {"command_buffers": Lever(env={"XLA_FLAGS": COMMAND_BUFFERS}),
              "o1": Lever(env={"JAX_OPTIMIZATION_LEVEL": "O1"}),
              # The cache read in its own [B * N, S, H] layout by two products, where the GPU's row transposes
              # all of it for jax.nn.dot_product_attention at every step.
              "plain_attention": Lever(choices={"attention": "plain"})}
    return Levers(known, together=("command_buffers", "o1"))


def bench_ours(directory, prompts, new_tokens, dtype, repeats, quantize="none"):
    """(first token s, tokens/s, greedy tokens, bytes a decode step reads) of `generate` in this process."""
    model = load(str(directory), dtype=dtype)
    start, first = time.perf_counter(), []
    # Laid out (and quantized) once, as the peers load and convert once; the first token's time includes it.
    decoder = Decoder.of(model, quantize)
    generate(decoder, prompts, new_tokens, sampling=GREEDY,
             on_token=lambda row, token: first or first.append(time.perf_counter()))
    ttft = first[0] - start
    run = lambda: generate(decoder, prompts, new_tokens, sampling=GREEDY)  # noqa: E731
    tokens = run()  # compile the non-streaming loop
    best = min(_timed(run) for _ in range(repeats))
    step_bytes = bytes_a_step(decoder, len(prompts), len(prompts[0]) + new_tokens / 2)
    return ttft, len(prompts) * new_tokens / best, tokens, step_bytes


def bytes_a_step(decoder: Decoder, batch: int, mean_length: float) -> float:
    """What a decode step must read: every weight array once (a tied head is the embedding, counted once), and
    each row's keys and values over `mean_length` positions in the cache's dtype."""
    weights = {id(leaf): leaf.nbytes for leaf in jax.tree.leaves(decoder.weights)}
    config = decoder.config
    width = config.kv_heads * config.head_dim  # a position's keys (or values) in one layer
    cache = 2 * config.n_layer * batch * mean_length * width * config.compute_dtype.itemsize
    return sum(weights.values()) + cache


def ours_in_a_process(variant: str, directory, prompts, new_tokens, dtype, repeats, quantize) -> dict:
    """`bench_ours` in a worker process started with `variant`'s levers; its row, with the device's name and
    what the worker's backend row and XLA options were."""
    job = dict(directory=str(directory), prompts=prompts, new_tokens=new_tokens, dtype=dtype, repeats=repeats,
               quantize=quantize, variant=variant)
    return run_worker(__file__, job, decode_levers().env(variant), timeout_s=900)


def worker(job: dict) -> None:
    ttft, speed, tokens, step_bytes = bench_ours(job["directory"], job["prompts"], job["new_tokens"], job["dtype"],
                                                 job["repeats"], job["quantize"])
    report({"ttft": ttft, "speed": speed, "tokens": tokens, "step_bytes": step_bytes,
            "device": jax.devices()[0].device_kind, "ran_with": ran_with()})


def mbu(row: dict, batch: int) -> float | None:
    """Memory-bandwidth utilization: bytes a step x steps a second over the device's rated bandwidth."""
    from gpt.hardware import chip_of

    chip = chip_of(row["device"])
    return None if chip is None else row["step_bytes"] * row["speed"] / batch / chip.memory_bandwidth


# The pairs compared round by round with --rounds: each of ours against its peer of the same weights' type.
PAIRS = [("gpt (jax, float32, weights none)", "llama.cpp (f32)"), ("gpt (jax, float32, weights int8)", "llama.cpp (q8_0)"),
         ("gpt (jax, float32, weights int4)", "llama.cpp (Q4_K_M)"), ("gpt (jax, float32, weights int4)", "llama.cpp (Q4_0)"),
         ("gpt (jax, float32, weights int8)", "CTranslate2 (int8)"), ("gpt (jax, float32, weights none)", "CTranslate2 (float32)")]


def write_gpt2_vocab(directory: Path, vocab_size: int = 50257) -> None:
    """vocab.json and merges.txt (what CTranslate2's converter reads) rebuilt from the vendored BPE ranks:
    each token's merge is the last one byte-pair encoding with the lower ranks makes of its bytes. A model of a
    larger vocabulary gets tokens <unused{id}> up to its size (as Gemma's files have), so that a converter that
    cuts the embedding to its tokenizer's size (llama.cpp's for Gemma 3) keeps every row."""
    import json

    from gpt.tokenizer import get_tokenizer

    ranks = get_tokenizer().encoding._mergeable_ranks
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes -> unicode table
    extra = iter(range(256, 512))
    byte_char = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    text = lambda token: "".join(byte_char[b] for b in token)  # noqa: E731
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(a + b, 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            _, i = min(pairs)
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    vocab = ({text(token): rank for token, rank in ranks.items()} | {"<|endoftext|>": 50256}
             | {f"<unused{i}>": i for i in range(50257, vocab_size)})
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    # The same as tokenizer.json, which a Llama directory's converter reads (through AutoTokenizer).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))


def bench_ctranslate2(directory, prompts, new_tokens, repeats, compute_type):
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    out = Path(directory) / f"ct2-{compute_type}"
    if not out.exists():
        TransformersConverter(str(directory)).convert(str(out), quantization=compute_type)
    generator = ctranslate2.Generator(str(out), device="cpu", compute_type=compute_type, intra_threads=2)
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(directory))
    start_tokens = [tokenizer.convert_ids_to_tokens(p) for p in prompts]
    run = lambda n: generator.generate_batch(start_tokens, max_length=n, min_length=n, sampling_topk=1,  # noqa: E731
                                             include_prompt_in_result=False)
    ttft = _timed(lambda: run(1))
    results = run(new_tokens)
    best = min(_timed(lambda: run(new_tokens)) for _ in range(repeats))
    return ttft, len(prompts) * new_tokens / best, [r.sequences_ids[0] for r in results]


def bench_llama_cpp(directory, prompts, new_tokens, outtype, repeats):
    import llama_peer

    threads = len(os.sched_getaffinity(0))
    gguf = llama_peer.convert(Path(directory), outtype)
    runs = [llama_peer.batched_bench(gguf, len(prompts[0]), new_tokens, [len(prompts)], threads)[len(prompts)]
            for _ in range(repeats)]
    prefill, speed = min(prefill for prefill, _ in runs), max(speed for _, speed in runs)
    with llama_peer.LlamaServer(gguf, slots=1, slot_context=len(prompts[0]) + new_tokens, threads=threads) as server:
        tokens = [server.greedy_tokens(prompt, new_tokens) for prompt in prompts]
    return prefill, speed, tokens


def bench_torch(directory, prompts, new_tokens, repeats, dtype, compiled=False):
    """transformers' `generate`, eager; or with `compiled`, gpt-fast's recipe: a static KV cache and the
    forward under `torch.compile(mode="reduce-overhead")` (CUDA graphs replay a step with one launch; on a
    CPU, plain `torch.compile`). (first token s, tokens/s, greedy tokens of the timed call)."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).to(device).eval()
    if compiled:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead" if device == "cuda" else None)
    ids = torch.as_tensor(np.asarray(prompts), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=50256)
    out = {}
    with torch.inference_mode():
        ttft = _timed(lambda: model.generate(ids, max_new_tokens=1, **kwargs))
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)  # every shape compiled

        def run():
            out["ids"] = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)

        best = min(_timed(run) for _ in range(repeats))
    return ttft, len(prompts) * new_tokens / best, out["ids"][:, ids.shape[1]:].tolist()


# --shape: (transformers' config class, model class, the shape, what --smoke changes of it).
SHAPES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, dict(n_layer=2, n_embd=64, n_head=2)),
    "smollm2-135m": ("LlamaConfig", "LlamaForCausalLM",  # HuggingFaceTB/SmolLM2-135M's, GPT-2's vocabulary
                     dict(vocab_size=50257, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=50256,
                          eos_token_id=50256),
                     dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2)),
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM",  # meta-llama/Llama-3.2-1B's, GPT-2's vocabulary
                 dict(vocab_size=50257, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256),
                 dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # google/gemma-3-270m's, its vocabulary's size
                    dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                         sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=50256, eos_token_id=50256, pad_token_id=0),
                    dict(vocab_size=50257, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16)),
}


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
    parser.add_argument("--torch-compile", action="store_true",
                        help="also transformers with a static cache and torch.compile(mode='reduce-overhead')")
    parser.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "int4", "bf16"])
    parser.add_argument("--variants", nargs="+", default=["baseline"],
                        help=f"ours with these levers (joined by +; all): {', '.join(decode_levers().known)}")
    parser.add_argument("--ctranslate2", action="store_true", help="also CTranslate2 float32 and int8")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp (built on first use)")
    parser.add_argument("--llama-cpp-types", nargs="+", default=["f32", "q8_0"],
                        help="llama.cpp's weight types with --llama-cpp (f32, q8_0, Q4_K_M, Q4_0)")
    parser.add_argument("--rounds", type=int, default=1, help="run each batch's comparison this many times in turn")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model, short prompts: the code path")
    parser.add_argument("--shape", default="gpt2", choices=sorted(SHAPES), help="the model's architecture and size")
    args = parser.parse_args()
    decode_levers().check(args.variants)
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.repeats = 8, 8, 1

    import torch
    import transformers

    torch.manual_seed(0)
    config_class, model_class, shape, smoke = SHAPES[args.shape]
    fields = {**shape, **(smoke if args.smoke else {})}
    reference = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    print(f"# {cpu_name()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), {time.strftime('%Y-%m-%d')}")
    print("| batch | impl | first token (s, compile incl.) | tokens/s | vs torch | MB a step | MBU "
          "| greedy tokens = ours float32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(Path(tmp))
        del reference
        if args.ctranslate2 or args.llama_cpp:
            write_gpt2_vocab(Path(tmp), fields.get("vocab_size", 50257))
        ratios = {}  # (batch, ours, peer) -> [ratio per round]
        for batch in [batch for batch in args.batches for _ in range(args.rounds)]:
            prompts = np.random.default_rng(batch).integers(0, 50256, (batch, args.prompt_tokens)).tolist()
            theirs = None if args.skip_torch else bench_torch(tmp, prompts, args.new_tokens, args.repeats, args.dtype)[:2]
            rows, reference_tokens, ran_with = [], None, {}
            for quantize in args.quantize:
                for variant in args.variants:
                    row = ours_in_a_process(variant, tmp, prompts, args.new_tokens, args.dtype, args.repeats, quantize)
                    if reference_tokens is None and quantize == "none":
                        reference_tokens = row["tokens"]
                    suffix = "" if variant == "baseline" else f", {variant}"
                    name = f"gpt (jax, {args.dtype}, weights {quantize}{suffix})"
                    rows.append((name, row["ttft"], row["speed"], row["tokens"], row["step_bytes"], mbu(row, batch)))
                    ran_with[name] = {"variant": variant, **row["ran_with"]}
            if args.ctranslate2:
                for compute_type in ("float32", "int8"):
                    rows.append((f"CTranslate2 ({compute_type})",
                                 *bench_ctranslate2(tmp, prompts, args.new_tokens, args.repeats, compute_type),
                                 None, None))
            if args.llama_cpp:
                for outtype in args.llama_cpp_types:
                    import llama_peer

                    repacked = llama_peer.repacks(llama_peer.convert(Path(tmp), outtype))
                    rows.append((f"llama.cpp ({outtype}{'' if repacked else ', --no-repack'})",
                                 *bench_llama_cpp(tmp, prompts, args.new_tokens, outtype, args.repeats), None, None))
            if args.torch_compile:
                rows.append((f"transformers (torch.compile, static cache, {args.dtype})",
                             *bench_torch(tmp, prompts, args.new_tokens, args.repeats, args.dtype, compiled=True),
                             None, None))
            if theirs:
                rows.append((f"transformers (torch, {args.dtype})", *theirs, None, None, None))
            for name, ttft, speed, tokens, step_bytes, utilization in rows:
                ratio = f"{speed / theirs[1]:.2f}x" if theirs else "-"
                same = ("-" if tokens is None or reference_tokens is None else
                        f"{sum(a == b for a, b in zip(tokens, reference_tokens))}/{len(tokens)} rows")
                megabytes = "-" if step_bytes is None else f"{step_bytes / 1e6:.1f}"
                shown_mbu = "-" if utilization is None else f"{utilization:.1%}"
                print(f"| {batch} | {name} | {ttft:.2f} | {speed:.1f} | {ratio} | {megabytes} | {shown_mbu} | {same} |",
                      flush=True)
                results.append({"batch": batch, "impl": name, "first_token_s": ttft, "tokens_per_s": speed,
                                "step_bytes": step_bytes, "mbu": utilization, "same_greedy_tokens": same,
                                "ran_with": ran_with.get(name)})
            speeds = {name: speed for name, _, speed, *_ in rows}
            for ours, peer in PAIRS:
                if ours in speeds and peer in speeds:
                    ratios.setdefault((batch, ours, peer), []).append(speeds[ours] / speeds[peer])
    if args.rounds > 1:
        print("\n| batch | ours | peer | ratio per round | median |\n| --- | --- | --- | --- | --- |")
        for (batch, ours, peer), values in ratios.items():
            print(f"| {batch} | {ours} | {peer} | {', '.join(f'{v:.2f}x' for v in values)} | {np.median(values):.2f}x |")
    print(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
