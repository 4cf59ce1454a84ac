"""Tests for kvjax.tokenizer: losslessness, special ids, persistence and training behaviour."""

import warnings

import numpy as np
import pytest

from kvjax.tokenizer import (
    BOS_ID,
    EOS_ID,
    MIN_VOCAB_SIZE,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    train_tokenizer,
)
from kvjax.train.data import python_docs_text, train_tokenizer_from_files

VOCAB_SIZE = 384

HARD_STRINGS = [
    "",
    " ",
    "   leading and trailing   ",
    "multiple    spaces",
    "\ttabs\tand\t\ttabs\t",
    "\n",
    "\n\n\nthree newlines first",
    "line one\nline two\n\n\nline five\n",
    " \n \n\t\n",
    "\r\nwindows\r\nline endings\r\n",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "中文字符和日本語のテキスト 한국어",
    "e\u0301 combining a\u0308 marks \u0301",
    "control \x00\x01\x07\x1b\x7f chars",
    "lower one eighth block \u2581 and \u2581\u2581 twice",
    "<s></s><pad><unk> look like special pieces",
    "def f(x):\n    return x ** 2  # comment\n",
    "digits 0123456789 and 3.14159",
    "\u200b zero width \ufeff bom \u00a0 nbsp \u3000 ideographic space",
    "\U0010ffff last code point \U000e0001 tag",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer([python_docs_text()[:50_000]], VOCAB_SIZE)


def random_unicode_strings(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    strings = []
    for _ in range(count):
        chars = []
        for _ in range(rng.integers(0, 40)):
            kind = rng.integers(4)
            if kind == 0:
                chars.append(" \t\n\u2581"[rng.integers(4)])
            elif kind == 1:
                chars.append(chr(rng.integers(32, 127)))
            else:
                code_point = int(rng.integers(0, 0x110000))
                if 0xD800 <= code_point <= 0xDFFF:  # surrogates are not valid UTF-8
                    code_point = 0xFFFD
                chars.append(chr(code_point))
        strings.append("".join(chars))
    return strings


def test_vocab_size_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert [tokenizer.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_round_trip_hard_strings(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(4 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_round_trip_random_unicode(tokenizer):
    for text in random_unicode_strings(300, seed=0):
        assert tokenizer.decode(tokenizer.encode(text)) == text, repr(text)


def test_round_trip_training_text(tokenizer):
    text = python_docs_text()[50_000:80_000]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < 0.8 * len(text)  # it learned pieces, not just characters


def test_newline_is_one_token(tokenizer):
    newline_ids = tokenizer.encode("\n")
    assert len(newline_ids) == 1
    assert tokenizer.id_to_piece(newline_ids[0]) == "\n"
    assert tokenizer.encode("a\n\nb").count(newline_ids[0]) == 2


def test_decode_drops_pad_bos_eos(tokenizer):
    ids = tokenizer.encode("hello world")
    framed = [BOS_ID, *ids[:1], PAD_ID, *ids[1:], EOS_ID, PAD_ID, PAD_ID]
    assert tokenizer.decode(framed) == "hello world"
    assert tokenizer.decode(np.asarray(framed, dtype=np.int32)) == "hello world"
    with pytest.raises(ValueError, match=str(tokenizer.vocab_size)):
        tokenizer.decode([tokenizer.vocab_size])


def test_decode_keeping_special_tokens_writes_their_pieces_between_the_texts(tokenizer):
    """As transformers' sentencepiece tokenizers write them (non-legacy): each run of other
    ids decoded on its own, the special tokens' pieces between."""
    hello, world = tokenizer.encode("hello"), tokenizer.encode("world")
    framed = [BOS_ID, *hello, PAD_ID, *world, EOS_ID, PAD_ID]
    assert tokenizer.decode(framed, skip_special_tokens=False) == "<s>hello<pad>world</s><pad>"
    assert tokenizer.decode(framed) == "helloworld" == tokenizer.decode(framed, True)
    assert tokenizer.decode([], skip_special_tokens=False) == ""
    with pytest.raises(ValueError, match=str(tokenizer.vocab_size)):
        tokenizer.decode([EOS_ID, tokenizer.vocab_size], skip_special_tokens=False)


def test_pieces_are_what_sentencepiece_splits_a_text_into(tokenizer):
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=tokenizer.to_bytes())
    for text in HARD_STRINGS:
        if "\u2581" in text:  # the space symbol typed in a text is spelled by its bytes
            continue
        assert tokenizer.pieces(tokenizer.encode(text)) == processor.encode(text, out_type=str)
    assert tokenizer.pieces([BOS_ID, EOS_ID]) == ["<s>", "</s>"]
    with pytest.raises(ValueError, match=str(tokenizer.vocab_size)):
        tokenizer.pieces([tokenizer.vocab_size])


def test_save_load_round_trip(tokenizer, tmp_path):
    path = tmp_path / "tok.model"
    tokenizer.save(path)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    loaded = Tokenizer.load(path)
    assert path.read_bytes() == tokenizer.to_bytes()
    for text in HARD_STRINGS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert Tokenizer.from_bytes(tokenizer.to_bytes()).encode("abc def") == tokenizer.encode(
        "abc def"
    )


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing.model"
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer.load(missing)
    for name, content in [("garbage.model", b"not a model"), ("empty.model", b"")]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=name):
            Tokenizer.load(path)


def test_unigram_model_is_lossless_too():
    unigram = train_tokenizer([python_docs_text()[:20_000]], 384, model_type="unigram")
    for text in HARD_STRINGS + random_unicode_strings(50, seed=1):
        assert unigram.decode(unigram.encode(text)) == text, repr(text)


def test_too_large_vocab_falls_back_with_warning():
    texts = ["hello world", "hello there", "the world says hello"]
    with pytest.warns(UserWarning, match=r"requested vocab_size=5000, trained with") as record:
        small = train_tokenizer(texts, 5000)
    assert str(small.vocab_size) in str(record[0].message)
    assert MIN_VOCAB_SIZE <= small.vocab_size < 5000
    assert small.decode(small.encode("hello, new world! ✓")) == "hello, new world! ✓"


def test_vocab_size_validation():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(["some text"], 100)
    with pytest.raises(TypeError, match="single string"):
        train_tokenizer("some text", 300)
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(["some text"], 300, model_type="word")


def test_training_is_deterministic(tokenizer):
    again = train_tokenizer([python_docs_text()[:50_000]], VOCAB_SIZE)
    assert again.to_bytes() == tokenizer.to_bytes()
    text = python_docs_text()[100_000:110_000]
    assert again.encode(text) == tokenizer.encode(text)


def test_train_from_files(tmp_path):
    paths = []
    for i, doc in enumerate(["first document\nwith lines\n", "second\tdocument ünïcode\n"]):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc * 20, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = train_tokenizer_from_files(paths, 300)
    assert tokenizer.decode(tokenizer.encode("second document\n")) == "second document\n"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train_tokenizer_from_files([paths[0], tmp_path / "nope.txt"], 300)
