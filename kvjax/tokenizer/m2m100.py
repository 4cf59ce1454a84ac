"""transformers' M2M100Tokenizer for `kvjax.tokenizer.huggingface` (whose docstring says what is
matched): one sentencepiece model (`sentencepiece.bpe.model`) cuts text into pieces that
`vocab.json` numbers, the language codes `__xx__` numbered after them, and a source framed as
`__src__` text `</s>`."""

from __future__ import annotations

import json
from typing import Any

from .marian import MarianBackend, _processor

# The codes of tokenizer_config.json's `language_codes`, in the order of their ids.
LANGUAGE_CODES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd "
        "gl gu ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg "
        "mk ml mn mr ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw "
        "ta th tl tn tr uk ur uz vi wo xh yi yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


class M2M100Backend(MarianBackend):
    """Marian's splitting and joining over one sentencepiece model and vocabulary; each
    language's `__xx__` a special token at the ids after vocab.json's (whether or not the
    files list it among the special tokens, as transformers 5 writes them without)."""

    reads_target_codes = False

    def __init__(self, files: dict[str, bytes], config: dict[str, Any],
                 named: dict[str, dict | None], extra: list[dict]):
        self._source = self._joiner = _processor(files, "sentencepiece.bpe.model")
        vocab = json.loads(files["vocab.json"].decode("utf-8"))
        which = config.get("language_codes", "m2m100")
        if which not in LANGUAGE_CODES:
            raise ValueError(f"tokenizer_config.json language_codes {which!r} is not one of "
                             f"{sorted(LANGUAGE_CODES)}")
        first = max(vocab.values(), default=-1) + 1
        languages = {f"__{code}__": first + i for i, code in enumerate(LANGUAGE_CODES[which])}
        self._vocab = {**vocab, **languages}
        self._pieces = {i: piece for piece, i in self._vocab.items()}
        listed = {spec["content"] for spec in extra}
        self._take_added_tokens(config, named, extra + [
            {"content": token} for token in languages if token not in listed])
        source = config.get("src_lang") or "en"
        if f"__{source}__" not in languages:
            raise ValueError(f"tokenizer_config.json src_lang {source!r} is not one of its "
                             f"{which} language codes")
        self._source_language = languages[f"__{source}__"]

    def affixes(self, eos_id: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self._source_language,), (() if eos_id is None else (eos_id,))

    def token_bytes(self, size: int) -> list[bytes | None]:
        raise ValueError("constrained decoding does not take an M2M100 tokenizer: its pieces "
                         "are joined by a sentencepiece model, not spelled byte by byte")
