"""A request's checks, with no model and nothing compiled: each field out of its bound is one ConfigError
that names it (the engine, `generate` and the server all check through them)."""

import numpy as np
import pytest

from gpt.errors import ConfigError
from gpt.inference.request import Request, check_prompts, check_request, is_int
from gpt.inference.sampling import Sampling

VOCAB, CONTEXT, MAX_STOPS = 256, 63, 8


@pytest.mark.parametrize("request_changes, message", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 256]), r"token id 256 outside the vocabulary \[0, 256\)"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=62), "that is 64, beyond the context of 63 tokens"),
    (dict(sampling=Sampling(temperature=-1.0)), "temperature must be >= 0"),
    (dict(sampling=dict(temperature=0)), "sampling must be a gpt.inference.sampling.Sampling"),
    (dict(stop_tokens=list(range(9))), "at most 8 are allowed"),
    (dict(stop_tokens="5"), "stop_tokens must be a token id or a list of them, got '5'"),
    (dict(stop_tokens=[True]), r"stop_tokens must be a token id or a list of them, got \[True\]"),
    (dict(stop_tokens=256), r"stop_tokens \[256\] must be ids in \[0, 256\)"),
    (dict(stop_strings=[1]), r"stop_strings must be a string or a list of strings, got \[1\]"),
    (dict(logprobs=6), r"logprobs must be an integer in \[0, 5\], got 6"),
    (dict(logprobs=True), r"logprobs must be an integer in \[0, 5\], got True"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(stream=1.5), "stream must be an integer, got 1.5"),
])

def test_a_bad_request_names_its_field(request_changes, message):
    with pytest.raises(ConfigError, match=message):
        check_request(Request(**{"prompt": [1, 2], "max_tokens": 5, **request_changes}), VOCAB, CONTEXT, MAX_STOPS)


def test_a_good_request_gives_its_stop_tokens():
    request = Request(np.array([1, 2]), np.int64(3), seed=np.uint32(7), stop_tokens=np.int64(5), prompt_logprobs=True)
    assert check_request(request, VOCAB, CONTEXT, MAX_STOPS) == (5,)
    assert check_request(Request([1], 0, prompt_logprobs=True), VOCAB, CONTEXT, MAX_STOPS) == ()  # scoring only


@pytest.mark.parametrize("prompts, max_new_tokens, message", [
    ([], 1, "prompts must be a non-empty list"),
    ("text", 1, "prompts must be a non-empty list"),
    ([[1], [2, 300]], 1, r"prompt 1 has token id 300 outside the vocabulary \[0, 256\)"),
    ([[1] * 60], 4, "prompt 0 has 60 tokens; with max_new_tokens=4 that is 64, beyond the model's context of 63"),
    ([[1]], 0, "max_new_tokens must be an integer >= 1, got 0"),
])
def test_bad_prompts_name_their_row(prompts, max_new_tokens, message):
    with pytest.raises(ConfigError, match=message):
        check_prompts(prompts, max_new_tokens, VOCAB, CONTEXT)


def test_prompts_as_an_array_are_rows_of_ids():
    assert check_prompts(np.array([[1, 2], [3, 4]]), 2, VOCAB, CONTEXT) == [[1, 2], [3, 4]]
    assert is_int(np.int8(1)) and not is_int(True) and not is_int(1.0)
