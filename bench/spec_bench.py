"""Speculative decoding's speed: gpt.generate with a prompt-lookup draft against the same call without one,
beside transformers' assisted generation (`prompt_lookup_num_tokens`, `assistant_model`) and llama.cpp's
`llama-lookup` and `llama-speculative` (a q8_0 draft, or the draft model's f32) on the same weights, all at
batch 1, greedy, in one run.

    python train.py                                  # the model this bench reads by default (out/)
    python bench/spec_bench.py                       # ours: no draft, then ngram and int8 drafts of K = 2, 4, 8
    python bench/spec_bench.py --transformers --llama-cpp
    python bench/spec_bench.py --init_from random-gpt2 --drafts int8 --draft_tokens 4   # GPT-2 124M shapes
    python train.py --out_dir draft --model.n_layer 2 --model.n_embd 64 --model.n_head 2   # a smaller GPT
    python bench/spec_bench.py --drafts model --draft_model draft --transformers   # it drafting for out/
    python bench/spec_bench.py --steps_per_call 1 --drafts ngram model --draft_model draft   # a server's calls

The text: held-out source files (the standard library's subpackage modules, which `python train.py`'s
default corpus, the top-level modules, does not hold), each shown its first --prompt tokens and continued
by --new_tokens more. For each way, tokens/s over all the files (each file timed on its own after a
warm-up run of it; the best of --repeats), its speed-up over the same engine without a draft, the share of
drafted tokens that stood, and whether its tokens equal ours without a draft. With --steps_per_call, ours
runs through one long-lived engine making calls of that many steps, as serve.py's does, each draft both at
a fixed K and with K chosen per call by the engine's policy (and how often it chose each K). Prints a
Markdown table for bench/RESULTS.md. With `--init_from random-gpt2`, random weights of GPT-2 124M's shapes:
their logits are near flat, so an int8 draft's acceptance there is a floor, not a target.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from gpt.generate import generate
from gpt.inference.decoder import Decoder
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import Sampling
from gpt.loading import load
from gpt.tokenizer import get_tokenizer

from machine import cpu_name


def held_out_prompts(count: int, prompt_tokens: int, new_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` tokens of `count` standard-library subpackage modules (spread over the
    sorted list) long enough to be continued by `new_tokens` of their own."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*/*.py") if "test" not in p.parts[-2] and "site-packages" not in p.parts)
    tokenizer, prompts = get_tokenizer(), []
    for path in files[:: max(1, len(files) // (count * 4))]:
        tokens = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(tokens) >= prompt_tokens + new_tokens:
            prompts.append(tokens[:prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def seed_of(prompt: list[int]) -> int:
    """A sampled prompt's seed, the same in every run and way."""
    return len(prompt) + prompt[-1]


def bench_ours(decoder, prompts, new_tokens, repeats, draft, draft_tokens, temperature=0.0):
    """(tokens/s, acceptance, tokens): each prompt alone through `gpt.generate` (greedy at temperature 0, else
    sampled, `seed_of` each prompt), one call a prompt at draft_tokens."""
    knobs = dict(sampling=Sampling(temperature=temperature), draft=draft, draft_tokens=draft_tokens)
    outputs, seconds = [], 0.0
    for prompt in prompts:
        run = functools.partial(generate, decoder, [prompt], new_tokens, seed=seed_of(prompt), **knobs)
        outputs.append(run()[0])  # compiles
        seconds += timed(run, repeats)
    drafted = accepted = 0
    if draft != "none":  # the same calls through an engine of generate's making, for its counts
        for prompt in prompts:
            engine = Engine(decoder, slots=1, cache_length=len(prompt) + new_tokens, steps_per_call=new_tokens,
                            draft=draft, draft_tokens=draft_tokens)
            engine.run([engine.submit(Request(prompt, new_tokens, knobs["sampling"], seed=seed_of(prompt)))])
            policy = engine.draft_policy
            drafted, accepted = drafted + policy.tokens_drafted, accepted + policy.drafts_accepted
    return len(prompts) * new_tokens / seconds, accepted / drafted if drafted else None, outputs


