"""The lengths compiled shapes are padded to, one rule for every program that pads.

A prompt batch is padded to the bucket of its longest prompt, and a token buffer to the
bucket of `max_new_tokens`, so that nearby lengths share one compiled program. The buckets
are the powers of two and, from 16 on, the steps halfway between (8, 16, 24, 32, 48, 64,
96, ...): padding costs at most a third of the work instead of up to half, for a few more
programs. `generate`, `prefill`, the server's prefills and its prompt logprobs all use it.
Counts that are not lengths (a prefill's rows, a constraint's table sizes) round up to a
power of two (`power_of_two`); `generate`'s rows take the powers of two up to 16 and the
lengths' steps beyond (`rows_bucket`), so that a large batch is padded by a third at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BUCKET = 8


def bucket(n: int, limit: int) -> int:
    """The smallest bucket that holds n (at least `MIN_BUCKET`), capped at `limit`."""
    size = MIN_BUCKET
    while size < n:
        power = 1 << (size.bit_length() - 1)  # the power of two at or below `size`
        size = power * 3 // 2 if size == power and power >= 16 else power * 2
    return min(size, limit)


def padded_to_bucket(prompts: Sequence[Sequence[int]], limit: int) -> np.ndarray:
    """`prompts` [P, bucket of the longest] int32, each right-padded with zeros."""
    padded = np.zeros((len(prompts), bucket(max(map(len, prompts)), limit)), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    return padded


def power_of_two(n: int, least: int = 1) -> int:
    """The smallest power of two >= n, and >= `least`: for counts with no halfway steps
    (rows of a batch, table sizes), where a few more programs buy nothing."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def smallest_sharing(n: int, limit: int) -> int:
    """The smallest length whose bucket is n's: lengths from it to n share one program."""
    size = bucket(n, limit)
    shorter = n
    while shorter > 1 and bucket(shorter - 1, limit) == size:
        shorter -= 1
    return shorter


def rows_bucket(n: int) -> int:
    """The rows a batch of n prompts runs as: 1, 2, 4, 8, 16, then 24, 32, 48, 64, 96, ...
    A batch of a new size costs a compile; the rows filled in cost a decode step little
    beside reading the weights (a prefill, their share of its work): batches of nearby
    sizes share one program."""
    return power_of_two(n) if n <= 16 else bucket(n, 2 * n)
