"""What the host decides about a decode loop before compiling it, so that on an accelerator the
loop's step holds no `lax.cond` and the loop checks for its end only every few steps.

XLA:GPU runs a `while_loop` whose trip count it cannot know by copying the predicate to the
host and waiting for it at every iteration, and every `lax.cond` the same way: the device then
idles while the host reads a flag and launches the next kernels. A CPU pays nothing for
either. So on a CPU (`ON_DEVICE`) every decision stays traced: the loop checks its
end after every step, and the step skips sampling's sort when every row is greedy, and the
built-in processors when they are off, with a `lax.cond`, so any mix of settings runs one
compiled program. On an accelerator (`LoopPlan.for_rows`) the host, which holds every row's
setting before anything runs, decides which of those parts the step needs, and the loop
runs `steps_per_check` steps (a fixed-count inner loop, a done row or a step past the limit
changing nothing) per check of its end: one compiled program per combination of the parts a
batch uses, at most eight, each compiled once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np

ACCELERATOR_STEPS_PER_CHECK = 8  # decode steps per check for the end on an accelerator


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """steps_per_check: decode steps per iteration of the loop that checks for its end.
    sampled, penalty, ngram_bound: whether some row samples (is not greedy), has a
    repetition penalty, and the power of two >= the largest `no_repeat_ngram_size` (0: off);
    None: decided on the device at every step, with a `lax.cond`."""

    steps_per_check: int = 1
    sampled: bool | None = None
    penalty: bool | None = None
    ngram_bound: int | None = None

    @classmethod
    def for_rows(cls, rows: dict[str, np.ndarray],
                 steps_per_check: int = ACCELERATOR_STEPS_PER_CHECK) -> LoopPlan:
        """Decided from checked per-row settings (`SamplingParams.make`'s keyword arguments,
        one value per row; absent ones at their defaults)."""
        def setting(name, default):
            return np.asarray(rows.get(name, default))

        greedy = (setting("temperature", 0.0) == 0) | (setting("top_k", 0) == 1)
        largest_ngram = int(np.max(setting("no_repeat_ngram_size", 0)))
        return cls(steps_per_check=steps_per_check, sampled=bool(not np.all(greedy)),
                   penalty=bool(np.any(setting("repetition_penalty", 1.0) != 1)),
                   ngram_bound=0 if largest_ngram == 0 else 1 << (largest_ngram - 1).bit_length())


ON_DEVICE = LoopPlan()  # every decision traced, the end checked after every step
Planner = Callable[[dict[str, np.ndarray]], LoopPlan]
_planner: Planner | None = None


def default_plan(rows: dict[str, np.ndarray]) -> LoopPlan:
    """`ON_DEVICE` on a CPU, `LoopPlan.for_rows(rows)` on an accelerator (or what the
    planner of an enclosing `planned_by` returns)."""
    if _planner is not None:
        return _planner(rows)
    if jax.default_backend() == "cpu":
        return ON_DEVICE
    return LoopPlan.for_rows(rows)


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
