"""Which waiting prompts the engine prefills together.

One prefill pads every prompt of its group to the length bucket of the longest
(`decode.buckets`), and its cost follows the padded positions, not the prompts' own. Taken in
arrival order, a group of eight prompts of 8 to 48 tokens is nearly always padded to 48, so
the engine groups by length instead: the first waiting prompt leads its group, which the
waiting prompts nearest its bucket fill, looked for among the next `LOOKAHEAD_GROUPS` groups'
worth of the queue: those of its bucket first, then shorter ones (padded up to it), then the
least longer. The queue holds requests by priority (`GenerationRequest.priority`, lower
first), then in arrival order (`enqueue`). Every group takes the first waiting prompt, so a
prompt waits at most until those ahead of it are prefilled; prompts of other lengths behind
it may go first.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence

from kvjax.decode.buckets import bucket

LOOKAHEAD_GROUPS = 4


def enqueue(pending: collections.deque, ticket) -> None:
    """Queues `ticket` after every waiting ticket of its priority or a lower one."""
    at = len(pending)
    while at and pending[at - 1].request.priority > ticket.request.priority:
        at -= 1
    pending.insert(at, ticket)


def requeue_first(pending: collections.deque, tickets: list) -> None:
    """Queues `tickets` (preempted samples), in their order, before every waiting ticket
    of their priority or a higher one."""
    for ticket in reversed(tickets):
        at = 0
        while at < len(pending) and pending[at].request.priority < ticket.request.priority:
            at += 1
        pending.insert(at, ticket)


def companion_order(lead_length: int, lengths: Sequence[int], limit: int) -> list[int]:
    """The indices of `lengths` (waiting prompts, oldest first) in the order they join a group
    led by a prompt of `lead_length` tokens: those of its bucket, then shorter ones by
    nearest bucket, then longer ones by nearest bucket; within a bucket, the oldest first.
    `limit` caps the buckets (`bucket`)."""
    lead = bucket(lead_length, limit)

    def rank(i: int) -> tuple[int, int, int]:
        own = bucket(lengths[i], limit)
        return (0, lead - own, i) if own <= lead else (1, own, i)

    return sorted(range(len(lengths)), key=rank)


def take_group(pending: collections.deque, free: int, size: int, limit: int,
               too_long: Callable[[object], bool]) -> tuple[list, list]:
    """(taken, dropped): the first waiting ticket and its companions (`take_companions`),
    at most `size` whose samples fit the `free` staged rows, and the cancelled tickets met
    before them, all moved out of `pending`. Tickets `too_long` names (fed a part per turn)
    stay in it, first."""
    taken, dropped, long = [], [], []
    while pending and len(taken) < size:
        ticket = pending[0]
        if not ticket.cancelled and too_long(ticket):
            long.append(pending.popleft())
            continue
        if not ticket.cancelled and ticket.request.n > free:
            break
        pending.popleft()
        if ticket.cancelled:
            dropped.append(ticket)
        else:
            taken.append(ticket)
            free = take_companions(pending, taken, free - ticket.request.n, size, limit,
                                   too_long)
    pending.extendleft(reversed(long))
    return taken, dropped


def take_companions(pending: collections.deque, taken: list, free: int, size: int,
                    limit: int, skip: Callable[[object], bool]) -> int:
    """Moves waiting tickets from `pending` into `taken` (which holds the group's leader)
    until it holds `size` or none fits, in `companion_order` among the first
    `LOOKAHEAD_GROUPS * size` of `pending`; a ticket fits when its `request.n` samples fit
    the `free` staged rows. Tickets cancelled or that `skip` names stay where they are.
    Returns the staged rows still free."""
    window = [ticket for ticket in itertools.islice(pending, LOOKAHEAD_GROUPS * size)
              if not ticket.cancelled and not skip(ticket)]
    lead = len(taken[0].request.prompt)
    for i in companion_order(lead, [len(t.request.prompt) for t in window], limit):
        if len(taken) == size:
            break
        ticket = window[i]
        if ticket.request.n <= free:
            pending.remove(ticket)
            taken.append(ticket)
            free -= ticket.request.n
    return free
