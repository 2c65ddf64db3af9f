"""Prompt scoring through the server (`echo` with logprobs, `max_tokens: 0`) against transformers, and the
tokenizer endpoints against tiktoken."""

import concurrent.futures

import httpx
import numpy as np
import pytest
import tiktoken
import torch

from gpt.generate import generate_text
from gpt.inference.sampling import GREEDY
from gpt.model import gpt2

from hf_reference import hf_logits, random_hf_gpt2
from serving import Server

EOT = 50256
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods",
    [EOT, 464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, EOT, 198, 40, 1101, 257, 3797, 0],
    "Short",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' GPT-2 with random weights (scaled, so that the logprobs spread) and the same weights here."""
    hf, directory = random_hf_gpt2(tmp_path_factory.mktemp("hf"), seed=3, weight_scale=3.0, n_layer=2, n_head=4,
                                   n_embd=32, n_positions=128)
    return hf, gpt2.load(directory)


@pytest.fixture(scope="module", params=[256, pytest.param(16, marks=pytest.mark.slow)], ids=["whole-prefill", "chunked-prefill"])
def server(request, reference):
    server = Server(reference[1], slots=4, max_queue=16, cache_length=128, prefill_chunk=request.param)
    yield server
    server.stop()


def ids_of(prompt) -> list[int]:
    return tiktoken.get_encoding("gpt2").encode(prompt, allowed_special="all") if isinstance(prompt, str) else prompt


def hf_log_softmax(hf, ids) -> np.ndarray:
    return torch.log_softmax(torch.as_tensor(hf_logits(hf, [ids])[0]), -1).numpy()


def test_echo_scores_the_prompt_as_transformers_does(server, reference):
    """echo + logprobs: the prompt's tokens, each logprob (None for the first) and its top 2 as transformers'
    log-softmax gives them, then the generated token; with max_tokens 0 the prompt alone. Requests that
    generate run beside the scoring ones and give what they give alone."""
    hf, model = reference
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        beside = [pool.submit(server.client.completions.create, model="tiny", prompt=p, max_tokens=20,
                              temperature=0) for p in ("Beside it", "Another one beside")]
        scored = {(i, max_tokens): pool.submit(server.client.completions.create, model="tiny", prompt=prompt,
                                               max_tokens=max_tokens, temperature=0, echo=True, logprobs=2)
                  for i, prompt in enumerate(PROMPTS) for max_tokens in (0, 1)}
        for future, prompt in zip(beside, ("Beside it", "Another one beside")):
            assert future.result().choices[0].text == generate_text(model, [prompt], 20, sampling=GREEDY,
                                                                    stop_tokens=[EOT])[0]
    decode = tiktoken.get_encoding("gpt2").decode
    for (i, max_tokens), future in scored.items():
        choice = future.result().choices[0]
        ids = ids_of(PROMPTS[i])
        want = hf_log_softmax(hf, ids)
        logprobs = choice.logprobs
        assert logprobs.tokens[: len(ids)] == [decode([t]) for t in ids]
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        got = np.asarray(logprobs.token_logprobs[1: len(ids)])
        np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], rtol=1e-4, atol=1e-5)
        for p in range(1, len(ids)):
            top = np.argsort(want[p - 1])[::-1][:2]
            assert list(logprobs.top_logprobs[p]) == [decode([t]) for t in top]
            np.testing.assert_allclose(list(logprobs.top_logprobs[p].values()), want[p - 1][top], rtol=1e-4, atol=1e-5)
        prompt_text = PROMPTS[i] if isinstance(PROMPTS[i], str) else decode(ids)
        assert choice.text.startswith(prompt_text)
        assert logprobs.text_offset == np.cumsum([0] + [len(t) for t in logprobs.tokens])[:-1].tolist()
        if max_tokens == 1:  # the generated token: transformers' greedy choice after the whole prompt
            assert logprobs.token_logprobs[-1] == pytest.approx(float(want[-1].max()), rel=1e-4, abs=1e-5)
            assert logprobs.tokens[-1] == decode([int(want[-1].argmax())])
        else:
            assert choice.text == prompt_text and choice.finish_reason == "length"