def bench_engine(decoder, prompts, new_tokens, repeats, draft, draft_tokens, steps_per_call, fixed, temperature):
    """(tokens/s, acceptance, tokens, the share of calls at each K): each prompt alone (greedy at temperature
    0, else sampled, `seed_of` each prompt), through one long-lived engine making calls of `steps_per_call`
    steps, as a server's does: its policy chooses each call's K up to draft_tokens
    (`gpt.inference.draft_policy`), or every call verifies draft_tokens when `fixed`. A first pass over the
    prompts compiles and measures; the timed passes follow."""
    engine = Engine(decoder, slots=1, cache_length=max(map(len, prompts)) + new_tokens, steps_per_call=steps_per_call,
                    max_queue=1, draft=draft, draft_tokens=draft_tokens)
    ks, policy = [], engine.draft_policy
    if policy is not None:
        def choose(width, slots, chosen=policy.choose):  # the policy's choice (or the fixed K), kept
            ks.append(draft_tokens if fixed else chosen(width, slots))
            return ks[-1]

        policy.choose = choose

    def run(prompt):
        completion = engine.submit(Request(prompt, new_tokens, Sampling(temperature=temperature), seed=seed_of(prompt)))
        engine.run([completion])
        return completion.tokens

    outputs = [run(prompt) for prompt in prompts]
    ks.clear()
    drafted, accepted = (policy.tokens_drafted, policy.drafts_accepted) if policy else (0, 0)
    seconds = sum(timed(functools.partial(run, prompt), repeats) for prompt in prompts)
    if policy is not None:
        drafted, accepted = policy.tokens_drafted - drafted, policy.drafts_accepted - accepted
    shares = {k: ks.count(k) / len(ks) for k in sorted(set(ks))}
    return len(prompts) * new_tokens / seconds, accepted / drafted if drafted else None, outputs, shares


def bench_transformers(hf_dir, prompts, new_tokens, repeats, lookup=None, assistant_dir=None):
    """transformers' generate, greedy, float32 on the CPU; with `lookup` K, prompt lookup of K tokens; with
    `assistant_dir` (and K), assisted generation with that model drafting K tokens a step."""
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    extra = dict(prompt_lookup_num_tokens=lookup) if lookup and assistant_dir is None else {}
    if assistant_dir is not None:
        assistant = transformers.GPT2LMHeadModel.from_pretrained(assistant_dir).eval()
        assistant.generation_config.num_assistant_tokens = lookup
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        extra = dict(assistant_model=assistant)
    outputs, seconds = [], 0.0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])

            def run():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=50256, **extra)
            outputs.append(run()[0, len(prompt):].tolist())
            seconds += timed(run, repeats)
    return len(prompts) * new_tokens / seconds, None, outputs


