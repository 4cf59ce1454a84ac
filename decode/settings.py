"""Per-row generation settings from what a caller passes: a scalar for every row or one value
per prompt. Each value is checked in Python (a ValueError names it before anything compiles)
and every field becomes a [B] array, so scalar and per-row calls share one compiled program."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from . import checks
from .processors import LogitProcessor

# name: (integer-valued, test, what the test requires)
RULES: dict[str, tuple[bool, Callable[[float], bool], str]] = {
    "temperature": (False, lambda v: v >= 0, ">= 0"),
    "top_k": (True, lambda v: v >= 0, ">= 0 (0 means no limit)"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (False, lambda v: v > 0, "> 0 (1 means off)"),
    "no_repeat_ngram_size": (True, lambda v: v >= 0, ">= 0 (0 means off)"),
}


def per_row(name: str, value, batch: int) -> np.ndarray:
    """`value` (a scalar or one per prompt) as a float64 array [batch], each entry checked:
    an int within int32 where the setting counts something, otherwise a finite real that
    keeps its required range in float32 (the dtypes the compiled code uses)."""
    integer, test, requirement = RULES[name]
    scalar = not isinstance(value, list | tuple | np.ndarray | jax.Array) or np.ndim(value) == 0
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
    """Each of `settings` (`SamplingParams.make`'s keyword arguments) checked, as a
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


