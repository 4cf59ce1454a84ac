"""Text from tokens as they arrive, and stop strings: what `kvjax.text` streams and the server
sends.

`RowText` keeps one sample's tokens and decodes all of them at every step, sending only the
new suffix: a character whose UTF-8 bytes span two chunks comes out whole, and text that
could still grow into a stop string waits until it cannot. `StopStart` says how much of a
growing text could begin one stop string, in time linear in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvjax.tokenizer import TextTokenizer


def check_stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """`stop` as a tuple of strings (one string is one stop string); none may be empty."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    for i, text in enumerate(stop):
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop string {i} ({text!r}) must be a non-empty string")
    return stop


class RowText:
    """One sample's text as its tokens arrive: what is safe to show, and the first stop string.

    Text is decoded from all tokens so far and only its new suffix is sent, so a character
    split over byte pieces of two chunks comes out whole; a suffix that could still grow
    into a stop string waits. The text ends before the first of `stop_ids` (default: the
    tokenizer's), the ids that end the sample, and before the stop string it meets, or after
    it with `keep_stop` (vLLM's `include_stop_str_in_output`); special tokens are left out
    unless `skip_special_tokens` is False."""

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...],
                 stop_ids: tuple[int, ...] | None = None, keep_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.keep_stop = tokenizer, stop, keep_stop
        self.skip_special_tokens = skip_special_tokens
        self.stop_ids = frozenset(tokenizer.stop_ids if stop_ids is None else stop_ids)
        self.ids: list[int] = []
        self.sent = ""
        self.text = ""
        self.stopped = False
        self._starts = [StopStart(s) for s in stop]

    def _decode(self, ids: list[int]) -> str:
        ids = until_stop(ids, self.stop_ids)
        if self.skip_special_tokens:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _stop_at(self, text: str) -> int | None:
        found = [text.find(s) for s in self.stop if s in text]
        return min(found) if found else None

    def add(self, new_ids: list[int]) -> str:
        """Takes the next tokens; returns the new text that is safe to show."""
        if self.stopped:
            return ""
        checked = len(self.ids)
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        cut = self._stop_at(text)
        if cut is not None:
            # The tokens up to the first one whose text completes a stop string.
            while self._stop_at(self._decode(self.ids[:checked + 1])) is None:
                checked += 1
            self.ids = self.ids[:checked + 1]
            met = next(s for s in self.stop if text.startswith(s, cut)) if self.keep_stop else ""
            self.text, self.stopped = text[:cut + len(met)], True
            safe = self.text
        else:
            safe = text.rstrip("\ufffd")  # an unfinished UTF-8 sequence waits for its bytes
            held = max((start.held(safe) for start in self._starts), default=0)
            safe = safe[:len(safe) - held]
        if safe.startswith(self.sent) and len(safe) > len(self.sent):
            piece, self.sent = safe[len(self.sent):], safe
            return piece
        return ""

    def finish(self, ids: list[int]) -> None:
        """The row ended without a stop string: its text is that of all its tokens."""
        self.ids, self.text = ids, self._decode(ids)


class StopStart:
    """How much of the end of a growing text could be the start of one stop string: the
    longest end of the text that is a proper prefix of `stop`. A Knuth-Morris-Pratt
    automaton reads each new character once (the text is only re-read when it changes
    before its end), so holding text back costs time linear in the text and the stop
    string, not the product of their lengths."""

    def __init__(self, stop: str):
        self.pattern = stop[:-1]  # a whole stop string is found, not held
        self._fallback: list[int] | None = None  # built on first use: O(len(stop))
        self._read, self._state = "", 0

    def held(self, text: str) -> int:
        if not self.pattern:
            return 0
        if not text.startswith(self._read):
            self._read, self._state = "", 0
        pattern, fallback, state = self.pattern, self._failure(), self._state
        for char in text[len(self._read):]:
            while state and (state == len(pattern) or char != pattern[state]):
                state = fallback[state - 1]
            if state < len(pattern) and char == pattern[state]:
                state += 1
        self._read, self._state = text, state
        return state

    def _failure(self) -> list[int]:
        """For each prefix of the pattern, its longest proper prefix that is also its end."""
        if self._fallback is None:
            pattern, table, k = self.pattern, [0] * len(self.pattern), 0
            for i in range(1, len(pattern)):
                while k and pattern[i] != pattern[k]:
                    k = table[k - 1]
                if pattern[i] == pattern[k]:
                    k += 1
                table[i] = k
            self._fallback = table
        return self._fallback


def until_stop(ids: list[int], stop_ids: frozenset[int]) -> list[int]:
    """`ids` up to their first stop id."""
    return next((ids[:k] for k, i in enumerate(ids) if i in stop_ids), ids)