def test_echo_streams_what_it_answers_whole(server):
    whole = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             echo=True, logprobs=1)
    chunks = list(server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                   echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].text.startswith(PROMPTS[0])
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    plain = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text == whole.choices[0].text and plain.choices[0].logprobs is None


@pytest.mark.slow
def test_a_stop_token_is_reported_in_the_logprobs_and_not_in_the_text(tmp_path):
    """A model that always predicts <|endoftext|>: an echo request with max_tokens 1 generates nothing (the
    stop token ends it), and its logprobs still end with that token, as OpenAI and vLLM report it, so that
    lm-evaluation-harness, which drops the last entry as the generated one, keeps every prompt token."""
    hf, directory = random_hf_gpt2(tmp_path, seed=4, n_layer=1, n_head=2, n_embd=16, n_positions=64)
    model = gpt2.load(directory)
    model.wte[EOT] *= 10.0  # the longest embedding row ...
    model.lnf_scale[...] = 0.0  # ... is every position's output
    model.lnf_bias[...] = model.wte[EOT]
    server = Server(model, slots=2, max_queue=4, cache_length=64)
    try:
        reply = server.client.completions.create(model="tiny", prompt="Hello world", max_tokens=1, temperature=0,
                                                 echo=True, logprobs=1)
        choice = reply.choices[0]
        assert choice.text == "Hello world" and choice.finish_reason == "stop"
        assert choice.logprobs.tokens == ["Hello", " world", "<|endoftext|>"]
        assert choice.logprobs.text_offset == [0, 5, 11]
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(list(choice.logprobs.top_logprobs[-1].values())[0])
        assert reply.usage.completion_tokens == 0
    finally:
        server.stop()


def test_bad_scoring_requests_get_400_and_the_server_stays_up(server):
    post = lambda body: httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})  # noqa: E731
    for body, param, message in [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo: true"),
        ({"prompt": "x", "echo": "yes"}, "echo", "echo must be true or false"),
        ({"prompt": "x", "echo": True, "logprobs": 6}, "logprobs", r"logprobs must be an integer in [0, 5], got 6"),
        ({"prompt": " x" * 200, "echo": True, "max_tokens": 0}, "max_tokens", "beyond the context of 128 tokens"),
    ]:
        reply = post(body)
        assert reply.status_code == 400, body
        assert reply.json()["error"]["param"] == param and message in reply.json()["error"]["message"]
    assert post({"prompt": "x", "max_tokens": 2}).status_code == 200


def test_tokenizer_endpoints_answer_as_vllm_does(server):
    """/tokenizer_info, /tokenize and /detokenize (and under /v1) as lm-evaluation-harness's remote tokenizer
    reads them: `<|endoftext|>` is the special token, as in completions' prompts."""
    encoding = tiktoken.get_encoding("gpt2")
    text = "Hello<|endoftext|> wörld  \n\tend"
    for root in ("", "/v1"):
        info = httpx.get(server.url + root + "/tokenizer_info").json()
        assert info["eos_token"] == info["bos_token"] == "<|endoftext|>" and info["model_max_length"] == 128
        tokens = httpx.post(server.url + root + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert tokens["tokens"] == encoding.encode(text, allowed_special="all") and tokens["count"] == len(tokens["tokens"])
        assert EOT in tokens["tokens"]
        back = httpx.post(server.url + root + "/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert back["prompt"] == text
    # What /tokenize gives is what a completion's prompt scores: the same tokens, the special one included.
    echo = server.client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=0)
    assert len(echo.choices[0].logprobs.tokens) == len(encoding.encode(text, allowed_special="all"))
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"text": "x"}, "prompt"),
                              ("/detokenize", {"tokens": [1, 50257]}, "tokens"), ("/detokenize", {"tokens": "1"}, "tokens"),
                              ("/v1/tokenize", {"prompt": "x", "model": "other"}, "model"), ("/tokenize", [1], "prompt")]:
        reply = httpx.post(server.url + path, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (path, body, reply.text)
    reply = httpx.post(server.url + "/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
