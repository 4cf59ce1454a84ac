"""Tokenizers of Hugging Face model directories, behind kvjax's `TextTokenizer` interface.

`load_tokenizer(directory)` gives the ids transformers 5's `AutoTokenizer` gives, reading
the directory by the files present:

- `tokenizer.json` (GPT-2, SmolLM, Qwen2, Llama 3, TinyLlama): run by the `tokenizers`
  package, with what its post-processor puts around a text (transformers ignores
  `add_bos_token` then): Llama 3 starts with `<|begin_of_text|>`, GPT-2 with nothing. For a
  GPT2Tokenizer, Qwen2Tokenizer (which any qwen2 model gets) or LlamaTokenizer, transformers
  takes only the vocabulary, merges and post-processor from the file and builds the rest in
  code; so does kvjax. A "LlamaTokenizer" whose file is byte-level (Llama 3) runs as written.
- `tokenizer.model` alone, for a LlamaTokenizer (Llama 2 style): transformers 5 does not run
  sentencepiece. It reads the pieces, in id order, as a byte-fallback BPE vocabulary, derives
  merges from it (lowest merged id first) and splits with Metaspace, ignoring the model's
  normalizer spec; kvjax builds the same. A BPE model then gives sentencepiece's pieces but
  for spaces (no dummy prefix doubles a leading space); a unigram model is read as BPE too
  (mostly a piece per character). `legacy: true` puts the `▁` prefix after each special
  token as well, `legacy: false` (default) only at the start, `add_prefix_space: false`
  nowhere. BOS goes first if `add_bos_token` is true (a missing key: false, as there).
- `vocab.json` and `merges.txt` (GPT-2's files from before tokenizer.json; OPT's), for a
  GPT2Tokenizer or Qwen2Tokenizer: the pipeline transformers builds for the class from
  them, BOS first if `add_bos_token` (OPT's `</s>`) and EOS last if `add_eos_token`.
- NLLB's, BART's and mBART's tokenizer.json (`NllbTokenizer`, `BartTokenizer`,
  `MBartTokenizer`, `MBart50Tokenizer`): transformers 5 takes the vocabulary (and merges, and
  sentencepiece charsmap) from the file and builds the rest in code, its template from
  tokenizer_config.json's `src_lang`; so does kvjax (`pipelines.py`).
- Marian (`source.spm`, `target.spm`, `vocab.json`), as `MarianTokenizer`: text is split at
  special tokens, a leading `>>xx<<` code kept whole, the rest cut into source.spm pieces
  mapped through vocab.json (a piece not in it is `<unk>`); `</s>` ends the source. Decoding
  maps ids back through vocab.json and joins the pieces with source.spm, as transformers
  5.23 does unless `separate_vocabs` (then target_vocab.json and target.spm); `<unk>` is
  special there, so decoding leaves it out.
- M2M100 (`sentencepiece.bpe.model`, `vocab.json`), as `M2M100Tokenizer`: Marian's way with
  one sentencepiece model and vocabulary, each language's `__xx__` a special token numbered
  after vocab.json's ids (in the order of `language_codes`, m2m100's 100 or wmt21's 8); a
  source starts with `src_lang`'s code (en where absent) and ends with `</s>`. transformers 5
  writes the directory without the codes among its special tokens, and then reads them as
  text; kvjax reads them as the released directories list them, special.

Special tokens come from tokenizer.json, tokenizer_config.json (or special_tokens_map.json)
and the defaults of the class transformers would pick; `stop_ids` add generation_config.json's
`eos_token_id`, `target_prefix` is its `forced_bos_token_id`, `forced_end` its
`forced_eos_token_id`, `banned_ids` its one-token `bad_words_ids` and `bad_words` the longer
ones (config.json's where the directory has no generation_config.json, as transformers reads
them) and `sampling_defaults` its sampling settings (`generation_rules.py`). `chat_template` is
the template `apply_chat_template` would render (from chat_template.jinja or
tokenizer_config.json; `kvjax.serve.chat` renders it as transformers does), with
`special_tokens` its named tokens' texts. `to_bytes` is a JSON bundle of the
files read, which `from_bundle` (and `kvjax.tokenizer.tokenizer_from_bytes`) reads back:
{"format": "kvjax-hf-tokenizer", "version": 1, "kind", "tokenizer_class", "files": {name:
{"text" or "base64": ...}}}.
The `tokenizers` package is needed for all but Marian and M2M100.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .generation_rules import GenerationRules
from .m2m100 import M2M100Backend
from .marian import MarianBackend
from .tokenizers_backend import TokenizersBackend, extra_specials, token_spec

BUNDLE_FORMAT = "kvjax-hf-tokenizer"
BUNDLE_VERSION = 1

# kind -> the files it needs, in the order transformers prefers them.
_KINDS = {"marian": ("source.spm", "target.spm", "vocab.json"),
          "m2m100": ("sentencepiece.bpe.model", "vocab.json"),
          "tokenizer.json": ("tokenizer.json",), "tokenizer.model": ("tokenizer.model",),
          "vocab.json": ("vocab.json", "merges.txt")}
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "target_vocab.json", "chat_template.jinja")
_BINARY_SUFFIXES = (".model", ".spm")
_LOOKED_FOR = ("tokenizer.json, tokenizer.model, vocab.json + merges.txt, source.spm + "
               "target.spm + vocab.json, or sentencepiece.bpe.model + vocab.json")

# The kinds run by sentencepiece and a vocab.json, not by `tokenizers`.
_SENTENCEPIECE_BACKENDS = {"marian": MarianBackend, "m2m100": M2M100Backend}

_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
          "mask_token")
# The special tokens a transformers class assumes where tokenizer_config.json names none.
_END = "<|endoftext|>"
_CLASS_DEFAULTS = {
    "GPT2Tokenizer": {"bos_token": _END, "eos_token": _END, "unk_token": _END},
    "Qwen2Tokenizer": {"eos_token": _END, "pad_token": _END, "unk_token": _END},
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "MarianTokenizer": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "M2M100Tokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                        "pad_token": "<pad>", "sep_token": "</s>"},
    "NllbTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                      "pad_token": "<pad>"},
    "MBartTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                       "pad_token": "<pad>", "sep_token": "</s>", "cls_token": "<s>",
                       "mask_token": "<mask>"},
    "MBart50Tokenizer": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                         "sep_token": "</s>", "cls_token": "<s>", "mask_token": "<mask>"},
    "RobertaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                         "pad_token": "<pad>", "sep_token": "</s>", "cls_token": "<s>",
                         "mask_token": "<mask>"},
}
# The class transformers picks by config.json's model_type when tokenizer_config.json names
# none (for "llama" it has none: the generic backend).
_MODEL_TYPE_CLASSES = {"gpt2": "GPT2Tokenizer", "qwen2": "Qwen2Tokenizer",
                       "qwen3": "Qwen2Tokenizer", "marian": "MarianTokenizer",
                       "opt": "GPT2Tokenizer", "bart": "RobertaTokenizer",
                       "mbart": "MBartTokenizer", "m2m_100": "M2M100Tokenizer"}
# transformers' other names of the classes above.
_ALIASES = {"BartTokenizer": "RobertaTokenizer"}


class HFTokenizer:
    """A Hugging Face directory's tokenizer as a `kvjax.tokenizer.TextTokenizer`; see the
    module docstring for what it reproduces. Made by `load_tokenizer` or `from_bundle`."""

    def __init__(self, kind: str, tokenizer_class: str, files: dict[str, bytes]):
        self.kind, self.tokenizer_class = kind, tokenizer_class
        self._files = dict(files)
        config = _json_file(files, "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # transformers reads the older file then
            config = {**config, **_json_file(files, "special_tokens_map.json")}
        named = {key: token_spec(config.get(key, _CLASS_DEFAULTS.get(tokenizer_class, {})
                                             .get(key))) for key in _NAMED}
        # Other "*_token" strings (image_token, ...) are special tokens too.
        named.update({key: token_spec(value) for key, value in config.items()
                      if key.endswith("_token") and key not in named and isinstance(value, str)})
        # What a chat template reads besides the messages: {"bos_token": "<s>", ...}.
        self.special_tokens = {key: spec["content"] for key, spec in named.items() if spec}
        self.chat_template = _chat_template(files, config)
        self.tool_chat_template = _chat_template(files, config, "tool_use")
        if kind in _SENTENCEPIECE_BACKENDS:
            self._backend = _SENTENCEPIECE_BACKENDS[kind](files, config, named,
                                                          extra_specials(config) or [])
        else:
            self._backend = TokenizersBackend(kind, tokenizer_class, files, config, named)
        self._known = known = self._backend.known_ids
        self.vocab_size = int(known.size)
        ids = {key: self._backend.token_id(spec) for key, spec in named.items()}
        self.pad_id, self.bos_id = ids["pad_token"], ids["bos_token"]
        self.eos_id, self.unk_id = ids["eos_token"], ids["unk_token"]
        self.document_prefix, self.source_suffix = self._backend.affixes(self.eos_id)
        # An encoder-decoder's source is a text as the tokenizer frames it (NLLB: its code).
        self.source_prefix = self.document_prefix
        rules = GenerationRules.read(_json_file(files, "generation_config.json"), self.eos_id,
                                     known)
        self.stop_ids, self.target_prefix = rules.stop_ids, rules.target_prefix
        self.forced_end, self.banned_ids = rules.forced_end, rules.banned_ids
        self.bad_words = rules.bad_words
        self.sampling_defaults = dict(rules.sampling)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special ids added; special-token strings in it are read as
        their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self._backend.encode(text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any 1-D sequence or array), special tokens left out unless
        `skip_special_tokens` is False."""
        return self._backend.decode(self._known_ids(ids), skip_special_tokens)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return self._backend.pieces(self._known_ids(ids))

    def _known_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size or not self._known[i]:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def token_bytes(self) -> list[bytes | None]:
        """[vocab_size] the bytes each id stands for, None for special tokens
        (`token_bytes.py`)."""
        return self._backend.token_bytes(self.vocab_size)

    def to_bytes(self) -> bytes:
        files = {name: {"base64": base64.b64encode(data).decode("ascii")}
                 if name.endswith(_BINARY_SUFFIXES) else {"text": data.decode("utf-8")}
                 for name, data in sorted(self._files.items())}
        bundle = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "kind": self.kind,
                  "tokenizer_class": self.tokenizer_class, "files": files}
        return json.dumps(bundle, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def __repr__(self) -> str:
        return (f"HFTokenizer(kind={self.kind!r}, tokenizer_class={self.tokenizer_class!r}, "
                f"vocab_size={self.vocab_size})")


def load_tokenizer(directory: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of the Hugging Face model in `directory`; a directory without one, or
    with one that cannot be read, is a one-line ValueError naming it."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    kind = next((k for k, needed in _KINDS.items()
                 if all((path / name).is_file() for name in needed)), None)
    if kind is None:
        raise ValueError(f"{path} has no Hugging Face tokenizer (looked for {_LOOKED_FOR})")
    files = {name: (path / name).read_bytes() for name in _KINDS[kind] + _SIDE_FILES
             if (path / name).is_file()}
    try:
        model_config = json.loads((path / "config.json").read_text("utf-8"))
        model_type = model_config.get("model_type")
    except (OSError, ValueError, AttributeError):
        model_config, model_type = {}, None
    rules = {key: model_config.get(key) for key in ("forced_bos_token_id",
                                                    "forced_eos_token_id", "bad_words_ids")
             if model_config.get(key) is not None}
    if "generation_config.json" not in files and rules:
        # transformers' generate reads its settings from config.json where the directory has
        # no generation_config.json: the tokens it forces and bans are kept as that file.
        files["generation_config.json"] = json.dumps(rules).encode()
    try:
        tokenizer_class = _tokenizer_class(kind, files, model_type)
    except ValueError as e:  # a malformed tokenizer_config.json included
        raise ValueError(f"{path}: {_one_line(e)}") from None
    return _build(kind, tokenizer_class, files, str(path))


