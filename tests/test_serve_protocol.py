"""The completions parser alone (no model, no server): whatever bytes a client sends become the engine's
requests or an ApiError with a 4xx status, never another exception (which the server would answer 500)."""

import json
import random

import pytest

from gpt.serve import protocol
from gpt.serve.protocol import ApiError, Limits, parse_completion, parse_detokenize, parse_json, parse_tokenize

LIMITS = Limits(model_name="tiny", vocab_size=50257, cache_length=128, max_queue=16, max_stop_tokens=8, eot=50256)


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Hello", **fields}).encode()


def refused(raw: bytes, parse=parse_completion) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(raw, LIMITS)
    assert 400 <= caught.value.status < 500
    return caught.value


def test_a_good_body_becomes_requests():
    parsed = parse_completion(body(prompt=["One", [5, 6]], n=2, max_tokens=7, temperature=0, stop="\n", logprobs=2,
                                   echo=True, seed=3), LIMITS)
    assert [r.prompt for r in parsed.requests] == [[3198], [3198], [5, 6], [5, 6]]
    assert [r.stream for r in parsed.requests] == [0, 1, 0, 1] and parsed.requests[0].stop_strings == ("\n",)
    assert parsed.requests[0].stop_tokens == (50256,) and parsed.requests[0].prompt_logprobs
    assert parsed.prompt_texts[0] == "One" and parsed.logprobs == 2 and parsed.prompt_tokens == 3


@pytest.mark.parametrize("raw, param, message", [
    (b'{"model": "tiny", "prompt": "x", "ignored": 1' + b"7" * 5000 + b"}", None, "not valid JSON"),  # Python's reader
    (body(max_tokens=10**400), "max_tokens", "beyond the context"),
    (body(temperature=10**400), "temperature", "must be a finite number, got an integer of 401 digits"),
    (b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', "top_p", "top_p must be finite, got inf"),
    (b'{"model": "tiny", "prompt": "x", "min_p": NaN}', "min_p", "min_p must be finite, got nan"),
    (body(n=1e300), "n", r"n must be in \[1, 16\]"),
    (body(logprobs=float("inf")), "logprobs", "logprobs must be an integer, got inf"),
    (body(prompt=[[[[1]]]]), "prompt", "prompt must be a non-empty string"),
    (b'{"model": "tiny", "prompt": "x", "deep": ' + b"[" * 40 + b"]" * 40 + b"}",
     None, r"nests JSON arrays or objects too deeply \(at most 32 levels\)"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nests JSON arrays or objects too deeply"),
    (body(stop=["x" * 257]), "stop", "each at most 256 characters"),
    (body(stop=["a", "b", "c", "d", "e"]), "stop", "a list of at most 4"),
    (body(prompt="word " * 100_000), "prompt", r"prompt has 500000 characters; at most \d+ can fit the context of 128"),
    (body(prompt=[1] * 200), "max_tokens", "the prompt has 200 tokens; with max_tokens=16 that is 216, beyond"),
    (b"\xff\xfe not utf-8", None, "not valid JSON"),
    (body(model={"a": 1}), "model", "is not served here"),
])
def test_hostile_values_are_refused_naming_the_field(raw, param, message):
    error = refused(raw)
    assert error.status == 400 and error.param == param
    assert __import__("re").search(message, error.message), error.message


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("tokenized")
    monkeypatch.setattr(LIMITS.tokenizer, "encode", never)
    refused(body(prompt="x" * (LIMITS.max_prompt_chars + 1)))
    assert LIMITS.max_prompt_chars == 128 * protocol._longest_token_bytes(LIMITS.tokenizer)


def test_tokenizer_bodies_are_checked():
    assert parse_tokenize(b'{"prompt": "a b"}', LIMITS) == ("a b", True)
    assert parse_tokenize(b'{"prompt": "a b", "add_special_tokens": false}', LIMITS) == ("a b", False)
    assert refused(b'{"prompt": "x", "add_special_tokens": "no"}', parse_tokenize).param == "add_special_tokens"
    assert parse_detokenize(b'{"tokens": [1, 2]}', LIMITS) == [1, 2]
    assert refused(b'{"tokens": [1, 50257]}', parse_detokenize).param == "tokens"
    assert refused(b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", parse_tokenize).param is None
    assert refused(b'{"prompt": "x", "model": "other"}', parse_tokenize).param == "model"


HOSTILE = [None, True, -1, 0, 2**64, 10**400, -(10**400), 1e308, float("inf"), float("nan"), -0.0, 0.5, "", "x" * 300,
           "1", [], [None], [[]], [[[1]]], {}, {"a": [1]}, [1] * 300, ["a"] * 20, [50256], [-5], [[1, 2], "x"]]
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n", "stop",
          "seed", "stream", "logprobs", "echo", "stream_options", "best_of", "suffix", "logit_bias", "user"]


def test_any_value_in_any_field_is_parsed_or_refused_with_a_4xx():
    """Every hostile value in every field (and in pairs of fields), through Python's own JSON writer (which
    writes NaN and Infinity as Python's reader takes them): requests, or an ApiError; nothing else."""
    rng = random.Random(0)
    cases = [{field: value} for field in FIELDS for value in HOSTILE]
    cases += [{rng.choice(FIELDS): rng.choice(HOSTILE), rng.choice(FIELDS): rng.choice(HOSTILE)} for _ in range(300)]
    outcomes = set()
    for fields in cases:
        try:
            parse_completion(body(**fields), LIMITS)
            outcomes.add("parsed")
        except ApiError as error:
            assert 400 <= error.status < 500 and error.message
            json.dumps(error.json())  # the reply can be written
            outcomes.add("refused")
    assert outcomes == {"parsed", "refused"}


def test_depth_is_counted_without_recursion():
    assert parse_json(b"[" * 32 + b"]" * 32) == parse_json(b"[" * 32 + b"]" * 32)
    with pytest.raises(ApiError, match="too deeply"):
        parse_json(b"[" * 33 + b"]" * 33)
    assert parse_json(json.dumps({"a": [1] * 10_000, "b": {"c": [[1]]}}).encode())["b"] == {"c": [[1]]}


@pytest.mark.parametrize("seed", [-1, 2**32, 10**400])
def test_a_seed_the_sampler_would_alias_is_refused_naming_it(seed):
    """The sampler's key holds 32 bits: two seeds that differ past them would give the same text."""
    error = refused(body(seed=seed))
    assert error.param == "seed" and "seed must be in [0, 2**32)" in str(error), str(error)
    assert parse_completion(body(seed=2**32 - 1), LIMITS).requests[0].seed == 2**32 - 1
