"""lm-evaluation-harness's `local-chat-completions` client with `apply_chat_template` against serve.py's
/v1/chat/completions: a generation task's replies equal those of lm-eval's own `hf` backend (transformers,
rendering the same chat template) on the same weights."""

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalChatCompletion  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt.loading import end_of_turn_of, load, tokenizer_of  # noqa: E402

from chat_templates import make_chat_model  # noqa: E402
from serving import Server  # noqa: E402

TASK = """task: tiny_chat
dataset_path: json
test_split: test
dataset_kwargs: {{data_files: {{test: {data}}}}}
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 10, do_sample: false, temperature: 0}}
metric_list: [{{metric: exact_match}}]
"""


@pytest.mark.slow
def test_local_chat_completions_replies_as_the_hf_backend_does(tmp_path, prose_text):
    _, directory, _, _, _ = make_chat_model(tmp_path, prose_text[:100_000])
    # lm-eval's hf backend ends a reply at the tokenizer's end of text and the task's `until` alone, not at
    # generation_config.json's ids: without that file, the server ends its replies at the same places.
    (directory / "generation_config.json").unlink()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(f'{{"prompt": "Question {i}: what does the {w} eat?", "answer": "grass"}}\n'
                            for i, w in enumerate(["cow", "sheep", "goat", "horse", "bird", "fish"])))
    (tmp_path / "tiny_chat.yaml").write_text(TASK.format(data=data))
    manager = TaskManager(include_path=str(tmp_path))

    def replies(lm) -> list:
        results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_chat"], task_manager=manager, log_samples=True,
                                          apply_chat_template=True, bootstrap_iters=0, random_seed=0,
                                          numpy_random_seed=0, torch_random_seed=0)
        samples = sorted(results["samples"]["tiny_chat"], key=lambda s: s["doc_id"])
        return [s["resps"] for s in samples]

    theirs = replies(HFLM(pretrained=str(directory), device="cpu", batch_size=1, dtype="float32"))
    server = Server(load(str(directory)), tokenizer=tokenizer_of(str(directory)),
                    end_of_turn=end_of_turn_of(str(directory)), slots=2, max_queue=8, cache_length=256, warmup=False)
    try:
        ours = replies(LocalChatCompletion(base_url=server.url + "/v1/chat/completions", model="tiny",
                                           num_concurrent=2, max_retries=1))
    finally:
        server.stop()
    assert len(ours) == 6 and ours == theirs
