"""A model's own tokenizer.json (byte-level BPE, as Llama 3's, Qwen's and SmolLM2's) gives transformers'
`AutoTokenizer` ids, and its tokens' bytes are the text's."""

import json

import pytest

from gpt.errors import ConfigError
from gpt.tokenizer_json import TokenizerJson

from hf_reference import make_tokenizer

TEXTS = [
    "",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n",
    "héllo wörld — naïve café, ΑΒΓ, Привет, 日本語のテキスト, 한국어, שָׁלוֹם, مرحبا, देवनागरी",
    "emoji 👩‍👩‍👧‍👦 🇺🇸 and combining e\u0301, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ ∑",
    "it's they're I'll we've he'd 1234567890 3.14159",
    "\x00\x01 control chars \u200b zero-width",
]


@pytest.mark.parametrize("bos", [True, False], ids=["a BOS first (Llama 3)", "no BOS (Qwen, SmolLM2)"])
def test_ids_are_autotokenizers_and_bytes_are_the_texts(tmp_path, corpus_text, bos):
    import transformers

    directory = make_tokenizer(tmp_path / "tokenizer", corpus_text[:100_000], bos)
    ours, theirs = TokenizerJson(directory), transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*TEXTS, "\n".join(TEXTS), corpus_text[200_000:203_000]]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text[:40]
        body = ids[1:] if bos else ids
        assert ours.decode_bytes(body) == text.encode("utf-8") and ours.decode(body) == text
    assert ours.eot_id == theirs.eos_token_id and ours.vocab_size == len(theirs)
    assert ours.encode_batch(["a b", "ü", "a b"]) == [theirs(t)["input_ids"] for t in ("a b", "ü", "a b")]
    # A special token's text is text unless allowed, as GPT-2's <|endoftext|> is.
    assert ours.eot_id not in ours.encode("x</s>y")
    assert ours.encode("x</s>y", allow_special=True) == theirs("x</s>y")["input_ids"]
    assert ours.eot_id in ours.encode("x</s>y", allow_special=True)
    assert ours.token_bytes(ours.eot_id) == b"</s>"


def test_a_tokenizer_of_another_kind_is_refused_in_one_line(tmp_path):
    directory = make_tokenizer(tmp_path / "tokenizer", "some text to learn from " * 50, bos=False)
    spec = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps({**spec, "decoder": {"type": "Metaspace"}}))
    with pytest.raises(ConfigError, match="decoder 'Metaspace' is not supported; this reader decodes byte-level"):
        TokenizerJson(directory)
