"""A lossless sentencepiece tokenizer with fixed special ids.

Every tokenizer made here satisfies ``decode(encode(text)) == text`` for any text: whitespace is
kept verbatim (no normalization, no dummy prefix, no collapsing of spaces), newlines have their
own piece, and any character outside the learned vocabulary is spelled as its UTF-8 bytes.

The special ids are the same for every tokenizer, so model code can rely on them::

    PAD_ID = 0, BOS_ID = 1, EOS_ID = 2, UNK_ID = 3

`TextTokenizer` is the interface that sampling (`kvjax.text`, the CLI, the notebooks) sees: this
module's `Tokenizer` and the tokenizers of Hugging Face directories (`huggingface.py`) both
satisfy it, and `tokenizer_from_bytes` reads back what either's `to_bytes` wrote.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import sentencepiece as spm

from . import token_bytes
from .huggingface import from_bundle

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# sentencepiece writes " " as this symbol inside pieces and turns it back into " " when
# decoding, so a literal U+2581 in the input would come back as a space. We always spell the
# literal character with its byte pieces, which decode verbatim.
_SPACE_SYMBOL = "\u2581"
_NEWLINE = "\n"
_NUM_RESERVED_PIECES = 4 + 1 + 256  # specials, newline, one piece per byte
MIN_VOCAB_SIZE = _NUM_RESERVED_PIECES + 8
# The trainer silently skips sentences longer than its max_sentence_length (in bytes).
_MAX_SENTENCE_CHARS = 2048
_MODEL_TYPES = ("bpe", "unigram")


def _byte_piece(byte: int) -> str:
    return f"<0x{byte:02X}>"


@runtime_checkable
class TextTokenizer(Protocol):
    """Text to token ids and back, and the ids that frame a model's input and end its output.

    - `vocab_size`: how many ids the tokenizer can produce (its largest id + 1, added tokens
      included); a model's vocabulary must be at least this large.
    - `pad_id`, `bos_id`, `eos_id`: the tokenizer's special ids, None where it has no such
      token (GPT-2 has no padding token, Qwen2 and Marian no BOS).
    - `encode(text)`: the ids of `text` with no special ids added around it. A special
      token's string inside the text is read as that token where the tokenizer does so
      (Hugging Face tokenizers do; kvjax's own spell `</s>` as plain text).
    - `decode(ids)`: the text of `ids` (any 1-D sequence or array) with special tokens left
      out; an id outside the vocabulary is a ValueError naming it. With
      `skip_special_tokens=False` they are written as the vocabulary spells them, as
      transformers' `decode` writes them (a ValueError where a tokenizer cannot).
    - `stop_ids`: the ids that end generation, `eos_id` first (plus a Hugging Face model's
      `generation_config.json` `eos_token_id`s).
    - `document_prefix`: what a language model's prompt starts with. kvjax's own LMs are
      trained on documents each followed by EOS, so theirs is `(EOS_ID,)`; a Hugging Face
      model's is what its tokenizer adds in front of a text (Llama: `(bos,)`, GPT-2: `()`).
    - `source_prefix`, `source_suffix`: what an encoder-decoder's source starts and ends
      with (kvjax: `()` and `(EOS_ID,)`; a Hugging Face model: what its tokenizer puts
      around a text, Marian's `()` and `(eos,)`, NLLB's source language code and `(eos,)`).
    - `target_prefix`: the ids an encoder-decoder's target starts with after the decoder's
      start, which generating forces unless told otherwise (kvjax: `()`; a Hugging Face
      model: its generation config's `forced_bos_token_id`, BART-large-CNN's `<s>`).
    - `forced_end`: the id generating makes last when it reaches its token budget, or None
      (kvjax: None; a Hugging Face model: its generation config's `forced_eos_token_id`,
      Marian's `</s>`).
    - `banned_ids`: ids generating never makes (kvjax: `()`; a Hugging Face model: its
      generation config's one-token `bad_words_ids`, Marian's pad).
    - `bad_words`: token sequences generating never completes (kvjax: `()`; a Hugging Face
      model: its generation config's `bad_words_ids` of several ids).
    - `sampling_defaults`: {setting: value} of `decode.Sampling` its authors chose, which a
      server takes for what a request leaves out (kvjax: none; a Hugging Face model: its
      generation config's `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`).
    - `to_bytes()`: a serialization that `tokenizer_from_bytes` turns back into an equal
      tokenizer (no pickle).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    @property
    def document_prefix(self) -> tuple[int, ...]: ...

    @property
    def source_prefix(self) -> tuple[int, ...]: ...

    @property
    def source_suffix(self) -> tuple[int, ...]: ...

    @property
    def target_prefix(self) -> tuple[int, ...]: ...

    @property
    def forced_end(self) -> int | None: ...

    @property
    def banned_ids(self) -> tuple[int, ...]: ...

    @property
    def bad_words(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def sampling_defaults(self) -> dict[str, float | int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's string of each of `ids`, special tokens included (transformers'
        `convert_ids_to_tokens`, vLLM's `token_strs`)."""
        ...

    def to_bytes(self) -> bytes: ...

    def token_bytes(self) -> list[bytes | None]:
        """[vocab_size] the bytes each id stands for, None for special tokens (for
        constrained decoding; `token_bytes.py`). A ValueError where the tokenizer's pieces
        do not say their bytes."""
        ...


def tokenizer_from_bytes(data: bytes) -> TextTokenizer:
    """The tokenizer that `to_bytes` serialized: kvjax's own (a sentencepiece ModelProto) or
    a Hugging Face one (a JSON bundle, see `huggingface.py`); raises ValueError if
    `data` is neither."""
    data = bytes(data)
    # A serialized ModelProto starts with a protobuf field tag, never with "{".
    if data[:1] == b"{":
        return from_bundle(data)
    return Tokenizer(data)


class Tokenizer:
    """A trained sentencepiece model; see the module docstring for its guarantees."""

    def __init__(self, model_proto: bytes):
        """Wraps a serialized sentencepiece ModelProto; raises ValueError if it is unusable."""
        if not model_proto:
            raise ValueError("empty sentencepiece model")
        try:
            processor = spm.SentencePieceProcessor(model_proto=bytes(model_proto))
        except RuntimeError as e:
            raise ValueError(f"not a valid sentencepiece model: {e}") from None
        specials = (processor.pad_id(), processor.bos_id(), processor.eos_id(), processor.unk_id())
        if specials != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(
                f"sentencepiece model has special ids (pad, bos, eos, unk) = {specials}; "
                f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}"
            )
        byte_ids = [processor.piece_to_id(_byte_piece(b)) for b in range(256)]
        if not all(processor.is_byte(i) for i in byte_ids):
            raise ValueError("sentencepiece model was trained without byte_fallback")
        self._processor = processor
        self._model_proto = bytes(model_proto)
        self._space_symbol_ids = [byte_ids[b] for b in _SPACE_SYMBOL.encode("utf-8")]

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Tokenizer:
        return cls(model_proto)

    def to_bytes(self) -> bytes:
        """The serialized sentencepiece ModelProto (what ``save`` writes)."""
        return self._model_proto

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        try:
            with open(path, "rb") as f:
                model_proto = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer model not found: {path}") from None
        except OSError as e:
            raise ValueError(f"cannot read tokenizer model {path}: {e}") from None
        try:
            return cls(model_proto)
        except ValueError as e:
            raise ValueError(f"{path} is not a usable tokenizer model: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model atomically: readers never see a partially written file."""
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".tokenizer-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._model_proto)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, path)
        except BaseException:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            raise

    @property
    def vocab_size(self) -> int:
        return self._processor.vocab_size()

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (EOS_ID,)

    @property
    def document_prefix(self) -> tuple[int, ...]:
        # Training streams documents each followed by EOS, so a new document follows an EOS.
        return (EOS_ID,)

    @property
    def source_prefix(self) -> tuple[int, ...]:
        return ()

    @property
    def source_suffix(self) -> tuple[int, ...]:
        return (EOS_ID,)

    @property
    def target_prefix(self) -> tuple[int, ...]:
        return ()

    @property
    def forced_end(self) -> int | None:
        return None

    @property
    def banned_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def bad_words(self) -> tuple[tuple[int, ...], ...]:
        return ()

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        return {}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS or EOS."""
        if _SPACE_SYMBOL not in text:
            return self._processor.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_SPACE_SYMBOL)):
            if i:
                ids.extend(self._space_symbol_ids)
            ids.extend(self._processor.encode(part))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (any 1-D sequence or array); PAD, BOS and EOS ids are dropped, or
        with `skip_special_tokens=False` written as their pieces (`<pad>`, `<s>`, `</s>`)
        between the texts of the ids around them."""
        vocab_size = self.vocab_size
        parts, run = [], []
        for i in ids:
            i = int(i)
            if not 0 <= i < vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size})")
            if i not in (PAD_ID, BOS_ID, EOS_ID):
                run.append(i)
            elif not skip_special_tokens:
                parts += [self._processor.decode(run), self._processor.id_to_piece(i)]
                run = []
        return "".join(parts) + self._processor.decode(run)

    def token_bytes(self) -> list[bytes | None]:
        """[vocab_size] the bytes each id stands for; None for PAD, BOS, EOS and UNK."""
        p = self._processor
        return token_bytes.table(self.vocab_size, (
            (i, None if p.is_control(i) or p.is_unknown(i) else
             token_bytes.byte_fallback(p.id_to_piece(i))) for i in range(self.vocab_size)))

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_piece(i) for i in ids]

    def id_to_piece(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return self._processor.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def _training_sentences(texts: Iterable[str]) -> list[str]:
    # The trainer reads one sentence per line, so lines are the sentences and "\n" itself is a
    # user-defined piece (it never reaches the trainer, but encodes to a single id).
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of documents, not a single string")
    sentences = []
    for doc in texts:
        if not isinstance(doc, str):
            raise TypeError(f"documents must be str, got {type(doc).__name__}")
        for line in doc.split(_NEWLINE):
            for start in range(0, len(line), _MAX_SENTENCE_CHARS):
                sentences.append(line[start : start + _MAX_SENTENCE_CHARS])
    return sentences


def _train_model_proto(
    sentences: Sequence[str],
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    hard_vocab_limit: bool,
) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        hard_vocab_limit=hard_vocab_limit,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_by_whitespace=True,
        allow_whitespace_only_pieces=True,
        # Digit-by-digit pieces keep numbers compositional.
        split_digits=True,
        user_defined_symbols=[_NEWLINE],
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        max_sentence_length=4 * _MAX_SENTENCE_CHARS,
        num_threads=1,  # one thread makes training deterministic
        minloglevel=2,
    )
    return model.getvalue()


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
) -> Tokenizer:
    """Trains a lossless tokenizer in memory on ``texts`` (an iterable of documents).

    Characters outside ``character_coverage`` of the corpus are left to the byte pieces. If
    the corpus is too small for ``vocab_size`` pieces, the largest size it supports is used
    and a warning names both sizes.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {_NUM_RESERVED_PIECES} pieces are reserved "
            f"for special ids, newline and bytes; use at least {MIN_VOCAB_SIZE}"
        )
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
    sentences = _training_sentences(texts)
    if not any(sentences):
        raise ValueError("cannot train a tokenizer on an empty corpus")
    args = (sentences, vocab_size, model_type, character_coverage)
    try:
        model_proto = _train_model_proto(*args, hard_vocab_limit=True)
    except RuntimeError as e:
        message = str(e)
        if "Vocabulary size too high" in message:
            model_proto = _train_model_proto(*args, hard_vocab_limit=False)
        elif "smaller than required_chars" in message:
            raise ValueError(
                f"vocab_size={vocab_size} cannot hold the reserved pieces plus the characters "
                f"this corpus needs at character_coverage={character_coverage} "
                f"({message.rsplit(']', 1)[-1].strip()})"
            ) from None
        else:
            raise
    tokenizer = Tokenizer(model_proto)
    if tokenizer.vocab_size != vocab_size:
        warnings.warn(
            f"the corpus supports at most {tokenizer.vocab_size} pieces: requested "
            f"vocab_size={vocab_size}, trained with vocab_size={tokenizer.vocab_size}",
            stacklevel=2,
        )
    return tokenizer
