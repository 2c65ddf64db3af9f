"""lm-evaluation-harness as the real client: `local-completions` against the server gives, task by task and
item by item, the scores lm-eval's own `hf` backend (transformers) gives on the same weights: a GPT-2's, a Llama's
with its own tokenizer.json, and a Gemma 3's (local and global layers) with a SentencePiece-style one (which the
client reads through the server's /tokenize)."""

import json
import textwrap

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt.model import gpt2, llama, pretrained  # noqa: E402
from gpt.tokenizer import get_tokenizer  # noqa: E402
from gpt.tokenizer_json import TokenizerJson  # noqa: E402

from hf_reference import (  # noqa: E402
    LLAMA_SHAPE,
    make_sentencepiece_tokenizer,
    make_tokenizer,
    random_hf_gpt2,
    random_hf_llama,
)
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


def exported_model(root, family: str, corpus_text: str):
    """Random weights of `family` exported by us as an HF directory with its tokenizer: (directory, the tokenizer)."""
    if family == "gpt2":
        _, directory = random_hf_gpt2(root, seed=5, weight_scale=3.0, n_layer=2, n_head=4, n_embd=32,
                                      n_positions=CONTEXT)
        return gpt2.save(gpt2.load(directory), root / "exported"), get_tokenizer()
    if family == "gemma3":  # transformers' Gemma tokenizer adds <pad> and <mask> to the file's 600: 602 rows
        _, directory = random_hf_llama(root, "gemma3", seed=5, vocab_size=602, max_position_embeddings=CONTEXT)
        tokenizer = TokenizerJson(make_sentencepiece_tokenizer(directory, corpus_text[:50_000], "gemma", 600))
    else:
        _, directory = random_hf_llama(root, "llama-untied", seed=5, max_position_embeddings=CONTEXT)
        tokenizer = TokenizerJson(make_tokenizer(directory, corpus_text[:50_000], bos=False,
                                                 vocab_size=LLAMA_SHAPE["vocab_size"]))
    return llama.save(llama.load(directory), root / "exported", tokenizer.files), tokenizer


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma3"])
def setup(tmp_path_factory, corpus_text, request):
    """The same random weights as an exported HF directory (with its tokenizer) and behind the server."""
    root = tmp_path_factory.mktemp("lm_eval")
    exported, tokenizer = exported_model(root, request.param, corpus_text)
    names = tasks(root)
    # Not warmed up: the programs the evaluation runs compile at their first use, not every bucket's.
    server = Server(pretrained.Checkpoint.at(str(exported)).load(), slots=4, max_queue=32, cache_length=CONTEXT,
                    prefill_chunk=32, prefix_cache_tokens=2048, warmup=False, tokenizer=tokenizer)
    manager = TaskManager(include_path=str(root))
    # The same windows: lm-eval's API client keeps one token of its max_length for the one it asks to generate, so
    # sends at most max_length - 1, and cuts a long document into windows one shorter (one kept for the context);
    # the hf backend scores its max_length + 1 tokens and cuts windows of its max_length.
    # lm-eval's remote tokenizer asks /tokenize for no special tokens; its hf backend puts a Gemma's BOS first unless
    # told not to. Told, the two score the same ids.
    hf = HFLM(pretrained=str(exported), device="cpu", batch_size=4, max_length=CONTEXT - 2, dtype="float32",
              add_bos_token=False)
    reference = evaluate(hf, names, manager)
    # The API client's prefix before a document is `bos_token_id or eos_token_id`, which reads a BOS of id 0 as
    # none; the hf backend's is the BOS whatever its id. Given the hf backend's, the two score the same text.
    yield server, names, manager, reference, hf.prefix_token_id, request.param
    server.stop()


def evaluate(lm, names, manager) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, log_samples=True,
                                   bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def responses(results, task) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
@pytest.mark.parametrize("tokenized_requests", [True, False])
def test_local_completions_scores_what_the_hf_backend_scores(setup, tokenized_requests):
    server, names, manager, reference, prefix_token, family = setup
    if family == "gemma3" and not tokenized_requests:
        pytest.skip("text requests: the server puts a Gemma's BOS before a text prompt (as vLLM does), so a window "
                    "of the whole context no longer fits it (refused) and other ids are scored than the hf backend's")
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", max_length=CONTEXT,
                             tokenized_requests=tokenized_requests, num_concurrent=4, max_retries=1,
                             custom_prefix_token_id=prefix_token)
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

