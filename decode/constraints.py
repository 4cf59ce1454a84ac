"""Constrained output: text that must match a regular expression, be one of a list of choices,
or be JSON valid against a schema, compiled ahead of time into a token-level automaton; or
output that starts with given token ids (`StartsWith`, a translator's target language).

A constraint (`Regex`, `Choice`, `JsonSchema`) is a regular language over bytes;
`AllowedTokens` (a set of ids allowed at every step) and `StartsWith` are read by id.
`compile_constraint` turns it, for one tokenizer's vocabulary, into a `TokenAutomaton` (built
by `outlines-core`): in each state, the tokens whose bytes keep the text inside the language,
and the state each leads to. The end id is allowed exactly in accepting states, so a row
stops only on complete text. The decode loop carries each row's state and masks its logits
with it, all traced (`automaton.py`); nothing goes back to the host per token.

Compiled automata are cached per (constraint, tokenizer, end id). JSON Schema keywords that
the automaton cannot enforce (`minimum`, `uniqueItems`, ...) are refused by name rather than
ignored, so every complete output validates.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
import weakref
from typing import Any

import numpy as np

# Keywords whose meaning the automaton enforces, and those that never affect validity.
_ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "enum", "const",
    "anyOf", "$ref", "$defs", "definitions"})
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
    "writeOnly", "deprecated"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
# The characters Rust's regex syntax (outlines-core's) gives a meaning.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
_CACHED_AUTOMATA = 64  # per tokenizer


@dataclasses.dataclass(frozen=True)
class Regex:
    """Text matching `pattern` (Rust regex syntax, anchored at both ends)."""

    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Regex pattern must be a non-empty string, got {self.pattern!r}")

    def regex(self) -> str:
        return self.pattern


@dataclasses.dataclass(frozen=True)
class Choice:
    """Exactly one of `options` (strings)."""

    options: tuple[str, ...]

    def __post_init__(self):
        options = (self.options,) if isinstance(self.options, str) else tuple(self.options)
        for i, option in enumerate(options):
            if not isinstance(option, str) or not option:
                raise ValueError(f"choice {i} ({option!r}) must be a non-empty string")
        if not options:
            raise ValueError("Choice needs at least one option")
        object.__setattr__(self, "options", options)

    def regex(self) -> str:
        return "|".join("".join("\\" + c if c in _REGEX_META else c for c in option)
                        for option in self.options)


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """JSON text valid against `schema` (a dict, or its JSON text); `{"type": "object"}` is
    any JSON object. Whitespace between tokens is at most one space."""

    schema: str

    def __post_init__(self):
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON Schema is not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON Schema is an object, got {type(schema).__name__}")
        check_schema(schema)
        object.__setattr__(self, "schema", json.dumps(schema))

    def regex(self) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return build_regex_from_schema(self.schema)
        except (ValueError, TypeError) as e:
            message = " ".join(str(e).split())
            raise ValueError(f"cannot compile the JSON Schema: {message}") from None


@dataclasses.dataclass(frozen=True)
class StartsWith:
    """Output whose first tokens are `token_ids`, any tokens after them: a translator told
    its target language by the first target token (NLLB's and M2M100's, transformers'
    `forced_bos_token_id`). Ids, not text: no tokenizer's bytes are read."""

    token_ids: tuple[int, ...]

    def __post_init__(self):
        ids = (self.token_ids,) if isinstance(self.token_ids, int) else tuple(self.token_ids)
        if not ids or not all(isinstance(i, int | np.integer) and not isinstance(i, bool)
                              and i >= 0 for i in ids):
            raise ValueError(f"StartsWith needs token ids >= 0, got {self.token_ids!r}")
        object.__setattr__(self, "token_ids", tuple(int(i) for i in ids))

    @classmethod
    def from_text(cls, tokenizer, text: str, name: str = "text") -> StartsWith:
        """The constraint of `text`, which must be one token of `tokenizer` (a language's
        code: NLLB's `fra_Latn`); `name` is what the error calls it."""
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise ValueError(f"{name} {text!r} is not one token of this tokenizer (it reads "
                             f"as {len(ids)}: {ids})")
        return cls(tuple(ids))


