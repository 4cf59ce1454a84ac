"""Datasets for training: nothing is downloaded.

Text comes from Python's own documentation (shipped with CPython) or from files the user gives;
translation pairs come from integers spelled as English words or from a TSV file; the synthetic
tasks are generated from a seed. Everything is turned into fixed-shape int32 numpy arrays.

The ids that frame text in an example (what separates documents, ends a source, starts and
ends a target) are a `Framing`: kvjax's own by default, a model's own (`Framing.of`) for any
other tokenizer. Padding is filler whose value means nothing: which positions count is said
by lengths and weights, never by a token id, since an imported vocabulary uses id 0 (kvjax's
PAD) as a real token.

Shapes: B examples, T tokens per example.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pydoc_data.topics import topics

import numpy as np

from kvjax.tokenizer import BOS_ID, EOS_ID, PAD_ID, TextTokenizer, Tokenizer, train_tokenizer

# ---------------------------------------------------------------------------------------------
# Framing


@dataclasses.dataclass(frozen=True)
class Framing:
    """The special ids around text in training examples, as a model expects them.

    - `document_prefix`: what precedes each document of a language model's stream (what its
      prompts start with: kvjax's EOS, Llama's BOS, nothing for GPT-2);
    - `eos_id`: what ends each document and each target (None: nothing ends a document);
    - `source_suffix`: what ends an encoder-decoder's source, `source_prefix` what starts it
      (NLLB: the source language's code);
    - `decoder_start`: the first decoder input of a target (the model config's `bos_id`;
      Marian's is its pad id);
    - `target_prefix`: what starts every target after the decoder start, predicted as part
      of it (NLLB's target language code).
    """

    document_prefix: tuple[int, ...]
    eos_id: int | None
    source_suffix: tuple[int, ...]
    decoder_start: int
    source_prefix: tuple[int, ...] = ()
    target_prefix: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: TextTokenizer, decoder_start: int) -> Framing:
        """The framing of a model with this tokenizer whose config's `bos_id` is
        `decoder_start`; kvjax's own tokenizers with kvjax's configs give `KVJAX_FRAMING`."""
        return cls(tuple(tokenizer.document_prefix), tokenizer.eos_id,
                   tuple(tokenizer.source_suffix), decoder_start,
                   tuple(tokenizer.source_prefix))


KVJAX_FRAMING = Framing(document_prefix=(EOS_ID,), eos_id=EOS_ID, source_suffix=(EOS_ID,),
                        decoder_start=BOS_ID)


# ---------------------------------------------------------------------------------------------
# Text


def python_docs_text() -> str:
    """The text of the Python documentation topics that ship with CPython (~465k characters)."""
    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text_file(path: str | os.PathLike) -> str:
    """The contents of a UTF-8 text file; raises if it is missing, unreadable or empty.

    A byte-order mark at the start (as some editors write) is not part of the text."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"text file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not text:
        raise ValueError(f"{path} is empty")
    return text


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_files(paths: Iterable[str | os.PathLike]) -> list[dict[str, str]]:
    """[{"name": file name, "sha256": hash of its bytes}] in order, for a run's record. The
    name without its directory, so that a moved file is still the same data."""
    described = []
    for path in paths:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        described.append({"name": os.path.basename(path), "sha256": digest})
    return described


def train_tokenizer_from_files(
    paths: Iterable[str | os.PathLike], vocab_size: int, **kwargs
) -> Tokenizer:
    """``train_tokenizer`` on UTF-8 text files, one document per file."""
    def documents() -> Iterator[str]:
        for path in paths:
            yield read_text_file(path)

    return train_tokenizer(documents(), vocab_size, **kwargs)


def read_text_files(paths: Iterable[str | os.PathLike]) -> str:
    """The UTF-8 files at ``paths``, joined with blank lines."""
    texts = [read_text_file(path) for path in paths]
    if not texts:
        raise ValueError("no text files given")
    return "\n\n".join(texts)


# ---------------------------------------------------------------------------------------------
# Language modelling


def tokenize_documents(tokenizer, docs: Iterable[str],
                       framing: Framing = KVJAX_FRAMING) -> np.ndarray:
    """One int32 token stream [N] of all ``docs``, each after ``framing.document_prefix`` and
    followed by its ``eos_id`` (if any). ``tokenizer`` needs only ``encode``.

    The stream starts as if a document had just ended, and a prefix that the stream already
    ends with is not repeated: where the prefix is the eos itself (kvjax's own framing) that
    gives ``doc EOS doc EOS ...``; Llama's gives ``BOS doc EOS BOS doc EOS ...`` and GPT-2's
    ``doc EOS doc EOS ...``.
    """
    prefix = list(framing.document_prefix)
    eos = [] if framing.eos_id is None else [framing.eos_id]
    ids: list[int] = []
    for doc in docs:
        before = ids or eos
        if prefix and before[-len(prefix):] != prefix:
            ids.extend(prefix)
        ids.extend(tokenizer.encode(doc))
        ids.extend(eos)
    return np.asarray(ids, dtype=np.int32)


def pack_lm_windows(token_ids: np.ndarray, window: int) -> np.ndarray:
    """Cuts a token stream [N] into windows [W, window + 1]; the ragged tail is dropped.

    Window ``i`` starts at token ``i * window``, so consecutive windows share one boundary
    token and every token is a target exactly once: inputs are ``w[:, :-1]``, targets
    ``w[:, 1:]``.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    num_windows = (len(token_ids) - 1) // window
    if num_windows < 1:
        raise ValueError(f"{len(token_ids)} tokens are too few for one window of {window + 1}")
    starts = np.arange(num_windows)[:, None] * window
    return token_ids[starts + np.arange(window + 1)]


def split_train_val(
    windows: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random split of ``windows`` [B, ...] into (train, val), each in original order."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(windows)
    num_val = int(round(n * val_fraction))
    if val_fraction > 0:
        num_val = max(num_val, 1)
    if num_val >= n:
        raise ValueError(f"val_fraction={val_fraction} leaves no training data out of {n}")
    order = np.random.default_rng(seed).permutation(n)
    return windows[np.sort(order[num_val:])], windows[np.sort(order[:num_val])]


Examples = np.ndarray | tuple[np.ndarray, ...]


class Batches:
    """Deterministic shuffled batches: ``batch(step)`` is a pure function of (seed, step).

    ``examples`` is an array [B, ...] or a tuple of arrays sharing their first axis (then each
    batch is a tuple too). Each epoch visits every example once, in the order
    ``np.random.default_rng([seed, epoch]).permutation(B)``; the last incomplete batch is
    dropped. Because nothing else is remembered, the data position of a checkpoint is just its
    step: resuming at step ``s`` continues with exactly the batches an uninterrupted run sees.
    """

    def __init__(self, examples: Examples, batch_size: int, seed: int):
        arrays = examples if isinstance(examples, tuple) else (examples,)
        sizes = {len(a) for a in arrays}
        if len(sizes) != 1:
            raise ValueError(f"example arrays differ in length: {sorted(sizes)}")
        (self.num_examples,) = sizes
        if not 1 <= batch_size <= self.num_examples:
            raise ValueError(
                f"batch_size must be in [1, {self.num_examples}] (the number of examples), "
                f"got {batch_size}"
            )
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self._cached_epoch: int | None = None
        self._cached_order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            self._cached_order = np.random.default_rng([self.seed, epoch]).permutation(
                self.num_examples
            )
            self._cached_epoch = epoch
        return self._cached_order

    def batch(self, step: int, part: slice = slice(None)) -> Examples:
        """The examples [batch_size, ...] of training step ``step`` (0-based), or only the
        rows ``part`` of them (a process's share of a batch split over several)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, self.steps_per_epoch)
        rows = self._order(epoch)[index * self.batch_size : (index + 1) * self.batch_size][part]
        if isinstance(self.examples, tuple):
            return tuple(a[rows] for a in self.examples)
        return self.examples[rows]


# ---------------------------------------------------------------------------------------------
# Translation


_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = [f"{_ONES[hundreds]} hundred"] if hundreds else []
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens] + (f"-{_ONES[ones]}" if ones else ""))
    elif rest:
        words.append(_ONES[rest])
    return " ".join(words)


def number_to_words(n: int) -> str:
    """English words for 0 <= n < 1_000_000, e.g. 4021 -> "four thousand twenty-one"."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_to_words needs 0 <= n < 1000000, got {n}")
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    words = [f"{_below_thousand(thousands)} thousand"] if thousands else []
    if rest:
        words.append(_below_thousand(rest))
    return " ".join(words)


def number_pairs(
    max_number: int, num_heldout: int = 1000, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) pairs ("4021", "four thousand twenty-one") for range(max_number).

    The ``num_heldout`` held-out numbers are a fixed random choice for ``seed`` and never
    appear in the train pairs; every other number does, in increasing order.
    """
    if not 1 <= max_number <= 1_000_000:
        raise ValueError(f"max_number must be in [1, 1000000], got {max_number}")
    if not 0 <= num_heldout < max_number:
        raise ValueError(f"num_heldout must be in [0, {max_number}), got {num_heldout}")
    heldout = np.zeros(max_number, dtype=bool)
    heldout[np.random.default_rng(seed).choice(max_number, num_heldout, replace=False)] = True
    train_pairs, heldout_pairs = [], []
    for n in range(max_number):
        (heldout_pairs if heldout[n] else train_pairs).append((str(n), number_to_words(n)))
    return train_pairs, heldout_pairs


def read_tsv_pairs(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(source, target) pairs from a UTF-8 file of ``source<TAB>target`` lines.

    Blank lines are skipped; any other line needs exactly one tab and text on both sides.
    """
    pairs = []
    for line_number, line in enumerate(read_text_file(path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise ValueError(
                f"{path}:{line_number}: expected 'source<TAB>target' with one tab and text "
                f"on both sides, got {line!r}"
            )
        pairs.append((fields[0], fields[1]))
    if not pairs:
        raise ValueError(f"{path} contains no pairs")
    return pairs


def pad_sequences(
    seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads ``seqs`` to (tokens [B, T], lengths [B]), both int32.

    T is ``length`` if given, else the longest sequence. The lengths, not ``pad_id``, say
    where each row ends.
    """
    lengths = np.asarray([len(s) for s in seqs], dtype=np.int32)
    longest = int(lengths.max(initial=0))
    if length is None:
        length = longest
    elif longest > length:
        index = int(lengths.argmax())
        raise ValueError(f"sequence {index} has {longest} tokens, more than length={length}")
    tokens = np.full((len(seqs), length), pad_id, dtype=np.int32)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
    return tokens, lengths


def encode_pairs(
    tokenizer, pairs: Sequence[tuple[str, str]], max_len: int,
    framing: Framing = KVJAX_FRAMING,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-forcing arrays for an encoder-decoder, all padded to ``max_len`` with PAD.

    Returns (src_tokens [B, max_len], src_lengths [B], tgt_in [B, max_len],
    tgt_out [B, max_len], tgt_lengths [B]) where, per pair, the source is
    ``source_prefix + encode(src) + source_suffix``, the decoder input
    ``[decoder_start] + target_prefix + encode(tgt)`` and the decoder target
    ``target_prefix + encode(tgt) + [eos_id]`` (ids of ``framing``; ``tokenizer`` needs only
    ``encode``). A pair that does not fit raises
    ValueError naming its index.
    """
    if framing.eos_id is None:
        raise ValueError("translation targets need an eos id to end with; the framing has none")
    sources, targets_in, targets_out = [], [], []
    for index, (src, tgt) in enumerate(pairs):
        src_ids = [*framing.source_prefix, *tokenizer.encode(src), *framing.source_suffix]
        tgt_ids = [*framing.target_prefix, *tokenizer.encode(tgt)]
        if len(src_ids) > max_len or len(tgt_ids) + 1 > max_len:
            raise ValueError(
                f"pair {index} needs {len(src_ids)} source and {len(tgt_ids) + 1} target "
                f"tokens, more than max_len={max_len}: {(src, tgt)!r}"
            )
        sources.append(src_ids)
        targets_in.append([framing.decoder_start] + tgt_ids)
        targets_out.append(tgt_ids + [framing.eos_id])
    src_tokens, src_lengths = pad_sequences(sources, PAD_ID, max_len)
    tgt_in, tgt_lengths = pad_sequences(targets_in, PAD_ID, max_len)
    tgt_out, _ = pad_sequences(targets_out, PAD_ID, max_len)
    return src_tokens, src_lengths, tgt_in, tgt_out, tgt_lengths


def length_weights(lengths: np.ndarray, width: int) -> np.ndarray:
    """float32 [B, width]: 1 at the first ``lengths[b]`` positions of row b, 0 after."""
    return (np.arange(width) < np.asarray(lengths)[:, None]).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Synthetic tasks (token ids drawn from [vocab_low, vocab_high); keep vocab_low >= 4 so that
# they never collide with the special ids)


def _check_vocab_range(vocab_low: int, vocab_high: int) -> None:
    if not 0 <= vocab_low < vocab_high:
        raise ValueError(f"need 0 <= vocab_low < vocab_high, got [{vocab_low}, {vocab_high})")


def reverse_task(
    num_examples: int, seq_len: int, vocab_low: int, vocab_high: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(src, tgt) id lists where tgt is src reversed; lengths are uniform in [1, seq_len]."""
    _check_vocab_range(vocab_low, vocab_high)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    rng = np.random.default_rng(seed)
    examples = []
    for length in rng.integers(1, seq_len + 1, size=num_examples):
        src = rng.integers(vocab_low, vocab_high, size=length).tolist()
        examples.append((src, src[::-1]))
    return examples


def repeat_task(
    num_windows: int,
    window: int,
    max_segment_len: int,
    vocab_low: int,
    vocab_high: int,
    seed: int,
) -> np.ndarray:
    """Language-modelling windows [num_windows, window + 1] of a stream ``x x EOS y y EOS ...``.

    Each segment (``x``, ``y``, ...) has a random length in [1, max_segment_len]; its second
    copy is predictable from the first, so a model that learns to attend back gets its loss
    well below that of the random first halves.
    """
    _check_vocab_range(vocab_low, vocab_high)
    if max_segment_len < 1:
        raise ValueError(f"max_segment_len must be >= 1, got {max_segment_len}")
    rng = np.random.default_rng(seed)
    needed = num_windows * window + 1
    stream: list[int] = []
    while len(stream) < needed:
        segment = rng.integers(vocab_low, vocab_high, size=rng.integers(1, max_segment_len + 1))
        stream.extend(segment.tolist() * 2)
        stream.append(EOS_ID)
    return pack_lm_windows(np.asarray(stream[:needed], dtype=np.int32), window)