def from_bundle(data: bytes) -> HFTokenizer:
    """The tokenizer whose `to_bytes` gave `data`."""
    try:
        bundle = json.loads(bytes(data).decode("utf-8"))
        if bundle.get("format") != BUNDLE_FORMAT or bundle.get("version") != BUNDLE_VERSION:
            raise ValueError(f"format {bundle.get('format')!r} version {bundle.get('version')!r}")
        files = {name: base64.b64decode(entry["base64"], validate=True) if "base64" in entry
                 else entry["text"].encode("utf-8") for name, entry in bundle["files"].items()}
        kind, tokenizer_class = bundle["kind"], bundle["tokenizer_class"]
    except Exception as e:  # any malformation is the same error to the caller
        raise ValueError(f"not a {BUNDLE_FORMAT} bundle: {_one_line(e)}") from None
    if kind not in _KINDS:
        raise ValueError(f"not a {BUNDLE_FORMAT} bundle: unknown kind {kind!r}")
    return _build(kind, tokenizer_class, files, "tokenizer bundle")


def _build(kind: str, tokenizer_class: str, files: dict[str, bytes], where: str) -> HFTokenizer:
    try:
        return HFTokenizer(kind, tokenizer_class, files)
    except ImportError as e:
        raise ImportError(f"{where}: reading a {kind} tokenizer needs the `tokenizers` package "
                          f"(pip install tokenizers): {e}") from None
    except Exception as e:  # tokenizers raises a plain Exception for a bad file
        raise ValueError(f"{where}: cannot read its {kind} tokenizer: {_one_line(e)}") from None


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [""]
    # A ValueError's message says what is wrong; for others (KeyError 'model') the type does.
    return lines[0] if isinstance(error, ValueError) else f"{type(error).__name__}: {lines[0]}"