@dataclasses.dataclass(frozen=True)
class AllowedTokens:
    """Output made of `token_ids` alone, at every step (vLLM's `allowed_token_ids`): the end
    id ends it only if it is among them. Ids, not text: no tokenizer's bytes are read."""

    token_ids: tuple[int, ...]

    def __post_init__(self):
        ids = tuple(self.token_ids) if isinstance(self.token_ids, list | tuple) else ()
        if not ids or not all(isinstance(i, int | np.integer) and not isinstance(i, bool)
                              and i >= 0 for i in ids):
            raise ValueError(f"AllowedTokens needs a non-empty list of token ids >= 0, got "
                             f"{self.token_ids!r}")
        object.__setattr__(self, "token_ids", tuple(sorted({int(i) for i in ids})))


Constraint = Regex | Choice | JsonSchema | StartsWith | AllowedTokens


def check_schema(schema: Any, path: str = "#") -> None:
    """Raises a ValueError naming the first keyword (and where it is) whose rule a token
    automaton cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON Schema at {path} is a {type(schema).__name__}, not an object")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in _ENFORCED | _ANNOTATIONS:
            raise ValueError(f"JSON Schema keyword {key!r} (at {where}) is not supported in "
                             f"constrained output")
        if key in _SUBSCHEMA_MAPS:
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif key in _SUBSCHEMA_LISTS:
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            check_schema(value, where)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A constraint compiled for one vocabulary: states 0..S-1, `initial` first. State s
    allows the tokens `tokens[starts[s] : starts[s] + counts[s]]`, each leading to the state
    at the same place in `next_states`. `end_id` (allowed in accepting states only) ends
    the text."""

    constraint: Constraint
    end_id: int
    vocab_size: int
    initial: int
    starts: np.ndarray       # int32 per state
    counts: np.ndarray       # int32 per state
    tokens: np.ndarray       # int32 per transition
    next_states: np.ndarray  # int32 per transition

    @property
    def num_states(self) -> int:
        return int(self.counts.size)

    @property
    def given(self) -> np.ndarray:
        """bool per state: its one token is given, not chosen (a `StartsWith`'s, as
        transformers' `forced_bos_token_id` and a decoder's prompt are), so a beam search
        adds 0 for it to a beam's summed logprobs, as transformers scores a forced token."""
        if isinstance(self.constraint, StartsWith):
            return np.arange(self.num_states) < len(self.constraint.token_ids)
        return np.zeros(self.num_states, bool)

    def allowed(self, state: int) -> np.ndarray:
        """The token ids state `state` allows."""
        return self.tokens[self.starts[state]:self.starts[state] + self.counts[state]]

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`; a ValueError if `state` does not allow it."""
        where = np.flatnonzero(self.allowed(state) == token)
        if not where.size:
            raise ValueError(f"token {token} is not allowed in state {state}")
        return int(self.next_states[self.starts[state] + where[0]])


def compile_constraint(constraint: Constraint, tokenizer,
                       end_id: int | None = None) -> TokenAutomaton:
    """`constraint` as an automaton over `tokenizer`'s ids (`token_bytes()`), ended by
    `end_id` (default: its EOS). Cached per tokenizer, constraint and end id."""
    if not isinstance(constraint, Regex | Choice | JsonSchema | StartsWith | AllowedTokens):
        raise ValueError(f"a constraint is a decode.Regex, Choice, JsonSchema, StartsWith or "
                         f"AllowedTokens, got {type(constraint).__name__}")
    end_id = tokenizer.eos_id if end_id is None else int(end_id)
    if end_id is None or not 0 <= end_id < tokenizer.vocab_size:
        raise ValueError(f"constrained output needs an end id in the vocabulary, got {end_id}")
    if isinstance(constraint, StartsWith):
        return _starts_with(constraint, end_id, tokenizer.vocab_size)
    if isinstance(constraint, AllowedTokens):
        return _allowed_tokens(constraint, end_id, tokenizer.vocab_size)
    with _lock:
        cached = _cache.setdefault(tokenizer, {"vocabularies": {},
                                               "automata": collections.OrderedDict()})
        automata = cached["automata"]
        if (constraint, end_id) in automata:
            automata.move_to_end((constraint, end_id))
            return automata[constraint, end_id]
        vocabulary = cached["vocabularies"].get(end_id)
        if vocabulary is None:
            vocabulary = cached["vocabularies"][end_id] = _vocabulary(tokenizer, end_id)
    automaton = _build(constraint, vocabulary, end_id, tokenizer.vocab_size)
    with _lock:
        automata[constraint, end_id] = automaton
        while len(automata) > _CACHED_AUTOMATA:
            automata.popitem(last=False)
    return automaton


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# outlines-core keeps a token only if the text it reaches is a full match or no match yet;
# its DFA reports a match one byte late, so a one-byte token that leaves a complete text for
# an incomplete one (after "no" in "no|not") is lost. Matching `regex` and then a sentinel
# character that a fake token spells avoids it: no state before the sentinel is a match.
# The states the fake token leaves from are those where the text is complete; real tokens
# that spell the sentinel are dropped, with the states only they lead to.
_SENTINEL = "\ufdd0"  # a noncharacter: never meant to appear in text


def _vocabulary(tokenizer, end_id: int):
    """outlines-core's vocabulary: every token that stands for text, by its bytes, and the
    sentinel's fake token (id `vocab_size`)."""
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = collections.defaultdict(list)
    stop_ids = set(tokenizer.stop_ids) | {end_id}
    for i, data in enumerate(tokenizer.token_bytes()):
        if data and i not in stop_ids:
            by_bytes[data].append(i)
    by_bytes[_SENTINEL.encode()].append(tokenizer.vocab_size)
    return Vocabulary(end_id, dict(by_bytes))


@functools.lru_cache(maxsize=_CACHED_AUTOMATA)
def _starts_with(constraint: StartsWith, end_id: int, vocab_size: int) -> TokenAutomaton:
    """State i < k allows the i-th forced token alone; state k, every token (the end id
    too), staying there. One automaton per constraint, end id and vocabulary size, as
    compiled programs' tables are kept per automaton."""
    forced = np.array(constraint.token_ids, np.int32)
    if forced.max() >= vocab_size:
        raise ValueError(f"StartsWith token {int(forced.max())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    k = forced.size
    counts = np.array([1] * k + [vocab_size], np.int32)
    starts = np.arange(k + 1, dtype=np.int32)
    tokens = np.concatenate([forced, np.arange(vocab_size, dtype=np.int32)])
    next_states = np.concatenate([np.arange(1, k + 1), np.full(vocab_size, k)]).astype(np.int32)
    return TokenAutomaton(constraint, end_id, vocab_size, 0, starts, counts, tokens,
                          next_states)


@functools.lru_cache(maxsize=_CACHED_AUTOMATA)
def _allowed_tokens(constraint: AllowedTokens, end_id: int, vocab_size: int) -> TokenAutomaton:
    """One state, allowing the listed ids and staying there."""
    tokens = np.array(constraint.token_ids, np.int32)
    if tokens.max() >= vocab_size:
        raise ValueError(f"allowed token {int(tokens.max())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return TokenAutomaton(constraint, end_id, vocab_size, 0, np.zeros(1, np.int32),
                          np.array([tokens.size], np.int32), tokens,
                          np.zeros(tokens.size, np.int32))


def _build(constraint: Constraint, vocabulary, end_id: int, vocab_size: int) -> TokenAutomaton:
    from outlines_core import Index

    try:
        index = Index(f"(?:{constraint.regex()}){_SENTINEL}", vocabulary)
    except (ValueError, TypeError) as e:
        message = " ".join(str(e).replace(_SENTINEL, "").split())
        raise ValueError(f"cannot compile {type(constraint).__name__} for this vocabulary: "
                         f"{message}") from None
    finals = set(index.get_final_states())
    transitions = index.get_transitions()  # a copy of the whole index on every call
    complete = {s for s, out in transitions.items() if vocab_size in out}
    edges = {s: {t: n for t, n in out.items() if t < vocab_size and t != end_id
                 and n not in finals}
             for s, out in transitions.items() if s not in finals}
    # Drop the states that lead nowhere but to the sentinel, until none is left.
    while dead := {n for out in edges.values() for n in out.values()
                   if not edges.get(n) and n not in complete}:
        edges = {s: {t: n for t, n in out.items() if n not in dead} for s, out in edges.items()}
    for s in complete:
        edges.setdefault(s, {})[end_id] = s
    initial = index.get_initial_state()
    order, seen = [initial], {initial}  # the states reachable from the initial one
    for s in order:
        for n in edges.get(s, {}).values():
            if n not in seen:
                seen.add(n)
                order.append(n)
    number = {s: i for i, s in enumerate(order)}
    rows = [sorted(edges.get(s, {}).items()) for s in order]
    counts = np.array([len(r) for r in rows], np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    tokens = np.array([t for r in rows for t, _ in r], np.int32)
    next_states = np.array([number[n] for r in rows for _, n in r], np.int32)
    return TokenAutomaton(constraint, end_id, vocab_size, 0, starts, counts, tokens,
                          next_states)
