"""lm-evaluation-harness as the real client: `local-completions` against the server gives, task by task and
item by item, the scores lm-eval's own `hf` backend (transformers) gives on the same weights."""

import json
import textwrap

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt.model import gpt2  # noqa: E402

from hf_reference import random_hf_gpt2  # noqa: E402
from serving import Server  # noqa: E402

CONTEXT = 128
ANIMALS = ["cat", "dog", "horse", "bird", "fish", "cow", "sheep", "goat"]


def tasks(directory) -> list[str]:
    """Three local JSONL tasks, one per output type lm-eval scores: multiple_choice (loglikelihood),
    loglikelihood_rolling, generate_until."""
    rng = np.random.default_rng(0)
    with open(directory / "mc.jsonl", "w") as f:
        for i in range(12):
            choices = [str(c) for c in rng.choice(ANIMALS, 4, replace=False)]
            question = (f"Question {i}: on the farm by the river, where the old barn stands beside the mill and the "
                        f"fields run to the hills, the animal that says {'moo' if i % 2 else 'baa'} is a")
            f.write(json.dumps({"question": question,
                                "choices": [f" {c}" for c in choices], "answer": int(rng.integers(4))}) + "\n")
    with open(directory / "rolling.jsonl", "w") as f:
        for i in range(6):
            words = " ".join(str(w) for w in rng.choice(ANIMALS + ["the", "and", "runs", "eats", "."], 20 + 5 * i))
            f.write(json.dumps({"text": f"Document {i}. {words}"}) + "\n")
    with open(directory / "gen.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"Line {i}: the {ANIMALS[i]} and the", "answer": " dog"}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    configs = {
        "tiny_mc": """output_type: multiple_choice
            doc_to_text: "{{question}}"
            doc_to_choice: "{{choices}}"
            doc_to_target: "{{answer}}"
            metric_list: [{metric: acc}, {metric: acc_norm}]""",
        "tiny_rolling": """output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]""",
        "tiny_gen": """output_type: generate_until
            doc_to_text: "{{prompt}}"
            doc_to_target: "{{answer}}"
            generation_kwargs: {until: ["\\n"], max_gen_toks: 8, do_sample: false, temperature: 0}
            metric_list: [{metric: exact_match}]""",
    }
    for (name, body), data in zip(configs.items(), ("mc", "rolling", "gen")):
        files = f"dataset_kwargs: {{data_files: {{test: {directory / data}.jsonl}}}}\n"
        (directory / f"{name}.yaml").write_text(f"task: {name}\n{common}{files}{textwrap.dedent('            ' + body)}\n")
    return list(configs)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The same random GPT-2 weights as an exported HF directory (with its tokenizer) and behind the server."""
    root = tmp_path_factory.mktemp("lm_eval")
    _, directory = random_hf_gpt2(root, seed=5, weight_scale=3.0, n_layer=2, n_head=4, n_embd=32, n_positions=CONTEXT)
    exported = gpt2.save(gpt2.load(directory), root / "exported")
    names = tasks(root)
    # Not warmed up: the programs the evaluation runs compile at their first use, not every bucket's.
    server = Server(gpt2.load(exported), slots=4, max_queue=32, cache_length=CONTEXT, prefill_chunk=32,
                    prefix_cache_tokens=2048, warmup=False)
    manager = TaskManager(include_path=str(root))
    reference = evaluate(HFLM(pretrained=str(exported), device="cpu", batch_size=4, max_length=CONTEXT,
                              dtype="float32"), names, manager)
    yield server, names, manager, reference
    server.stop()


def evaluate(lm, names, manager) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, log_samples=True,
                                   bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def responses(results, task) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
@pytest.mark.parametrize("tokenized_requests", [True, False])
def test_local_completions_scores_what_the_hf_backend_scores(setup, tokenized_requests):
    server, names, manager, reference = setup
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", max_length=CONTEXT,
                             tokenized_requests=tokenized_requests, num_concurrent=4, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # the default `auto` found /tokenizer_info and /tokenize
    reused = server.engine.prompt_tokens_reused
    ours = evaluate(lm, names, manager)
    assert server.engine.prompt_tokens_reused > reused  # the choices shared their contexts' prefills

    for ours_mc, theirs_mc in zip(responses(ours, "tiny_mc"), responses(reference, "tiny_mc")):
        np.testing.assert_allclose([ll for ll, _ in ours_mc], [ll for ll, _ in theirs_mc], rtol=1e-4, atol=1e-4)
        assert [greedy for _, greedy in ours_mc] == [greedy for _, greedy in theirs_mc]
    np.testing.assert_allclose(responses(ours, "tiny_rolling"), responses(reference, "tiny_rolling"), rtol=1e-4)
    assert responses(ours, "tiny_gen") == responses(reference, "tiny_gen")
    for task, metrics in reference["results"].items():
        for metric, value in metrics.items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)