def bench_llama_speculation(hf_dir, prompts, new_tokens, draft, draft_tokens, draft_hf_dir=None):
    """llama.cpp's own speculation on its f32 GGUF of the same weights: `llama-lookup` (prompt lookup) for
    draft "ngram"; `llama-speculative` with its q8_0 GGUF as the draft for "int8", and with the f32 GGUF of
    `draft_hf_dir` (the smaller GPT) for "model". (tokens/s over its prompt's and its decode's times as it
    reports them, acceptance). Its prompts go as text (its GPT-2 tokenizer makes the same tokens)."""
    from llama_peer import build, convert

    gguf = convert(Path(hf_dir), "f32")
    binary, extra = build()[0] / "bin" / "llama-lookup", []
    if draft == "int8":
        # --no-repack: with its weights repacked for AMX, llama.cpp's q8_0 matmul crashes (SIGSEGV in
        # ggml_backend_amx_mul_mat) on the Intel Xeon with AMX; unpacked, they run through its AVX-512 kernels.
        binary, extra = build()[0] / "bin" / "llama-speculative", ["-md", str(convert(Path(hf_dir), "q8_0")),
                                                                   "--no-repack"]
    elif draft == "model":
        binary, extra = build()[0] / "bin" / "llama-speculative", ["-md", str(convert(Path(draft_hf_dir), "f32"))]
    tokenizer, tokens, seconds, drafted, accepted = get_tokenizer(), 0, 0.0, 0, 0
    for prompt in prompts:
        out = subprocess.run([str(binary), "-m", str(gguf), *extra, "-p", tokenizer.decode(prompt),
                              "-n", str(new_tokens), "--spec-draft-n-max", str(draft_tokens), "--temp", "0", "-t", "2",
                              "-c", "512", "--ignore-eos"], capture_output=True, text=True, check=True)
        log = out.stdout + out.stderr
        encoded = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        tokens += int(decoded.group(1))
        seconds += float(encoded.group(1)) + float(decoded.group(2))
        drafted += int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1))
        accepted += int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1))
    return tokens / seconds, accepted / drafted if drafted else None


def bench_llama_plain(hf_dir, prompt_tokens, new_tokens):
    """llama.cpp without a draft: llama-batched-bench at batch 1 on the same GGUF and lengths (tokens/s
    over its prefill and decode together)."""
    from llama_peer import batched_bench, convert

    return batched_bench(convert(Path(hf_dir), "f32"), prompt_tokens, new_tokens, [1], threads=2)[1][1]


