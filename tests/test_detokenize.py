"""kvjax/detokenize.py against brute force: the text a row streams is, whatever chunks its
tokens arrive in, the text of its tokens up to the first stop string, with no split UTF-8
character and no part of a stop string ever shown; the kept tokens end with the one that
completes the stop string; and `StopStart` holds back exactly the longest end of a text
that begins a stop string."""

import numpy as np
import pytest

from kvjax.detokenize import RowText, StopStart, check_stop_strings, until_stop

STOP_ID = 0


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 1), so a character of several bytes arrives
    over several tokens; id 0 ends generation."""

    stop_ids = (STOP_ID,)

    @staticmethod
    def encode(text):
        return [b + 1 for b in text.encode()]

    @staticmethod
    def decode(ids):
        return bytes(i - 1 for i in ids).decode("utf-8", errors="replace")


def longest_held(text: str, stop: str) -> int:
    """The longest end of `text` that is a proper prefix of `stop`, by trying every length."""
    return max(k for k in range(len(stop)) if text.endswith(stop[:k]))


def random_chunks(ids, rng):
    cuts = sorted(rng.choice(np.arange(1, len(ids)), size=min(len(ids) - 1, 4), replace=False))
    return [list(chunk) for chunk in np.split(np.asarray(ids), cuts) if len(chunk)]


@pytest.mark.parametrize("stop", ["aab", "abab", "a", "éé", "aaaa"])
def test_stop_start_holds_the_longest_end_that_begins_the_stop_string(stop):
    rng = np.random.default_rng(0)
    starts = StopStart(stop)
    text = ""
    for _ in range(400):
        if rng.random() < 0.1:  # the text changed before its end: read again from the start
            text = text[:rng.integers(len(text) + 1)] + "x"
        else:
            text += "".join(rng.choice(list("abé"), size=rng.integers(1, 4)))
        assert starts.held(text) == longest_held(text, stop), (text, stop)


TEXTS = ["naïve café — ünïcode ends here", "a stop string: STOP and after", "no end at all",
         "ST ST STO STOP", "€€€ STOP €"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [(), ("STOP",), ("é",), ("ends", "STO")])
def test_streamed_text_is_the_text_before_the_first_stop_string_whatever_the_chunks(text, stop):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    cuts = [text.find(s) for s in stop if s in text]
    want = text[:min(cuts)] if cuts else text
    rng = np.random.default_rng(len(text))
    for _ in range(5):
        row = RowText(tokenizer, stop)
        shown = ""
        for chunk in random_chunks(ids, rng):
            piece = row.add(chunk)
            shown += piece
            assert "\ufffd" not in shown  # no character shown before all its bytes
            assert not any(s in shown for s in stop)
            assert want.startswith(shown)
        if not row.stopped:
            row.finish(row.ids)
        assert row.stopped == bool(cuts)
        assert row.text == want
        # Unstopped, the end that could still begin a stop string was never shown.
        held = 0 if cuts else max((longest_held(want, s) for s in stop), default=0)
        assert shown == want[:len(want) - held]
        if cuts:  # the kept tokens end with the one whose text completes the stop string
            assert any(s in tokenizer.decode(row.ids) for s in stop)
            assert not any(s in tokenizer.decode(row.ids[:-1]) for s in stop)
            assert row.add(tokenizer.encode("more")) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_a_stop_string_kept_ends_the_text_it_is_met_in_whatever_the_chunks(text):
    """vLLM's include_stop_str_in_output: the text goes on to the end of the stop string
    met first, and no further."""
    stop = ("ends", "STO")
    tokenizer = ByteTokenizer()
    cuts = [text.find(s) for s in stop if s in text]
    want = text[:min(cuts)] + next(s for s in stop if text.startswith(s, min(cuts))) \
        if cuts else text
    rng = np.random.default_rng(len(text))
    for _ in range(5):
        row = RowText(tokenizer, stop, keep_stop=True)
        shown = "".join(row.add(chunk) for chunk in random_chunks(tokenizer.encode(text), rng))
        if not row.stopped:
            row.finish(row.ids)
        assert row.text == want and want.startswith(shown)
        assert row.stopped == bool(cuts) and (shown == want or not cuts)


def test_text_after_a_stop_id_is_never_shown():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("before") + [STOP_ID] + tokenizer.encode("after")
    assert until_stop(ids, frozenset({STOP_ID})) == ids[:6]
    row = RowText(tokenizer, ())
    assert "".join(row.add([i]) for i in ids) == "before"


def test_a_row_given_its_own_stop_ids_ends_its_text_there_alone():
    """A server's request names the ids that end it (vLLM's stop_token_ids; none of the
    tokenizer's with ignore_eos): the text ends at the first of those."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("before") + tokenizer.encode("after")
    row = RowText(tokenizer, (), stop_ids=tuple(tokenizer.encode("a")))
    assert "".join(row.add([i]) for i in ids) == "before"
    row = RowText(tokenizer, (), stop_ids=())
    assert "".join(row.add([i]) for i in ids) == "beforeafter"


class MarkedTokenizer(ByteTokenizer):
    """ByteTokenizer with one special token, `MARK`, written "<m>" where kept (the texts
    here hold no NUL byte, which stands for it while decoding)."""

    MARK = 300

    @classmethod
    def decode(cls, ids, skip_special_tokens=True):
        runs = bytes(i - 1 if i != cls.MARK else 0 for i in ids).split(b"\0")
        return ("" if skip_special_tokens else "<m>").join(
            run.decode("utf-8", errors="replace") for run in runs)


def test_special_tokens_kept_stream_as_the_tokenizer_writes_them_whatever_the_chunks():
    tokenizer, mark = MarkedTokenizer(), MarkedTokenizer.MARK
    ids = [mark, *tokenizer.encode("ab"), mark, mark, *tokenizer.encode("é"), STOP_ID, mark]
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = sorted(rng.choice(np.arange(1, len(ids)), rng.integers(0, 4), replace=False))
        chunks = np.split(np.asarray(ids), cuts)
        for skip, want in ((False, "<m>ab<m><m>é"), (True, "abé")):
            row = RowText(tokenizer, (), skip_special_tokens=skip)
            assert "".join(row.add(chunk.tolist()) for chunk in chunks) == want


def test_stop_strings_are_checked():
    assert check_stop_strings("x") == ("x",)
    assert check_stop_strings(["a", "bc"]) == ("a", "bc")
    with pytest.raises(ValueError, match=r"stop string 1 \(''\) must be a non-empty string"):
        check_stop_strings(["a", ""])
    with pytest.raises(ValueError, match=r"stop string 0 \(3\)"):
        check_stop_strings([3])
