"""lm-evaluation-harness against serve.py, beside lm-eval's own `hf` backend (transformers, in process), on the
same random GPT-2 124M weights and the same local tasks: wall time, requests/s and the scores.

    python bench/eval_bench.py                       # 200 items x 4 choices, 20 rolling documents
    python bench/eval_bench.py --items 50 --documents 5    # quicker

The tasks are made here from a text (--text, default ../shared/data/tinyshakespeare.txt when it exists, else
the Python documentation's topics), as JSONL with lm-eval task configs:
  multiple_choice      --items items: a passage of 40-120 words and four continuations of 8 words, the
                       true one and three from elsewhere in the text (4 loglikelihood requests each)
  rolling perplexity   --documents documents of 300-700 words (loglikelihood_rolling: one window each
                       under both backends, whose windows differ in length by two tokens)
Ours: serve.py in a process of its own (--slots slots, float32), lm-eval's `local-completions` with its
default tokenizer (the server's /tokenize), token-id requests, --concurrent requests at a time; once per
--prefix-cache-tokens (default 0, then 32768: scored prompts' blocks kept, so that the choices of an item
run their shared context once). The peer:
`hf` with --hf-batch-size, float32, on this process's threads. The server is warmed up before timing
(its compile is a cost paid once per start, not per evaluation); each task is timed on its own, --repeats
times on each side in turn, ours on a fresh server each time (the best wall time counts: on the 2-core
machine one run of either side has taken 40% longer than another). Prints a Markdown table for
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from machine import cpu_name
from serve_process import start_serve

ROOT = Path(__file__).resolve().parent.parent


def source_text(path: str | None) -> str:
    default = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    if path or default.exists():
        return Path(path or default).read_text()
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


def write_tasks(directory: Path, text: str, items: int, documents: int, seed: int = 0) -> dict[str, str]:
    """The two tasks' JSONL and YAML in `directory`; returns {task: output type}."""
    rng = np.random.default_rng(seed)
    words = text.split()

    def span(length: int) -> str:
        start = int(rng.integers(0, len(words) - length))
        return " ".join(words[start: start + length])

    with open(directory / "mc.jsonl", "w") as f:
        for _ in range(items):
            length = int(rng.integers(40, 121))
            start = int(rng.integers(0, len(words) - length - 8))
            context, true = " ".join(words[start: start + length]), " ".join(words[start + length: start + length + 8])
            choices = [true] + [span(8) for _ in range(3)]
            order = rng.permutation(4)
            f.write(json.dumps({"context": context, "choices": [" " + choices[i] for i in order],
                                "answer": int(np.argmin(order))}) + "\n")
    with open(directory / "rolling.jsonl", "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": span(int(rng.integers(300, 701)))}) + "\n")
    configs = {
        "bench_mc": ("multiple_choice", "mc", """
            doc_to_text: "{{context}}"
            doc_to_choice: "{{choices}}"
            doc_to_target: "{{answer}}"
            metric_list: [{metric: acc}, {metric: acc_norm}]"""),
        "bench_rolling": ("loglikelihood_rolling", "rolling", """
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]"""),
    }
    for name, (kind, data, body) in configs.items():
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ntest_split: test\noutput_type: {kind}\n"
            f"dataset_kwargs: {{data_files: {{test: {directory / data}.jsonl}}}}\n" + textwrap.dedent(body).strip() + "\n")
    return {name: kind for name, (kind, _, _) in configs.items()}


def evaluate(lm, task: str, manager) -> tuple[dict, float]:
    import lm_eval

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True,
                                      bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return results, time.perf_counter() - start


def loglikelihoods(results: dict, task: str) -> np.ndarray:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return np.asarray([[r[0] if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]] for s in samples],
                      np.float64)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--text", default=None)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each task on each side; the best counts")
    parser.add_argument("--prefix-cache-tokens", type=int, nargs="+", default=[0, 32768],
                        help="serve.py's --prefix_cache_tokens, a run of ours for each")
    args = parser.parse_args()

    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from gpt.tokenizer import hf_tokenizer_files

    print(f"# {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"lm_eval {__import__('lm_eval').__version__}, {time.strftime('%Y-%m-%d')}; {args.items} items x 4 choices, "
          f"{args.documents} rolling documents; serve.py --slots {args.slots}, {args.concurrent} concurrent requests; "
          f"hf batch size {args.hf_batch_size}; best of {args.repeats}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(tmp / "model")
        for name, content in hf_tokenizer_files(1024).items():
            (tmp / "model" / name).write_text(content, encoding="utf-8")
        kinds = write_tasks(tmp, source_text(args.text), args.items, args.documents)
        manager = TaskManager(include_path=str(tmp))

        runs = {task: {} for task in kinds}  # {task: {impl: (results, the best wall time)}}

        def keep(task, impl, run):
            if impl not in runs[task] or run[1] < runs[task][impl][1]:
                runs[task][impl] = run

        hf = HFLM(pretrained=str(tmp / "model"), device="cpu", batch_size=args.hf_batch_size, max_length=1024,
                  dtype="float32")
        for _ in range(args.repeats):  # the two sides in turn, so that the machine's drift falls on both
            for pool in args.prefix_cache_tokens:
                # A fresh server each time: its prefix pool holds nothing of an earlier run's prompts.
                process, url = start_serve(tmp / "model", "--slots", str(args.slots), "--max_queue", "256",
                                           "--model_name", "gpt2", "--prefix_cache_tokens", str(pool))
                try:
                    ours = LocalCompletionsAPI(base_url=url + "/completions", model="gpt2", max_length=1024,
                                               num_concurrent=args.concurrent, max_retries=1, timeout=600)
                    for task in kinds:
                        keep(task, f"ours, --prefix_cache_tokens {pool}", evaluate(ours, task, manager))
                finally:
                    process.terminate()
                    process.wait()
            for task in kinds:
                keep(task, "hf", evaluate(hf, task, manager))

    print("| task | requests | impl | wall (s) | requests/s | score | max abs loglikelihood difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task, kind in kinds.items():
        requests = loglikelihoods(runs[task]["hf"][0], task).size
        gap = max(np.abs(loglikelihoods(results, task) - loglikelihoods(runs[task]["hf"][0], task)).max()
                  for results, _ in runs[task].values())
        metric = "acc,none" if kind == "multiple_choice" else "bits_per_byte,none"
        for impl, (results, wall) in runs[task].items():
            name = f"{impl}: serve.py + local-completions" if impl != "hf" else "lm-eval hf backend (torch)"
            score = results["results"][task][metric]
            print(f"| {task} ({kind}) | {requests} | {name} | {wall:.1f} | {requests / wall:.1f} | "
                  f"{metric.split(',')[0]} {score:.4f} | {gap:.2e} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