def random_gpt2(dtype: str = "float32"):
    """A GPT of GPT-2 124M's shapes with transformers' random initialization (seed 0), its weights in `dtype`."""
    import torch
    import transformers

    from gpt.model import gpt2

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(directory)
        return gpt2.load(directory, dtype=dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_from", default="out", help="the model: a training out_dir or an HF directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the weights' dtype (bfloat16 on a GPU; the peers stay float32)")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="tokens of each file shown")
    parser.add_argument("--new_tokens", type=int, default=96)
    parser.add_argument("--drafts", nargs="+", default=["ngram", "int8"], choices=["ngram", "int8", "model"])
    parser.add_argument("--draft_model", default=None, help="--drafts model's GPT: a training out_dir or HF directory")
    parser.add_argument("--draft_tokens", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample ours at this temperature (seeded) instead of greedy (no peer: they run greedy)")
    parser.add_argument("--steps_per_call", type=int, default=None,
                        help="through one engine making calls of this many steps (as serve.py's), each draft K "
                             "fixed and up to K chosen per call; default: gpt.generate, one call a prompt")
    parser.add_argument("--transformers", action="store_true", help="also transformers' prompt lookup")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also llama.cpp's llama-lookup and llama-speculative")
    args = parser.parse_args()
    if args.temperature and (args.transformers or args.llama_cpp):
        parser.error("--temperature samples ours only: the peers' rows run greedy")

    model = random_gpt2(args.dtype) if args.init_from == "random-gpt2" else load(args.init_from, args.dtype)
    decoder = Decoder.of(model)
    drafter_model = None if args.draft_model is None else load(args.draft_model, args.dtype)
    drafter = None if drafter_model is None else Decoder.of(drafter_model)
    prompts = held_out_prompts(args.files, args.prompt, args.new_tokens)
    print(f"## {cpu_name()}: {len(prompts)} held-out files, {args.prompt} tokens shown, {args.new_tokens} new, "
          f"batch 1, {f'temperature {args.temperature}' if args.temperature else 'greedy'} "
          f"({time.strftime('%Y-%m-%d')})\n")
    if args.steps_per_call is None:  # generate's way
        ours = functools.partial(bench_ours, decoder, prompts, args.new_tokens, args.repeats,
                                 temperature=args.temperature)
        rows = [("gpt, no draft", *ours("none", 1))]
        for draft in args.drafts:
            for k in args.draft_tokens:
                rows.append((f"gpt, {draft} draft K={k}", *ours(drafter if draft == "model" else draft, k)))
    else:  # a server's way: calls of a few steps, each at the K its policy chooses (or, fixed, the largest)
        engine_way = functools.partial(bench_engine, decoder, prompts, args.new_tokens, args.repeats,
                                       steps_per_call=args.steps_per_call, temperature=args.temperature)
        rows = [(f"gpt engine, {args.steps_per_call} step(s) a call, no draft", *engine_way("none", 1, fixed=True)[:3])]
        for draft in args.drafts:
            for k in args.draft_tokens:
                for fixed in (True, False):
                    speed, stood, outputs, shares = engine_way(drafter if draft == "model" else draft, k, fixed=fixed)
                    calls = "" if fixed else " (calls at " + ", ".join(
                        f"K={j}: {share:.0%}" for j, share in shares.items()) + ")"
                    rows.append((f"gpt engine, {draft} draft, K={k} {'fixed' if fixed else 'chosen'}{calls}",
                                 speed, stood, outputs))
    hf_dir = draft_hf_dir = None  # the model, and the draft model, as HF directories for the peers
    if args.transformers or args.llama_cpp:
        from gpt.model import gpt2

        hf_dir = tempfile.mkdtemp(prefix="spec-bench-hf-")
        gpt2.save(model, hf_dir)
        if "model" in args.drafts:
            draft_hf_dir = tempfile.mkdtemp(prefix="spec-bench-draft-")
            gpt2.save(drafter_model, draft_hf_dir)
    peer_rows = []
    if args.transformers:
        peer_rows.append(("transformers, no draft", *bench_transformers(hf_dir, prompts, args.new_tokens,
                                                                       args.repeats, None)))
        for k in args.draft_tokens if "ngram" in args.drafts else ():
            peer_rows.append((f"transformers, prompt_lookup_num_tokens={k}",
                              *bench_transformers(hf_dir, prompts, args.new_tokens, args.repeats, k)))
        if "model" in args.drafts:
            for k in args.draft_tokens:
                peer_rows.append((f"transformers, assistant_model, num_assistant_tokens={k}", *bench_transformers(
                    hf_dir, prompts, args.new_tokens, args.repeats, k, draft_hf_dir)))
    if args.llama_cpp:
        from sample_bench import write_gpt2_vocab

        for directory in filter(None, (hf_dir, draft_hf_dir)):
            write_gpt2_vocab(Path(directory))
        peer_rows.append(("llama.cpp f32, no draft (llama-batched-bench)",
                          bench_llama_plain(hf_dir, args.prompt, args.new_tokens), None, None))
        for draft in args.drafts:
            how = dict(ngram="llama-lookup", int8="llama-speculative, q8_0 draft",
                       model="llama-speculative, the draft model's f32")[draft]
            for k in args.draft_tokens:
                try:
                    measured = bench_llama_speculation(hf_dir, prompts, args.new_tokens, draft, k, draft_hf_dir)
                except subprocess.CalledProcessError as e:  # reported in the table, not hidden
                    print(f"llama.cpp {how} failed: exit status {e.returncode}")
                    measured = (float("nan"), None)
                peer_rows.append((f"llama.cpp f32, {how}, --spec-draft-n-max {k}", *measured, None))

    plain, reference = rows[0][1], rows[0][3]
    print("| way | tokens/s | vs gpt without a draft | drafted tokens that stood | tokens equal ours |")
    print("| --- | --- | --- | --- | --- |")
    for name, speed, acceptance, outputs in rows + peer_rows:
        same = "—" if outputs is None else f"{sum(a == b for a, b in zip(outputs, reference))}/{len(reference)}"
        stood = "—" if acceptance is None else f"{acceptance:.0%}"
        print(f"| {name} | {speed:,.0f} | {speed / plain:.2f}x | {stood} | {same} |")


if __name__ == "__main__":
    main()
