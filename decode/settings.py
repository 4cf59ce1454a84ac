"""Per-row generation settings from what a caller passes: a scalar for every row or one value
per prompt. Each value is checked in Python (a ValueError names it before anything compiles)
and every field becomes a [B] array, so scalar and per-row calls share one compiled program."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from . import checks
from .processors import LogitProcessor
from .sampling import SamplingParams

Setting = float | int | Sequence[float] | Sequence[int]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each row chooses its next token: `generate`'s, `stream`'s and the server's
    settings. Each field is one value for every prompt or a sequence of one per prompt
    (kept as a tuple, so a `Sampling` is hashable); every value is checked when it is made.
    The defaults are greedy decoding with nothing filtered or penalised (`GREEDY`).

    temperature: 0 takes the argmax; otherwise logits are divided by it and a token drawn.
    top_k: keep the k likeliest tokens (0 = no limit; 1 = greedy).
    top_p: keep the smallest set of likeliest tokens whose probability reaches p (1 = all).
    min_p: keep tokens at least min_p times as likely as the likeliest (0 = all).
    repetition_penalty: tokens already in the row's context have positive logits divided
        and negative ones multiplied by it (1 = off).
    no_repeat_ngram_size: n > 0 bans every token that would repeat an n-gram of the row's
        context (0 = off).
    presence_penalty: subtracted from the logit of every token the row has output (0 = off;
        negative values favour them), as OpenAI's API and vLLM define it.
    frequency_penalty: times how often the row has output a token, subtracted from its logit
        (0 = off).
    The last two count the tokens this call outputs, not the prompt's, as OpenAI's API and
    vLLM do; the repetition penalty and the n-gram ban read the whole context.
    min_tokens: the row's stop ids cannot be drawn before it has output this many tokens
        (0 = none; transformers' min_new_tokens, vLLM's min_tokens). Stop strings still
        end a text.
    See `sampling.SamplingParams`, the traced [B] form a compiled program takes.
    """

    temperature: Setting = 0.0
    top_k: Setting = 0
    top_p: Setting = 1.0
    min_p: Setting = 0.0
    repetition_penalty: Setting = 1.0
    no_repeat_ngram_size: Setting = 0
    presence_penalty: Setting = 0.0
    frequency_penalty: Setting = 0.0
    min_tokens: Setting = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            scalar = _is_scalar(value)
            entries = per_row(field.name, value, 1 if scalar else len(value)).tolist()
            if RULES[field.name][0]:  # counts: ints
                entries = [int(v) for v in entries]
            object.__setattr__(self, field.name, entries[0] if scalar else tuple(entries))

    def changed(self) -> tuple[str, ...]:
        """The names of the settings that differ from greedy decoding's (for any prompt)."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if np.any(np.asarray(getattr(self, f.name)) != f.default))

    def rows(self, batch: int, num_samples: int = 1) -> dict[str, np.ndarray]:
        """Every setting as a [batch * num_samples] array (a prompt's value repeated for each
        of its samples); a ValueError names a setting with one value per prompt for another
        number of prompts."""
        return checked_rows(batch, num_samples, **dataclasses.asdict(self))

    def params(self, batch: int, num_samples: int = 1) -> SamplingParams:
        """The traced form of `rows` that compiled programs take."""
        return SamplingParams.make(**self.rows(batch, num_samples), batch=batch * num_samples)


def _is_scalar(value) -> bool:
    return not isinstance(value, list | tuple | np.ndarray | jax.Array) or np.ndim(value) == 0

# name: (integer-valued, test, what the test requires)
RULES: dict[str, tuple[bool, Callable[[float], bool], str]] = {
    "temperature": (False, lambda v: v >= 0, ">= 0"),
    "top_k": (True, lambda v: v >= 0, ">= 0 (0 means no limit)"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (False, lambda v: v > 0, "> 0 (1 means off)"),
    "no_repeat_ngram_size": (True, lambda v: v >= 0, ">= 0 (0 means off)"),
    "presence_penalty": (False, lambda v: -2 <= v <= 2, "in [-2, 2] (0 means off)"),
    "frequency_penalty": (False, lambda v: -2 <= v <= 2, "in [-2, 2] (0 means off)"),
    "min_tokens": (True, lambda v: v >= 0, ">= 0 (0 means none)"),
}


def per_row(name: str, value, batch: int) -> np.ndarray:
    """`value` (a scalar or one per prompt) as a float64 array [batch], each entry checked:
    an int within int32 where the setting counts something, otherwise a finite real that
    keeps its required range in float32 (the dtypes the compiled code uses)."""
    integer, test, requirement = RULES[name]
    scalar = _is_scalar(value)
    if not scalar and np.ndim(value) != 1:
        raise checks.InvalidValue(name, f"{name} must be a number or a list of one per "
                                        f"prompt, got shape {np.shape(value)}")
    entries = [value.item() if hasattr(value, "item") else value] if scalar else \
        np.asarray(value).tolist()
    if not scalar and len(entries) != batch:
        raise checks.InvalidValue(name, f"{name} has {len(entries)} values {entries} for "
                                        f"{batch} prompts: give one value or one per prompt")
    checked = []
    for i, entry in enumerate(entries):
        label = name if scalar else f"{name}[{i}]"
        if integer:  # int32 on the device
            entry = checks.integer(label, entry, 0, checks.INT32_MAX)
            if not test(entry):
                raise checks.InvalidValue(label, f"{label}={entry} must be {requirement}")
        else:
            entry = checks.real(label, entry, test, requirement, np.float32)
        checked.append(entry)
    return np.broadcast_to(np.asarray(checked, np.float64), (batch,))


def checked_rows(batch: int, num_samples: int = 1, **settings) -> dict[str, np.ndarray]:
    """Each of `settings` (`Sampling`'s fields) checked, as a
    [batch * num_samples] array (a prompt's value repeated for each of its samples)."""
    return {name: np.repeat(per_row(name, value, batch), num_samples)
            for name, value in settings.items()}


def check_processors(processors: Sequence[LogitProcessor]) -> tuple[LogitProcessor, ...]:
    """The processors as a tuple, each callable and hashable (compiled programs key on them)."""
    processors = tuple(processors)
    for processor in processors:
        if not callable(processor):
            raise ValueError(f"logit processor {processor!r} is not callable")
        try:
            hash(processor)
        except TypeError as error:
            raise ValueError(f"logit processor {processor!r} must be hashable (a function or "
                             f"a frozen dataclass): {error}") from None
    return processors


def check_num_samples(num_samples: int) -> None:
    if not isinstance(num_samples, int | np.integer) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be an integer >= 1")


GREEDY = Sampling()
