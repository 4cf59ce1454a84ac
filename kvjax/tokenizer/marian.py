"""transformers' MarianTokenizer for `kvjax.tokenizer.huggingface` (whose docstring says what is
matched): source text to ids, target ids to text."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import sentencepiece as spm

SPACE = "\u2581"  # sentencepiece's word-start mark


def clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and contractions."""
    for old in (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're"):
        text = text.replace(old, old.strip() if old != " ' " else "'")
    return text


class MarianBackend:
    """transformers' MarianTokenizer, encoding source text and decoding target ids."""

    reads_target_codes = True  # a text's leading `>>xx<<` is one piece

    def __init__(self, files: dict[str, bytes], config: dict[str, Any],
                 named: dict[str, dict | None], extra: list[dict]):
        """`named`: the named special tokens (bos_token, ...) as AddedToken fields, None
        where there is none; `extra`: the extra special tokens."""
        self._source, target = (_processor(files, name) for name in ("source.spm", "target.spm"))
        self._vocab = json.loads(files["vocab.json"].decode("utf-8"))
        separate = bool(config.get("separate_vocabs"))
        decoding = (json.loads(files["target_vocab.json"].decode("utf-8")) if separate
                    else self._vocab)
        self._pieces = {int(i): piece for piece, i in decoding.items()}
        self._joiner = target if separate else self._source
        self._take_added_tokens(config, named, extra)
        # An id missing from the vocabulary decodes as the joining model's piece of that id.
        self.known_ids[:self._joiner.get_piece_size()] = True

    def _take_added_tokens(self, config: dict[str, Any], named: dict[str, dict | None],
                           extra: list[dict]) -> None:
        """The added tokens (split from text whole), the ids decoding skips and the ids
        decoding knows, from `self._vocab` and `self._pieces`."""
        unk = (named["unk_token"] or {}).get("content")
        if unk not in self._vocab:
            raise ValueError(f"vocab.json has no unk token {unk!r}")
        self._unk_id = self._vocab[unk]
        # Added tokens: tokenizer_config.json's, then the special tokens not among them, each
        # at its vocab.json id or else after all the others (as PythonBackend adds them).
        self._added, self._strip = {}, {}  # content -> id, content -> (lstrip, rstrip)
        for i, spec in sorted((int(i), s) for i, s in config.get("added_tokens_decoder",
                                                                  {}).items()):
            self._added[spec["content"]] = i
            self._strip[spec["content"]] = (bool(spec.get("lstrip")), bool(spec.get("rstrip")))
        specials = [s["content"] for s in list(named.values()) + extra
                    if s is not None]
        for content in specials:
            if content not in self._added:
                everything = {**self._vocab, **self._added}
                self._added[content] = everything.get(content, len(everything))
        self._skipped = {self._added[c] for c in specials}
        self._added_pieces = {i: c for c, i in self._added.items()}
        # Longest first, so that of two tokens starting at one place the longer is found.
        by_length = "|".join(map(re.escape, sorted(self._added, key=len, reverse=True)))
        self._split = re.compile(f"({by_length})") if by_length else None
        decodable = list(self._pieces) + list(self._added.values())
        self.known_ids = np.zeros(max(decodable + list(self._vocab.values())) + 1, bool)
        self.known_ids[decodable] = True
        self._clean_up = bool(config.get("clean_up_tokenization_spaces"))

    def token_id(self, spec: dict | None) -> int | None:
        content = spec and spec["content"]
        return self._added.get(content, self._vocab.get(content))

    def affixes(self, eos_id: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (), (() if eos_id is None else (eos_id,))

    def encode(self, text: str) -> list[int]:
        # Text and added tokens alternate: segments[1::2] are the tokens.
        segments = self._split.split(text) if self._split else [text]
        for k in range(1, len(segments), 2):  # the added tokens' lstrip / rstrip
            lstrip, rstrip = self._strip.get(segments[k], (False, False))
            if lstrip:
                segments[k - 1] = segments[k - 1].rstrip()
            if rstrip:
                segments[k + 1] = segments[k + 1].lstrip()
        ids: list[int] = []
        for k, segment in enumerate(segments):
            if k % 2:
                ids.append(self._added[segment])
            elif segment:
                code = []
                if (self.reads_target_codes and segment.startswith(">>")
                        and (end := segment.find("<<")) != -1):
                    code, segment = [segment[:end + 2]], segment[end + 2:]
                for piece in code + self._source.encode(segment, out_type=str):
                    ids.append(self._added.get(piece, self._vocab.get(piece, self._unk_id)))
        return ids

    def token_bytes(self, size: int) -> list[bytes | None]:
        raise ValueError("constrained decoding does not take a Marian tokenizer: its target "
                         "pieces are joined by a sentencepiece model, not spelled byte by byte")

    def pieces(self, ids: list[int]) -> list[str]:
        return [self._added_pieces.get(i) or self._pieces.get(i) or self._joiner.id_to_piece(i)
                for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            raise ValueError(f"a {type(self).__name__.removesuffix('Backend')} tokenizer "
                             f"decodes text without its special tokens only")
        pieces = self.pieces([i for i in ids if i not in self._skipped])
        text = self._joiner.decode_pieces(pieces).replace(SPACE, " ").strip()
        return clean_up_spaces(text) if self._clean_up else text


def _processor(files: dict[str, bytes], name: str) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_proto=files[name])
    except RuntimeError as e:
        raise ValueError(f"{name} is not a sentencepiece model ({e})") from None
