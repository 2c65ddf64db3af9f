"""The vendored tokenizer against tiktoken's own `gpt2` encoding."""

import threading

import pytest
import tiktoken

from gpt import tokenizer as tokenizer_module
from gpt.tokenizer import get_tokenizer

EDGE_CASES = [
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n",
    "héllo wörld — naïve café, ΑΒΓ, Привет, 日本語のテキスト, 한국어",
    "emoji 👩‍👩‍👧‍👦 🇺🇸 and combining e\u0301",
    "numbers 1234567890 3.14159 -42",
    "it's they're I'll we've he'd",
    "<|endoftext|> inside text",
    "a<|endoftext|>b<|endoftext|>",
    "\x00\x01 control chars \u200b zero-width",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def reference():
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as error:  # no TIKTOKEN_CACHE_DIR and no network
        pytest.skip(f"tiktoken.get_encoding('gpt2') is unavailable offline: {error}")


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_match_tiktoken(reference, text):
    tokenizer = get_tokenizer()
    assert tokenizer.encode(text) == reference.encode(text, disallowed_special=())
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_token_is_one_id_when_allowed(reference):
    tokenizer = get_tokenizer()
    text = "end<|endoftext|>start"
    assert tokenizer.encode(text, allow_special=True) == reference.encode(text, allowed_special="all")
    assert tokenizer.eot_id == 50256 in tokenizer.encode(text, allow_special=True)
    assert 50256 not in tokenizer.encode(text)


def test_a_megabyte_of_text_matches_tiktoken(reference, corpus_text):
    tokenizer = get_tokenizer()
    ids = tokenizer.encode(corpus_text)
    assert ids == reference.encode(corpus_text)
    assert tokenizer.decode(ids) == corpus_text


def test_batch_encode_equals_one_by_one():
    tokenizer = get_tokenizer()
    assert tokenizer.encode_batch(EDGE_CASES) == [tokenizer.encode(text) for text in EDGE_CASES]


def test_vocabulary_size():
    assert get_tokenizer().vocab_size == 50257


def test_many_threads_asking_at_once_build_one_tokenizer(monkeypatch):
    """The first requests of a server arrive together: one builds the tokenizer, the rest wait for it
    (each building its own held the GIL for a third of a second)."""
    built = []
    build = tokenizer_module.Tokenizer.__init__

    def counted(self):
        built.append(self)
        build(self)

    monkeypatch.setattr(tokenizer_module, "_shared", None)
    monkeypatch.setattr(tokenizer_module.Tokenizer, "__init__", counted)
    barrier, got = threading.Barrier(8), []
    threads = [threading.Thread(target=lambda: (barrier.wait(), got.append(get_tokenizer()))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and all(t is built[0] for t in got)