def _tokenizer_class(kind: str, files: dict[str, bytes], model_type: str | None) -> str:
    """The class transformers would load the directory with, as far as kvjax cares: it
    decides the default special tokens and which pipeline is built in code."""
    declared = _json_file(files, "tokenizer_config.json").get("tokenizer_class")
    name = (declared or "").removesuffix("Fast") or _MODEL_TYPE_CLASSES.get(model_type, "")
    name = _ALIASES.get(name, name)
    if model_type == "qwen2":  # transformers overrides any class a qwen2 model names
        name = "Qwen2Tokenizer"
    if kind == "marian":
        return "MarianTokenizer"
    if kind == "m2m100":
        if name != "M2M100Tokenizer":
            raise ValueError(f"sentencepiece.bpe.model and vocab.json are read for an "
                             f"M2M100Tokenizer only (named by tokenizer_config.json's "
                             f"tokenizer_class, or by config.json's model_type), not for "
                             f"{name or 'a directory that names no class'}")
        return name
    if kind == "vocab.json":
        if name not in ("GPT2Tokenizer", "Qwen2Tokenizer"):
            raise ValueError("vocab.json and merges.txt are read for a GPT2Tokenizer or "
                             "Qwen2Tokenizer only (named by tokenizer_config.json's "
                             "tokenizer_class, or by config.json's model_type), not for "
                             f"{name or 'a directory that names no class'}")
        return name
    if kind == "tokenizer.model":
        # transformers reads other classes' sentencepiece models by their own rules.
        if name != "LlamaTokenizer":
            raise ValueError(f"tokenizer.model is read for a LlamaTokenizer only (named by "
                             f"tokenizer_config.json's tokenizer_class), not for "
                             f"{name or 'a directory that names no class'}")
        return name
    # transformers loads a "LlamaTokenizer" whose tokenizer.json is byte-level (Llama 3) as
    # written instead: LlamaTokenizer would impose Metaspace.
    if name == "LlamaTokenizer" and b'"ByteLevel"' in files["tokenizer.json"]:
        return "TokenizersBackend"
    return name or "TokenizersBackend"


def _json_file(files: dict[str, bytes], name: str) -> dict[str, Any]:
    value = json.loads(files[name].decode("utf-8")) if name in files else {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} holds a {type(value).__name__}, not an object")
    return value


def _chat_template(files: dict[str, bytes], config: dict[str, Any],
                   name: str = "default") -> str | None:
    """The Jinja2 chat template transformers uses by default: chat_template.jinja, else
    tokenizer_config.json's `chat_template`, a string or a list of named templates (then the
    one named "default"); None for none. With another `name`, only the template of that
    name in such a list ("tool_use": the one transformers renders tools with)."""
    if "chat_template.jinja" in files and name == "default":
        return files["chat_template.jinja"].decode("utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == name), None)
    elif name != "default":
        return None
    return template if isinstance(template, str) and template else None
