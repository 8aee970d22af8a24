"""Incremental detokenization == one-shot tokenizer.decode (multi-byte characters split across tokens), and stop
strings trim the text and are never partly streamed."""
import pytest

from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.model.loader import load_tokenizer, resolve


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(*resolve(None)[:2])


TEXT = "Héllo wörld! 日本語のテキスト, emojis 🎉🎉 and code: `x = {'a': 1}`\n  indented <|im_end|> tail"


def test_incremental_equals_full_decode(tok):
    ids = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok, [1, 9690, 198], [])
    pieces = []
    for t in ids:
        d.add([t])
        pieces.append(d.take_delta(False))
    pieces.append(d.take_delta(True))
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_never_partly_streamed(tok):
    ids = tok.encode(TEXT)
    stop = "emojis 🎉"
    d = IncrementalDetokenizer(tok, [], [stop, "never-there"])
    streamed = ""
    for t in ids:
        hit = d.add([t])
        streamed += d.take_delta(hit)
        assert stop[:3] not in streamed
        if hit:
            break
    assert hit and streamed == d.text == TEXT[:TEXT.index(stop)]
