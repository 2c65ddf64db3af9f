"""Detokenizing a stream: whole characters only, stop strings held back until they cannot match."""

from gpt.inference.text_stream import TextStream
from gpt.tokenizer import get_tokenizer


def test_text_stream_releases_whole_characters_and_holds_back_stop_strings():
    tokenizer = get_tokenizer()
    text = "naïve café — 東京 and more"
    tokens = tokenizer.encode(text)
    stream, pieces = TextStream(), []
    for token in tokens:
        stream.push(token)
        pieces.append(stream.take())
    pieces.append(stream.finish())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(tokens) > len([p for p in pieces if p])  # some characters took several tokens

    stream, shown = TextStream(["and m"]), ""
    for token in tokens:
        stopped = stream.push(token)
        shown += stream.take()
        assert "and" not in shown  # the start of the stop string is never shown early
        if stopped:
            break
    assert stopped and shown + stream.finish() == "naïve café — 東京 "
