"""What a caller asks the engine for, checked before it is queued, and what comes back.

A `GenerationRequest` holds token ids and settings; `checked` raises a ValueError naming the
first bad value (the server answers it with a 400), so nothing that reaches a slot can fail
there. The engine answers with `Delta`s, one per sample each time the sample has new tokens,
the last one with its `finish_reason`.
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np

from kvjax.decode import bad_words, checks
from kvjax.decode.constraints import TokenAutomaton
from kvjax.decode.processors import RowLogitBias
from kvjax.decode.sampling import SamplingParams, seed_key
from kvjax.decode.settings import GREEDY, Sampling
from kvjax.detokenize import check_stop_strings
from kvjax.text import MAX_SEED

from .slots import (
    MAX_BANNED_IDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    MAX_TOP_LOGPROBS,
    PRIORITY_BOUND,
    RowSettings,
)

LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how to continue it.

    prompt:      token ids, as the model reads them (any prefix such as BOS included).
    max_tokens:  at most this many new tokens per sample; prompt + max_tokens must fit a
                 slot's capacity.
    n:           samples of the prompt, from one prefill.
    sampling:    how each sample chooses its tokens, as `decode.generate` takes it (one
                 value per setting).
    logit_bias:  {token id: bias in [-100, 100]} (or its (id, bias) pairs), added to those
                 tokens' logits after the penalties, as `decode.LogitBias` adds it in
                 `generate`; at most `MAX_LOGIT_BIAS` tokens.
    stop_ids:    token ids that end a sample (included in its tokens, not in its text).
    forced_end_id: the token a sample makes last when it reaches `max_tokens`, as
                 `decode.generate` forces it (a translator's `forced_eos_token_id`), or None.
    banned_ids:  token ids a sample never makes (a generation config's one-token
                 `bad_words_ids`, Marian's pad), at most `MAX_BANNED_IDS`.
    bad_words:   token sequences a sample never completes, as vLLM's `bad_words` ban them
                 (`decode.bad_words`; `word_ids` tokenizes texts): at most 32, each of 1
                 to 8 ids. A beam search matches them against the prompt's tokens too, as
                 `decode.beam_search` does.
    stop:        strings that end a sample's text (neither streamed nor returned, unless
                 `include_stop`: then the one met ends it, as vLLM's
                 `include_stop_str_in_output`).
    skip_special_tokens: False writes special tokens into the text (vLLM's, as
                 transformers' `decode` takes it); ids that end a sample never are.
    seed:        the sample's tokens depend on it and on nothing else the batch holds;
                 None draws one.
    logprobs:    top logprobs to report per token (0: only the chosen token's).
    constraint:  the automaton every sample's tokens follow (`decode.compile_constraint`),
                 or None; its end id must be one of `stop_ids`.
    adapter:     which of the engine's LoRA adapters its rows add (`Engine(adapters=)`, 1
                 for the first), 0 for the base model alone.
    cache_salt:  a non-empty string: its prompt reuses kept prefixes (`prefix_cache.py`)
                 only of requests with the same salt, or None: of unsalted ones.
    priority:    lower values are served first (vLLM's): a request waits for those of a
                 lower value, then for those queued before it; when pages run short,
                 samples of the highest value are preempted first. In [-2**30, 2**30].
    beam_search: the `n` best hypotheses of a beam search `n` wide (vLLM's
                 `use_beam_search`, `decode.beam_search`), run between chunks
                 (`between_chunks.py`), scored with `length_penalty`; not with sampling,
                 a logit bias, stop strings, bad words or top logprobs.
    """

    prompt: tuple[int, ...]
    max_tokens: int = 16
    n: int = 1
    sampling: Sampling = GREEDY
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_ids: tuple[int, ...] = ()
    forced_end_id: int | None = None
    banned_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int = 0
    constraint: TokenAutomaton | None = None
    adapter: int = 0
    cache_salt: str | None = None
    include_stop: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    beam_search: bool = False
    length_penalty: float = 1.0

    def checked(self, vocab_size: int, capacity: int, prompt_slots: int | None = None,
                source_capacity: int | None = None) -> GenerationRequest:
        """This request with its seed drawn if None; a ValueError names the first bad value.
        `prompt_slots`: the target slots the prompt fills before the new tokens
        (`model.prompt_slots`), if not all its tokens: an encoder-decoder's prompt is its
        source, which a slot holds beside its target, within `source_capacity` (default
        `capacity`) and `capacity`."""
        prompt = checks.token_ids("prompt", self.prompt)
        if not prompt:
            raise checks.InvalidValue("prompt", "the prompt is empty: it needs at least one "
                                                "token")
        for token in prompt:
            if not 0 <= token < vocab_size:
                raise checks.InvalidValue("prompt", f"prompt token id {token} is outside the "
                                                    f"vocabulary [0, {vocab_size})")
        max_tokens = checks.integer("max_tokens", self.max_tokens, 1)
        if prompt_slots is not None:  # the prompt is a source
            sources = capacity if source_capacity is None else source_capacity
            if len(prompt) > sources:
                raise checks.InvalidValue("prompt", f"the source has {len(prompt)} tokens, "
                                                    f"more than a slot holds ({sources})")
            if prompt_slots + max_tokens > capacity:
                raise checks.InvalidValue(
                    "max_tokens", f"max_tokens is {max_tokens} after the target's start "
                                  f"({prompt_slots} filled): {prompt_slots + max_tokens} target "
                                  f"slots do not fit a slot's capacity of {capacity}")
        elif len(prompt) + max_tokens > capacity:
            raise checks.InvalidValue(
                "max_tokens", f"the prompt has {len(prompt)} tokens and max_tokens is "
                              f"{max_tokens}: {len(prompt) + max_tokens} tokens do not fit a "
                              f"slot's capacity of {capacity}")
        checks.integer("n", self.n, 1)
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a decode.Sampling, got "
                             f"{type(self.sampling).__name__}")
        for name, value in dataclasses.asdict(self.sampling).items():
            if isinstance(value, tuple):
                raise checks.InvalidValue(name, f"{name}={list(value)}: a request takes one "
                                                "value per setting")
        stop_ids = checks.token_ids("stop_ids", self.stop_ids)
        if len(stop_ids) > MAX_STOP_IDS:
            raise checks.InvalidValue("stop_ids", f"at most {MAX_STOP_IDS} stop ids, got "
                                                  f"{len(stop_ids)}")
        for token in stop_ids:
            if not 0 <= token < vocab_size:
                raise checks.InvalidValue("stop_ids", f"stop id {token} is outside the "
                                                      f"vocabulary [0, {vocab_size})")
        if self.forced_end_id is not None and not (
                checks.is_int(self.forced_end_id) and 0 <= self.forced_end_id < vocab_size):
            raise checks.InvalidValue("forced_end_id", f"forced_end_id {self.forced_end_id!r} "
                                      f"is not a token id in [0, {vocab_size})")
        banned_ids = checks.token_ids("banned_ids", self.banned_ids)
        if len(banned_ids) > MAX_BANNED_IDS or any(not 0 <= t < vocab_size for t in banned_ids):
            raise checks.InvalidValue("banned_ids", f"banned_ids {banned_ids}: at most "
                                      f"{MAX_BANNED_IDS} ids in [0, {vocab_size})")
        logit_bias = _checked_logit_bias(self.logit_bias, vocab_size)
        words = bad_words.checked_words("bad_words", self.bad_words, vocab_size)
        stop = check_stop_strings(self.stop)
        seed = secrets.randbelow(MAX_SEED) if self.seed is None else self.seed
        checks.integer("seed", seed, 0, MAX_SEED)
        checks.integer("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        checks.integer("priority", self.priority, -PRIORITY_BOUND, PRIORITY_BOUND)
        if self.beam_search:
            _check_beam_search(self)
        if self.constraint is not None:
            _check_constraint(self.constraint, vocab_size, stop_ids)
            if self.sampling.min_tokens:
                raise checks.InvalidValue("min_tokens", f"min_tokens={self.sampling.min_tokens} "
                                          "would hold back the end id that structured output "
                                          "needs to end its text")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise checks.InvalidValue("cache_salt", f"cache_salt {self.cache_salt!r} must be "
                                                    "a non-empty string (or None)")
        return dataclasses.replace(self, prompt=prompt, logit_bias=logit_bias,
                                   stop_ids=stop_ids, banned_ids=banned_ids, stop=stop,
                                   seed=seed, bad_words=words)


def _check_beam_search(request: GenerationRequest) -> None:
    """An InvalidValue names the first setting a beam search does not use."""
    checks.real("length_penalty", request.length_penalty, lambda _: True, "finite")
    unused = list(request.sampling.changed())
    for name in ("logit_bias", "stop", "logprobs"):
        if getattr(request, name):
            unused.append(name)
    if unused:
        raise checks.InvalidValue(unused[0], f"{unused[0]} is not used by beam search, which "
                                             "keeps the likeliest tokens")


def _checked_logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`bias` as (id, value) pairs sorted by id; an InvalidValue names a token id outside
    the vocabulary, a value outside [-100, 100] or too many tokens."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise checks.InvalidValue("logit_bias", f"logit_bias names {len(pairs)} tokens: at "
                                                f"most {MAX_LOGIT_BIAS}")
    checked = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise checks.InvalidValue("logit_bias", f"logit_bias entry {pair!r} is not a "
                                                    "(token id, bias) pair")
        token, value = pair
        if not checks.is_int(token) or not 0 <= token < vocab_size:
            raise checks.InvalidValue("logit_bias", f"logit_bias token id {token!r} is outside "
                                                    f"the vocabulary [0, {vocab_size})")
        if int(token) in checked:
            raise checks.InvalidValue("logit_bias", f"logit_bias names token {token} twice")
        checked[int(token)] = checks.real(f"logit_bias[{token}]", value,
                                          lambda v: abs(v) <= LOGIT_BIAS_RANGE,
                                          "in [-100, 100]", np.float32)
    return tuple(sorted(checked.items()))


