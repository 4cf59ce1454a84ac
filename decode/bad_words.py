"""Bad words: token sequences a sample never completes (vLLM's `bad_words`).

A word of one token is banned at every step. A longer word's last token is banned where the
sample's newest tokens are the word's others, so the word is never made whole; the sample
may still make its first tokens, and go on with anything else. The engine matches a word's
first tokens against a sample's own tokens alone, as vLLM does; `generate` against its
prompt's too, as transformers does (`banned_by_words`' `generated`).

A text becomes the ids of both ways a tokenizer writes it, as vLLM tokenizes it: the word on
its own (its leading spaces stripped), and after a space (where a word inside a sentence
starts), when that is another token sequence of as many tokens (`word_ids`).

On the device each row holds its words in a table [words, tokens], each word's ids
right-aligned, -1 before them and in rows of no word (`words_table`). Shape letters: B rows,
C a row's context; the tables' own axes (a row's words, a word's tokens) have none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import checks

# A table's size, fixed so that its number of words never compiles anew: token sequences,
# and each one's tokens.
MAX_WORDS, MAX_WORD_TOKENS = 32, 8


def word_ids(encode: Callable[[str], Sequence[int]], words: Sequence[str]
             ) -> tuple[tuple[int, ...], ...]:
    """Each of `words` as token sequences: `encode(word.lstrip())`, then `encode(" " +
    word.lstrip())` where its first token differs from the first's and it has as many.
    A ValueError names a word that has no tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            raise ValueError(f"bad word {word!r} has no tokens")
        sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def checked_words(name: str, words, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """`words` (token id sequences) as tuples; an InvalidValue naming `name` refuses more
    than `MAX_WORDS`, an empty or longer one than `MAX_WORD_TOKENS`, or an id outside the
    vocabulary [0, `vocab_size`)."""
    if isinstance(words, str | bytes) or not isinstance(words, tuple | list):
        raise checks.InvalidValue(name, f"{name} {words!r} must be a list of token id "
                                        "sequences")
    if len(words) > MAX_WORDS:
        raise checks.InvalidValue(name, f"{len(words)} {name} token sequences: at most "
                                        f"{MAX_WORDS} (a word after a space counts as one "
                                        "more)")
    sequences = tuple(checks.token_ids(name, word) for word in words)
    for ids in sequences:
        if not 1 <= len(ids) <= MAX_WORD_TOKENS:
            raise checks.InvalidValue(name, f"{name} {list(ids)}: a sequence is 1 to "
                                            f"{MAX_WORD_TOKENS} ids")
        if any(not 0 <= token < vocab_size for token in ids):
            raise checks.InvalidValue(name, f"{name} {list(ids)}: an id outside the "
                                            f"vocabulary [0, {vocab_size})")
    return sequences


def words_table(words: Sequence[Sequence[int]], num_words: int, word_tokens: int
                ) -> np.ndarray:
    """[num_words, word_tokens] int32: `words` right-aligned, -1 before each and in the rows
    after them."""
    table = np.full((num_words, word_tokens), -1, np.int32)
    for row, word in enumerate(words):
        table[row, word_tokens - len(word):] = word
    return table


def newest_tokens(context_BC: jax.Array, context_lengths_B: jax.Array, count: int
                  ) -> jax.Array:
    """[B, count] int32 each row's newest `count` tokens of its context, right-aligned, -1
    before them where the row has fewer (-1 matches no word's id)."""
    back = jnp.arange(count) - count  # -count .. -1
    at = context_lengths_B[:, None] + back
    newest = jnp.take_along_axis(context_BC, jnp.clip(at, 0, context_BC.shape[1] - 1), axis=1)
    return jnp.where(at >= 0, newest, -1).astype(jnp.int32)


def banned_by_words(words: jax.Array, context_BC: jax.Array, context_lengths_B: jax.Array,
                    generated_B: jax.Array) -> jax.Array:
    """[B, words] int32: each word's last id where the row's newest tokens (the last of its
    context) are the word's others, all among its newest `generated` [B] (those it made, or
    its whole context); -1 elsewhere (and for rows of no word). `words` [B, words, tokens]
    as `words_table` writes a row's. A word of one token is banned always."""
    before_last = words.shape[-1] - 1
    newest = newest_tokens(context_BC, context_lengths_B, before_last)  # [B, before_last]
    back = jnp.arange(before_last) - before_last  # their places from the newest: -n .. -1
    made = back[None, :] >= -generated_B[:, None]
    first = words[:, :, :before_last]
    matches = (first < 0) | ((first == newest[:, None]) & made[:, None])
    last = words[:, :, before_last]
    return jnp.where(jnp.all(matches, axis=-1) & (last >= 0), last, -1)
