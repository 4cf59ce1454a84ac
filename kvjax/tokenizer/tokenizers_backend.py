"""The `tokenizers` library's side of a Hugging Face tokenizer (`huggingface.py`): a
`tokenizers.Tokenizer` built from a directory's tokenizer.json, tokenizer.model or vocab.json +
merges.txt as transformers' TokenizersBackend builds it, the classes transformers rebuilds in
code rebuilt the same way (`pipelines.py`), with the added and special tokens in transformers'
order; and how tokenizer_config.json writes a special token.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import pipelines, token_bytes
from .marian import clean_up_spaces


def token_spec(value: Any) -> dict[str, Any] | None:
    """A special token as tokenizer_config.json writes it (a string or an AddedToken's
    fields), as AddedToken fields; None for none."""
    if isinstance(value, str):
        return {"content": value}
    fields = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
    return None if value is None else {k: v for k, v in value.items() if k in fields}


def extra_specials(config: dict[str, Any]) -> list[dict[str, Any]] | None:
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    if isinstance(extra, dict):  # {"image_token": "<image>"}: special tokens by name
        extra = list(extra.values())
    return None if extra is None else [token_spec(t) for t in extra]


class TokenizersBackend:
    """A `tokenizers.Tokenizer` set up as transformers' TokenizersBackend sets it up."""

    def __init__(self, kind: str, tokenizer_class: str, files: dict[str, bytes],
                 config: dict[str, Any], named: dict[str, dict | None]):
        from tokenizers import Tokenizer, processors

        added = config.get("added_tokens_decoder")
        extra = extra_specials(config)
        if kind == "tokenizer.json":
            text = files["tokenizer.json"].decode("utf-8")
            tokenizer = Tokenizer.from_str(text)
            if tokenizer_class in pipelines.REBUILT:
                data = json.loads(text)
                merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                          for m in data["model"].get("merges", ())]  # a unigram's: none
                rebuilt = pipelines.REBUILT[tokenizer_class](data["model"]["vocab"], merges, config)
                rebuilt.post_processor = tokenizer.post_processor
                if tokenizer_class in pipelines.NORMALIZERS:
                    rebuilt.normalizer = pipelines.NORMALIZERS[tokenizer_class](data)
                if added is None:  # then transformers takes them from tokenizer.json
                    added = {t["id"]: t for t in data.get("added_tokens", [])}
                tokenizer = rebuilt
        elif kind == "vocab.json":  # GPT-2's files from before tokenizer.json (OPT's)
            vocab = json.loads(files["vocab.json"].decode("utf-8"))
            merges = pipelines.read_merges(files["merges.txt"].decode("utf-8"))
            tokenizer = pipelines.REBUILT[tokenizer_class](vocab, merges, config)
        else:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(files["tokenizer.model"])
            if not proto.pieces:
                raise ValueError("tokenizer.model has no pieces")
            vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
            tokenizer = pipelines.llama_pipeline(vocab, pipelines.merges_of(vocab), config)
            if extra is None:  # control pieces are special, user-defined ones plain
                extra = [{"content": p.piece, "normalized": False, "special": p.type == 3}
                         for p in proto.pieces if p.type in (3, 4)]
        tokenizer.no_truncation()
        tokenizer.no_padding()
        _add_tokens(tokenizer, added or {}, named, extra or [])
        if tokenizer_class in pipelines.TEMPLATES:
            tokenizer.post_processor = pipelines.TEMPLATES[tokenizer_class](
                tokenizer, config, named)
        if kind != "tokenizer.json":  # transformers' template from add_bos/eos_token
            ends = [(named[k], bool(config.get(f"add_{k}"))) for k in ("bos_token", "eos_token")]
            ends = [spec["content"] if spec and on else None for spec, on in ends]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=" ".join(t for t in (ends[0], "$A", ends[1]) if t),
                special_tokens=[(t, tokenizer.token_to_id(t)) for t in ends if t])
        self._tokenizer = tokenizer
        self._clean_up = (bool(config.get("clean_up_tokenization_spaces"))
                          and type(tokenizer.model).__name__ != "BPE")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.known_ids = np.zeros(max(vocab.values(), default=-1) + 1, bool)
        self.known_ids[list(vocab.values())] = True

    def token_id(self, spec: dict | None) -> int | None:
        return None if spec is None else self._tokenizer.token_to_id(spec["content"])

    def affixes(self, eos_id: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What transformers' `encode(text)` (special tokens added) puts around the text."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain):])
        raise ValueError(f"its post-processor changes the text's own ids ({plain} -> {full})")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def token_bytes(self, size: int) -> list[bytes | None]:
        decoder = json.dumps(json.loads(self._tokenizer.to_str()).get("decoder"))
        if '"ByteLevel"' in decoder:
            spell = token_bytes.byte_level
        elif '"ByteFallback"' in decoder:
            spell = token_bytes.byte_fallback
        else:
            raise ValueError(f"cannot tell the bytes of this tokenizer's tokens: its decoder "
                             f"is neither byte-level nor byte-fallback ({decoder[:80]})")
        pieces = [(i, spell(piece)) for piece, i in
                  self._tokenizer.get_vocab(with_added_tokens=False).items()]
        pieces += [(i, None if added.special else added.content.encode("utf-8"))
                   for i, added in self._tokenizer.get_added_tokens_decoder().items()]
        return token_bytes.table(size, pieces)

    def pieces(self, ids: list[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self._clean_up else text


def _add_tokens(tokenizer, added: dict, named: dict[str, dict | None],
                extra: list[dict]) -> None:
    """The added and special tokens, in the order transformers adds them (which decides the
    ids of tokens new to the vocabulary): tokenizer_config.json's added tokens, then the
    named special tokens, then the extra ones, each unless already there."""
    from tokenizers import AddedToken

    def token(spec: dict, special: bool) -> AddedToken:
        fields = {k: v for k, v in spec.items() if k != "id"}
        if special or len(fields) == 1:  # a bare string is a special token
            fields["special"] = True
        return AddedToken(**fields)

    present = tokenizer.get_added_tokens_decoder().values()
    reprs, contents = {repr(t) for t in present}, {t.content for t in present}
    new = [token(spec, False) for _, spec in sorted((int(i), s) for i, s in added.items())]
    new = [t for t in new if repr(t) not in reprs]
    contents |= {t.content for t in new}
    named_specs = [spec for spec in named.values() if spec is not None]
    for spec, special in [(s, True) for s in named_specs] + [(s, False) for s in extra]:
        if spec["content"] not in contents:
            new.append(token(spec, special))
            contents.add(spec["content"])
    tokenizer.add_tokens(new)
