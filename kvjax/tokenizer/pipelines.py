"""The tokenizer pipelines transformers 5 builds in code for some classes, from a vocabulary
and merges alone (of a tokenizer.json, of vocab.json and merges.txt, or derived from a
sentencepiece model; a unigram vocabulary's pieces and scores), leaving any normalizer,
pre-tokenizer and decoder of a file unused."""

from __future__ import annotations

from typing import Any

from .marian import SPACE


def byte_level_pipeline(vocab: dict[str, int], merges: list[tuple[str, str]],
                         config: dict[str, Any], qwen2: bool = False):
    """transformers 5's GPT2Tokenizer (ByteLevel's own split) or Qwen2Tokenizer (NFC, then
    Qwen2's split, then ByteLevel)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None,
                              continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")),
                                          use_regex=not qwen2)
    if qwen2:
        tokenizer.normalizer = normalizers.NFC()
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Split(
            Regex(_QWEN2_SPLIT), behavior="isolated", invert=False), byte_level])
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def llama_pipeline(vocab: dict[str, int], merges: list[tuple[str, str]],
                    config: dict[str, Any]):
    """transformers 5's LlamaTokenizer: byte-fallback BPE, Metaspace, no normalizer."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy") else "first") if prefix else "never"
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                              dropout=None))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE,
                                                       prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        steps + [decoders.Strip(content=" ", left=1)] * prefix)
    return tokenizer


def nllb_pipeline(vocab: dict[str, int], merges: list[tuple[str, str]],
                  config: dict[str, Any]):
    """transformers 5's NllbTokenizer: BPE without byte fallback, unknown pieces fused into
    one <unk>, Metaspace before every word; its normalizer is the file's charsmap
    (`nllb_normalizer`), its template the source language's (`nllb_template`)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    unk = config.get("unk_token") or "<unk>"
    unk = unk["content"] if isinstance(unk, dict) else unk
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=str(unk),
                              fuse_unk=True, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE,
                                                       prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always",
                                           split=True)
    return tokenizer


def mbart_pipeline(vocab: list, merges: list, config: dict[str, Any], fifty: bool = False):
    """transformers 5's MBartTokenizer (or, `fifty`, MBart50Tokenizer): a unigram model
    without byte fallback (`<unk>` at id 3), split at whitespace then marked with Metaspace
    before every word (MBart50: Metaspace alone); its normalizer is built from the file's
    charsmap (`mbart_normalizer`), its template from the source language (`mbart_template`)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import Unigram

    tokenizer = Tokenizer(Unigram([(str(piece), float(score)) for piece, score in vocab],
                                  unk_id=3, byte_fallback=False))
    metaspace = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    tokenizer.pre_tokenizer = metaspace if fifty else pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), metaspace])
    tokenizer.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always",
                                           split=True)
    return tokenizer


def _charsmap(file: dict[str, Any]) -> bytes | None:
    """The sentencepiece charsmap of a tokenizer.json's Precompiled normalizer (alone or in
    a sequence), None where it holds none."""
    import base64

    found = file.get("normalizer") or {}
    steps = found.get("normalizers", []) if found.get("type") == "Sequence" else [found]
    charsmap = next((step["precompiled_charsmap"] for step in steps
                     if step.get("type") == "Precompiled" and "precompiled_charsmap" in step),
                    None)
    return None if charsmap is None else base64.b64decode(charsmap)


def mbart_normalizer(file: dict[str, Any], fifty: bool = False):
    """The normalizer transformers' MBartTokenizer (MBart50Tokenizer) builds from a
    tokenizer.json: the file's charsmap where it holds one, trailing spaces stripped, then
    runs of spaces made one `▁` (MBart50: one space)."""
    from tokenizers import Regex, normalizers

    charsmap = _charsmap(file)
    steps = [normalizers.Precompiled(charsmap)] if charsmap is not None else []
    return normalizers.Sequence(steps + [normalizers.Strip(left=False, right=True),
                                         normalizers.Replace(Regex(" {2,}"),
                                                             " " if fifty else SPACE)])


def nllb_normalizer(file: dict[str, Any]):
    """The normalizer transformers' NllbTokenizer builds from a tokenizer.json: the
    sentencepiece charsmap the file holds (a Precompiled normalizer, alone or in a
    sequence), then runs of spaces made one; None where the file holds no charsmap."""
    from tokenizers import Regex, normalizers

    charsmap = _charsmap(file)
    if charsmap is None:
        return None
    return normalizers.Sequence([normalizers.Precompiled(charsmap),
                                 normalizers.Replace(Regex(" {2,}"), " ")])


