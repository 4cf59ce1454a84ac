"""The bytes each token id stands for: what a token-level automaton (`kvjax.decode`'s
constraints) matches text against, one token at a time.

Decoding a single id is not enough: a token may hold part of a character's UTF-8 bytes, and
decoders drop or replace what they cannot show alone. So the bytes are read from the pieces,
the way each kind of tokenizer spells them:
- byte-level BPE (GPT-2, Llama 3, Qwen): each character of a piece stands for one byte, by
  GPT-2's table of printable stand-ins;
- byte-fallback pieces (sentencepiece, Llama 2 style): `<0xNN>` is the byte NN, `▁` a space,
  anything else its UTF-8 bytes.
Special tokens stand for no text (None): constrained output never holds them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from .marian import SPACE

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_stand_in() -> dict[str, int]:
    """GPT-2's table, reversed: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def byte_level(piece: str) -> bytes | None:
    """A byte-level BPE piece's bytes; None if a character is no byte's stand-in."""
    table = _byte_of_stand_in()
    if any(c not in table for c in piece):
        return None
    return bytes(table[c] for c in piece)


def byte_fallback(piece: str) -> bytes:
    """A sentencepiece-style piece's bytes."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPACE, " ").encode("utf-8")


def table(size: int, pieces: Iterable[tuple[int, bytes | None]]) -> list[bytes | None]:
    """[size] the bytes of each id from (id, bytes) pairs; ids not given stand for nothing."""
    out: list[bytes | None] = [None] * size
    for i, data in pieces:
        out[i] = data
    return out