def _check_constraint(automaton, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
    if not isinstance(automaton, TokenAutomaton):
        raise checks.InvalidValue("constraint", f"constraint must be a TokenAutomaton (decode."
                                                f"compile_constraint), got "
                                                f"{type(automaton).__name__}")
    if automaton.vocab_size > vocab_size:
        raise checks.InvalidValue("constraint", f"the constraint was compiled for "
                                                f"{automaton.vocab_size} token ids; the model "
                                                f"has {vocab_size}")
    if automaton.end_id not in stop_ids:
        raise checks.InvalidValue("constraint", f"the constraint ends with id "
                                                f"{automaton.end_id}, which is not among "
                                                f"stop_ids {stop_ids}: it could never stop")


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output of sample `index` of a request.

    token_ids:    the new tokens (a stop id that ended the sample included).
    text:         the new text that is safe to show: never a piece of a stop string, never
                  half of a UTF-8 character ("" without a tokenizer).
    logprobs:     the model's logprob of each new token.
    top_logprobs: per new token, the request's `logprobs` likeliest (id, logprob) pairs.
    finish_reason: None while the sample goes on; then 'stop' (a stop id or string),
                  'length' (max_tokens or the slot's capacity) or 'cancelled'.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None


def row_settings(samples: list[tuple[GenerationRequest, int]],
                 constraint_states: list[int] | None = None,
                 generated: list[int] | None = None,
                 prefix_pages: list[tuple[int, int]] | None = None) -> RowSettings:
    """Samples (request, index) as slots hold them (NumPy, so nothing runs eagerly), each
    with its initial state in the engine's constraint tables (default: unconstrained), the
    tokens it made before (default: none) and the (prefix row, pages) it shares (default:
    (-1, 0), none)."""
    count = len(samples)
    constraint_states = [-1] * count if constraint_states is None else constraint_states
    generated = [0] * count if generated is None else generated
    prefix_pages = [(-1, 0)] * count if prefix_pages is None else prefix_pages
    stop_ids = np.full((len(samples), MAX_STOP_IDS), -1, np.int32)
    banned_ids = np.full((len(samples), MAX_BANNED_IDS), -1, np.int32)
    words = np.stack([bad_words.words_table(r.bad_words, bad_words.MAX_WORDS,
                                            bad_words.MAX_WORD_TOKENS) for r, _ in samples])
    bias = RowLogitBias(np.zeros((count, MAX_LOGIT_BIAS), np.int32),
                        np.zeros((count, MAX_LOGIT_BIAS), np.float32))
    for row, (request, _) in enumerate(samples):
        stop_ids[row, :len(request.stop_ids)] = request.stop_ids
        banned_ids[row, :len(request.banned_ids)] = request.banned_ids
        for m, (token, value) in enumerate(request.logit_bias):
            bias.ids[row, m], bias.values[row, m] = token, value
    sampling = SamplingParams(**{
        name: np.array([getattr(request.sampling, name) for request, _ in samples],
                       np.int32 if isinstance(default, int) else np.float32)
        for name, default in dataclasses.asdict(GREEDY).items()})
    return RowSettings(
        max_tokens=np.array([r.max_tokens for r, _ in samples], np.int32),
        forced_end=np.array([-1 if r.forced_end_id is None else r.forced_end_id
                             for r, _ in samples], np.int32), stop_ids=stop_ids,
        banned_ids=banned_ids, bad_words=words,
        seed=np.stack([seed_key(r.seed) for r, _ in samples]),
        sample=np.array([index for _, index in samples], np.int32), sampling=sampling,
        logit_bias=bias,
        constraint_state=np.array(constraint_states, np.int32),
        generated=np.array(generated, np.int32),
        prefix_row=np.array([row for row, _ in prefix_pages], np.int32),
        prefix_pages=np.array([n for _, n in prefix_pages], np.int32),
        adapter=np.array([r.adapter for r, _ in samples], np.int32),
        priority=np.array([r.priority for r, _ in samples], np.int32))
