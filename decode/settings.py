"""Per-row generation settings from what a caller passes: a scalar for every row or one value
per prompt. Each value is checked in Python (a ValueError names it before anything compiles)
and every field becomes a [B] array, so scalar and per-row calls share one compiled program."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .processors import LogitProcessor
from .sampling import SamplingParams

# name: (integer-valued, test, what the test requires)
RULES: dict[str, tuple[bool, Callable[[float], bool], str]] = {
    "temperature": (False, lambda v: v >= 0, "must be >= 0"),
    "top_k": (True, lambda v: v >= 0, "must be >= 0 (0 means no limit)"),
    "top_p": (False, lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "min_p": (False, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "repetition_penalty": (False, lambda v: v > 0, "must be > 0 (1 means off)"),
    "no_repeat_ngram_size": (True, lambda v: v >= 0, "must be >= 0 (0 means off)"),
}


def per_row(name: str, value, batch: int) -> np.ndarray:
    """`value` (a scalar or one per prompt) as a float64 array [batch], each entry checked."""
    integer, test, requirement = RULES[name]
    # Strings and booleans are not numbers here, though NumPy would convert them.
    array = None if isinstance(value, str | bytes) else np.asarray(value)
    if array is not None and array.dtype.kind in "iuf":
        array = array.astype(np.float64)
    else:
        array = None
    if array is None or array.ndim > 1:
        raise ValueError(f"{name}={value!r} must be a number or a list of one per prompt")
    if array.ndim == 1 and array.shape[0] != batch:
        raise ValueError(f"{name} has {array.shape[0]} values {array.tolist()} for {batch} "
                         f"prompts: give one value or one per prompt")
    for i, v in enumerate(np.atleast_1d(array)):
        label = name if array.ndim == 0 else f"{name}[{i}]"
        shown = int(v) if integer and float(v).is_integer() else float(v)
        if not np.isfinite(v):
            raise ValueError(f"{label}={shown} must be finite")
        if not test(v):
            raise ValueError(f"{label}={shown} {requirement}")
        if integer and not float(v).is_integer():
            raise ValueError(f"{label}={shown} must be an integer")
    return np.broadcast_to(array, (batch,))


def sampling_params(batch: int, num_samples: int = 1, **settings) -> SamplingParams:
    """Checked `SamplingParams` with [batch * num_samples] fields (a prompt's value repeated
    for each of its samples); `settings` are `SamplingParams.make`'s keyword arguments."""
    rows = {name: np.repeat(per_row(name, value, batch), num_samples)
            for name, value in settings.items()}
    return SamplingParams.make(**rows, batch=batch * num_samples)


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


