"""How a decode loop is planned: what the device decides at every step, or the host once.

`ON_DEVICE`, the plan `generate` and `stream` run, keeps every decision traced: the loop
checks for its end after every step, and the step skips sampling's sort when every row is
greedy, and the built-in processors when they are off, with a `lax.cond`, so any mix of
settings runs one compiled program.

`LoopPlan.for_rows` is the other way. XLA:GPU runs a `while_loop` whose trip count it cannot
know by copying the predicate to the host and waiting for it at every iteration, and a
`lax.cond` the same way. The host, which holds every row's setting before anything runs,
decides which parts the step needs (no `lax.cond` left in it), and the loop runs
`steps_per_check` steps per check for its end, in an inner loop of known trip count (a done
row, or a step past the limit, changes nothing): one compiled program per combination of the
parts a batch uses, at most eight. Its outputs are exactly `ON_DEVICE`'s. It is not the
default because it has not measured faster on a GPU (benchmarks/README.md). `planned_by` runs
it, and `kvjax bench decode --loops device host:K` times both on one machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from .buckets import power_of_two

STEPS_PER_CHECK = 8  # what `LoopPlan.for_rows` runs unless told otherwise


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """steps_per_check: decode steps per iteration of the loop that checks for its end.
    sampled, penalty, ngram_bound: whether some row samples (is not greedy), has a
    repetition, presence or frequency penalty or a `min_tokens`, and the power of two >= the
    largest `no_repeat_ngram_size` (0: off); None: decided on the device at every step, with
    a `lax.cond`."""

    steps_per_check: int = 1
    sampled: bool | None = None
    penalty: bool | None = None
    ngram_bound: int | None = None

    @classmethod
    def for_rows(cls, rows: dict[str, np.ndarray],
                 steps_per_check: int = STEPS_PER_CHECK) -> LoopPlan:
        """Decided from checked per-row settings (`SamplingParams.make`'s keyword arguments,
        one value per row; absent ones at their defaults)."""
        def setting(name, default):
            return np.asarray(rows.get(name, default))

        greedy = (setting("temperature", 0.0) == 0) | (setting("top_k", 0) == 1)
        largest_ngram = int(np.max(setting("no_repeat_ngram_size", 0)))
        return cls(steps_per_check=steps_per_check, sampled=bool(not np.all(greedy)),
                   penalty=bool(np.any(setting("repetition_penalty", 1.0) != 1)
                                | np.any(setting("presence_penalty", 0.0) != 0)
                                | np.any(setting("frequency_penalty", 0.0) != 0)
                                | np.any(setting("min_tokens", 0) > 0)),
                   ngram_bound=0 if largest_ngram == 0 else power_of_two(largest_ngram))


ON_DEVICE = LoopPlan()  # every decision traced, the end checked after every step
Planner = Callable[[dict[str, np.ndarray]], LoopPlan]
_planner: Planner | None = None


def default_plan(rows: dict[str, np.ndarray]) -> LoopPlan:
    """The plan `generate` and `stream` run: `ON_DEVICE`, or what the planner of an
    enclosing `planned_by` returns."""
    return ON_DEVICE if _planner is None else _planner(rows)


@contextlib.contextmanager
def planned_by(planner: Planner) -> Iterator[None]:
    """Within it, `generate` and `stream` plan their loops with `planner(rows)`: how the
    benchmarks compare one loop with another on one machine, and the tests run an
    accelerator's loop on a CPU."""
    global _planner
    previous, _planner = _planner, planner
    try:
        yield
    finally:
        _planner = previous
