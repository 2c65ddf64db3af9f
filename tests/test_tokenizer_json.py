"""A model's own tokenizer.json (byte-level BPE, as Llama 3's, Qwen's and SmolLM2's; SentencePiece-style, as Gemma's,
Mistral's and Llama 2's) gives transformers' `AutoTokenizer` ids and decodes, and its tokens' bytes stream the
text a whole character at a time."""

import json

import pytest

from gpt.errors import ConfigError
from gpt.inference.text_stream import TextStream
from gpt.tokenizer_json import TokenizerJson

from hf_reference import SENTENCEPIECE_STYLES, make_sentencepiece_tokenizer, make_tokenizer

TEXTS = [
    "",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n",
    "héllo wörld — naïve café, ΑΒΓ, Привет, 日本語のテキスト, 한국어, שָׁלוֹם, مرحبا, देवनागरी",
    "emoji 👩‍👩‍👧‍👦 🇺🇸 and combining e\u0301, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ ∑",
    "it's they're I'll we've he'd 1234567890 3.14159",
    "\x00\x01 control chars \u200b zero-width",
    "text that spells a byte token: <0x41> <0xE6><0x97>",
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


@pytest.mark.parametrize("style", SENTENCEPIECE_STYLES)
def test_sentencepiece_style_ids_and_decodes_are_autotokenizers(tmp_path, corpus_text, style):
    """Metaspace words and byte fallback (characters outside a 60-letter alphabet become <0xNN> tokens): the ids
    and the decoded text are transformers', and a text's tokens decode to the text."""
    import transformers

    directory = make_sentencepiece_tokenizer(tmp_path / style, corpus_text[:60_000], style)
    ours, theirs = TokenizerJson(directory), transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*TEXTS, "\n".join(TEXTS), corpus_text[200_000:202_000]]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text[:40]
        assert ours.decode(ids) == theirs.decode(ids), text[:40]
        assert ours.decode(ids[1:]) == theirs.decode(ids[1:]), text[:40]
        # Metaspace adds no prefix space to a text that starts with one, and the decoder strips one all the same.
        assert ours.decode(ids[1:]) == (text[1:] if style == "metaspace" and text[:1] == " " else text), text[:40]
    fallback = [i for i in ours.encode("日本") if ours.tokenizer.id_to_token(i).startswith("<0x")]
    assert len(fallback) == 6  # two characters of three bytes, neither in the alphabet
    assert ours.token_bytes(fallback[0]) == "日".encode()[:1]
    assert ours.eot_id == theirs.eos_token_id == 2 and ours.vocab_size == theirs.vocab_size  # (Gemma's class adds
    # a <pad> and a <mask> that a real Gemma file has, and this one has not)


@pytest.mark.parametrize("style", SENTENCEPIECE_STYLES)
def test_a_stream_of_sentencepiece_tokens_is_the_whole_decode_a_character_at_a_time(tmp_path, corpus_text, style):
    """After a prompt cut between characters, the streamed continuation is what decoding the whole adds to the
    prompt's decode; no piece holds half a character, however many byte-fallback tokens it spans."""
    directory = make_sentencepiece_tokenizer(tmp_path / style, corpus_text[:60_000], style)
    tokenizer = TokenizerJson(directory)
    for text in TEXTS[3:5]:
        ids = tokenizer.encode(text)[1:]  # after the BOS
        cuts = [k for k in range(1, len(ids)) if "\ufffd" not in tokenizer.decode(ids[:k])]
        assert len(cuts) < len(ids) - 1  # some cuts fall inside a character's byte-fallback tokens
        for k in cuts[::3]:
            stream, pieces = TextStream(tokenizer=tokenizer), []
            for token in ids[k:]:
                stream.push(token)
                pieces.append(stream.take())
            pieces.append(stream.finish())
            assert not any("\ufffd" in piece for piece in pieces)
            assert tokenizer.decode(ids[:k]) + "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("decoder", [{"type": "WordPiece", "prefix": "##", "cleanup": True},
                                     {"type": "Sequence", "decoders": [{"type": "CTC", "pad_token": "<pad>",
                                                                        "word_delimiter_token": "|", "cleanup": True}]}])
def test_a_tokenizer_of_another_kind_is_refused_in_one_line(tmp_path, decoder):
    directory = make_tokenizer(tmp_path / "tokenizer", "some text to learn from " * 50, bos=False)
    spec = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps({**spec, "decoder": decoder}))
    with pytest.raises(ConfigError, match=r"tokenizer.json: decoder step .* is not supported; this reader decodes "
                                          r"byte-level BPE \(ByteLevel\) and SentencePiece-style"):
        TokenizerJson(directory)


def test_an_id_past_the_tokenizers_vocabulary_reads_as_a_replacement_character(tmp_path, corpus_text):
    """A model's table may have more rows than its tokenizer has tokens (Qwen2.5's 151,936 over 151,665; a random
    model samples them): such an id is U+FFFD in text and in a stream, for GPT-2's tokenizer and a model's own."""
    from gpt.tokenizer import get_tokenizer

    own = TokenizerJson(make_sentencepiece_tokenizer(tmp_path / "sp", corpus_text[:60_000], "llama2"))
    for tokenizer in (get_tokenizer(), own):
        past = tokenizer.vocab_size + 7
        assert tokenizer.token_bytes(past) == "\ufffd".encode()
        ids = [*tokenizer.encode("ab", add_special=False), past, *tokenizer.encode(" cd", add_special=False)]
        without = [token for token in ids if token != past]
        assert "\ufffd" in tokenizer.decode(ids) and tokenizer.decode(ids).replace("\ufffd", "") == \
            tokenizer.decode(without)
        stream = TextStream(tokenizer=tokenizer)
        for token in ids:
            stream.push(token)
        assert stream.finish() == tokenizer.decode_bytes(ids).decode()