def nllb_template(tokenizer, config: dict[str, Any], named: dict[str, Any]):
    """What transformers' NllbTokenizer puts around a text, whatever the file's
    post-processor: the source language's code (`src_lang`, English by default) first and
    its eos token last, or with `legacy_behaviour` both last (eos, then the code)."""
    order = ("$A", "eos", "code") if config.get("legacy_behaviour") else ("code", "$A", "eos")
    return _language_template(tokenizer, config, named, "eng_Latn", order)


def mbart_template(tokenizer, config: dict[str, Any], named: dict[str, Any],
                   fifty: bool = False):
    """What transformers' MBartTokenizer puts around a text, whatever the file's
    post-processor: its eos token, then the source language's code (`src_lang`, en_XX by
    default) after it; MBart50Tokenizer's the code first and the eos token last."""
    order = ("code", "$A", "eos") if fifty else ("$A", "eos", "code")
    return _language_template(tokenizer, config, named, "en_XX", order)


def _language_template(tokenizer, config: dict[str, Any], named: dict[str, Any],
                       default_language: str, order: tuple[str, ...]):
    """The source language's code (`src_lang`, else `default_language`) and the eos token
    around a text, in `order` (of "code", "$A" and "eos")."""
    from tokenizers import processors

    eos = (named["eos_token"] or {"content": "</s>"})["content"]
    language = config.get("src_lang") or default_language
    code = tokenizer.token_to_id(language)
    if code is None:
        raise ValueError(f"src_lang {language!r} is not a token of the vocabulary")
    pieces = {"code": language, "$A": "$A", "eos": eos}
    return processors.TemplateProcessing(
        single=[pieces[piece] for piece in order],
        special_tokens=[(eos, tokenizer.token_to_id(eos)), (language, code)])


def roberta_template(tokenizer, config: dict[str, Any], named: dict[str, Any]):
    """What transformers' RobertaTokenizer (BART's) puts around a text, whatever the file's
    post-processor: its cls token first and its sep token last."""
    from tokenizers import processors

    ends = [(named[key] or {"content": default})["content"]
            for key, default in (("sep_token", "</s>"), ("cls_token", "<s>"))]
    return processors.RobertaProcessing(
        *[(end, tokenizer.token_to_id(end)) for end in ends],
        trim_offsets=bool(config.get("trim_offsets", True)),
        add_prefix_space=bool(config.get("add_prefix_space", False)))


# The classes whose pipeline transformers 5 builds in code from a vocabulary and merges.
REBUILT = {"GPT2Tokenizer": byte_level_pipeline, "LlamaTokenizer": llama_pipeline,
            "Qwen2Tokenizer": lambda *args: byte_level_pipeline(*args, qwen2=True),
            "RobertaTokenizer": byte_level_pipeline, "NllbTokenizer": nllb_pipeline,
            "MBartTokenizer": mbart_pipeline,
            "MBart50Tokenizer": lambda *args: mbart_pipeline(*args, fifty=True)}
# The normalizer of a rebuilt class where it is not None: tokenizer.json's data -> normalizer.
NORMALIZERS = {"NllbTokenizer": nllb_normalizer, "MBartTokenizer": mbart_normalizer,
               "MBart50Tokenizer": lambda file: mbart_normalizer(file, fifty=True)}
# The classes whose template transformers 5 builds from their settings, not the file's
# post-processor: (tokenizer, tokenizer_config.json, named special tokens) -> template.
TEMPLATES = {"NllbTokenizer": nllb_template, "RobertaTokenizer": roberta_template,
             "MBartTokenizer": mbart_template,
             "MBart50Tokenizer": lambda *args: mbart_template(*args, fifty=True)}
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def merges_of(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges of a vocabulary, as transformers derives them from a sentencepiece model:
    every split of every piece into two pieces, ordered by the merged piece's id."""
    merges = []
    for piece, rank in vocab.items():
        local = [(piece[:k], piece[k:], rank) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in merges]


def read_merges(text: str) -> list[tuple[str, str]]:
    """The merges of a merges.txt as transformers reads them: every line of two tokens apart
    from comments (the `#version` line)."""
    pairs = [line.split() for line in map(str.strip, text.splitlines())
             if line and not line.startswith("#")]
    return [(pair[0], pair[1]) for pair in pairs if len(pair) == 2]
