"""`POST /v1/chat/completions` through the official `openai` client, against a tiny Llama-shaped model whose
tokenizer carries a chat template: greedy replies, plain and streamed, equal transformers' `generate` on
`apply_chat_template`'s ids token for token, and end at the model's end of turn (generation_config.json);
bad fields are 400s naming them; a model without a template says so."""


import httpx
import numpy as np
import openai
import pytest

from gpt.loading import end_of_turn_of, load, tokenizer_of

from chat_templates import CONVERSATION, STEPS, greedy, make_chat_model
from serving import Server, decisive_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, prose_text):
    return make_chat_model(tmp_path_factory.mktemp("chat-model"), prose_text[:100_000])


@pytest.fixture(scope="module")
def server(chat_model):
    _, directory, _, _, _ = chat_model
    server = Server(load(str(directory)), tokenizer=tokenizer_of(str(directory)),
                    end_of_turn=end_of_turn_of(str(directory)), slots=2, max_queue=8, cache_length=128)
    yield server
    server.stop()


def test_a_greedy_reply_equals_transformers_and_ends_at_the_end_of_turn(server, chat_model):
    model, directory, ids, reply, end = chat_model
    assert end_of_turn_of(str(directory)) == (end,)
    theirs = greedy(model, ids, STEPS, eos=[end])
    assert theirs == reply + [end]  # transformers stops at the same token
    tokenizer = tokenizer_of(str(directory))
    answer = server.client.chat.completions.create(model="tiny", messages=CONVERSATION, temperature=0,
                                                   max_tokens=STEPS, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert [bytes(t.bytes) for t in choice.logprobs.content] == [tokenizer.token_bytes(t) for t in reply]
    assert choice.message.content == tokenizer.decode(reply)
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
               for t in choice.logprobs.content)  # greedy: each token the most likely
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(reply)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")

    chunks = list(server.client.chat.completions.create(model="tiny", messages=CONVERSATION, temperature=0,
                                                        max_completion_tokens=STEPS, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reply)


def test_a_reply_without_a_bound_runs_to_the_context_or_the_end_of_turn(server, chat_model):
    _, _, ids, reply, _ = chat_model
    answer = server.client.chat.completions.create(model="tiny", messages=CONVERSATION, temperature=0)
    assert answer.usage.completion_tokens == len(reply) and answer.choices[0].finish_reason == "stop"
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    assert server.client.chat.completions.create(model="tiny", messages=parts, temperature=0, max_tokens=STEPS
                                                 ).choices[0].message.content == answer.choices[0].message.content


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", r"messages\[0\].role must be one of system"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", r"messages\[0\].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "list of text parts"),
    ({"messages": CONVERSATION, "max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1, got 0"),
    ({"messages": CONVERSATION, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"messages": CONVERSATION, "logprobs": True, "top_logprobs": 9}, "top_logprobs", r"in \[0, 5\], got 9"),
    ({"messages": CONVERSATION, "logprobs": 1}, "logprobs", "logprobs must be true or false"),
    ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools", "tools is not supported"),
    ({"messages": CONVERSATION, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs", "may not set"),
    ({"messages": CONVERSATION, "max_tokens": 500}, "max_tokens", "beyond the context of 128 tokens"),
    ({"messages": CONVERSATION, "n": 99}, "n", r"n must be in \[1, 8\]"),
])
def test_bad_chat_requests_get_400_naming_the_field(server, body, param, message):
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert __import__("re").search(message, error["message"]), error["message"]


def test_a_model_without_a_chat_template_says_so():
    server = Server(decisive_model(), warmup=False, slots=1, max_queue=2, cache_length=32)
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            server.client.chat.completions.create(model="tiny", messages=CONVERSATION)
        assert np.isfinite(server.client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.total_tokens)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_chat_reply_with_a_draft_equals_one_without(server, chat_model):
    _, directory, _, reply, _ = chat_model
    drafted = Server(load(str(directory)), tokenizer=tokenizer_of(str(directory)), warmup=False,
                     end_of_turn=end_of_turn_of(str(directory)), slots=2, max_queue=8, cache_length=128, draft="ngram")
    try:
        ask = lambda s: s.client.chat.completions.create(model="tiny", messages=CONVERSATION, temperature=0,  # noqa: E731
                                                         max_tokens=STEPS, logprobs=True)
        with_draft, without = ask(drafted), ask(server)
        assert with_draft.choices[0].message.content == without.choices[0].message.content
        assert with_draft.usage.completion_tokens == len(reply)
        assert drafted.engine.draft_policy.tokens_drafted > 0  # the draft guessed, and was verified
    finally:
        drafted.stop()


@pytest.mark.slow
def test_a_conversations_next_turn_reuses_its_history_from_the_prefix_cache(server, chat_model):
    _, directory, _, reply, _ = chat_model
    cached = Server(load(str(directory)), tokenizer=tokenizer_of(str(directory)),
                    end_of_turn=end_of_turn_of(str(directory)), slots=2, max_queue=8, cache_length=128,
                    prefix_cache_tokens=1024)
    try:
        messages = list(CONVERSATION)
        for turn in range(2):
            answers = [s.client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                        max_tokens=STEPS) for s in (server, cached)]
            assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
            messages += [{"role": "assistant", "content": answers[0].choices[0].message.content},
                         {"role": "user", "content": "And a tuple?"}]
        assert cached.engine.prompt_tokens_reused > 0 and server.engine.prompt_tokens_reused == 0
        assert "gpt_prompt_tokens_reused" in httpx.get(cached.url + "/metrics").text
    finally:
        cached.stop()


@pytest.mark.slow
def test_a_slow_chat_template_never_holds_up_the_other_clients(chat_model, tmp_path):
    """A template renders on a worker thread whatever the body's size: one that takes a second and more (under the
    deadline) leaves /health answering at once."""
    import json
    import shutil
    import threading
    import time

    _, directory, _, _, _ = chat_model
    slow = shutil.copytree(directory, tmp_path / "slow")
    config = json.loads((slow / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}" + \
        config["chat_template"]
    (slow / "tokenizer_config.json").write_text(json.dumps(config))
    server = Server(load(str(slow)), tokenizer=tokenizer_of(str(slow)), end_of_turn=end_of_turn_of(str(slow)),
                    slots=1, max_queue=2, cache_length=128)
    try:
        started = time.monotonic()
        chat = threading.Thread(target=lambda: server.client.chat.completions.create(
            model="tiny", messages=CONVERSATION, max_tokens=1))
        chat.start()
        time.sleep(0.3)  # the template is rendering
        asked = time.monotonic()
        assert httpx.get(server.url + "/health").status_code == 200
        answered = time.monotonic()
        chat.join()
        assert time.monotonic() - started > 1.5 and answered - asked < 0.5, (time.monotonic() - started,
                                                                             answered - asked)
    finally:
        server.stop()
