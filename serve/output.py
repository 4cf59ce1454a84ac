"""The engine's output side: the samples on the device, and what their tokens become.

The engine (`engine.py`) schedules: it admits requests, stages their samples and dispatches
the programs. What those programs made comes here, as an `Emitted` pulled to the host: each
sample's new tokens are detokenized, checked against its stop strings, timed for the metrics
and handed to its request's callback as a `Delta`; a sample that ended on the host (a stop
string, a cancel, a failure) goes on the list of ids the next chunk stops on the device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from kvjax.decode.loop import StopReason
from kvjax.detokenize import RowText
from kvjax.tokenizer import TextTokenizer

from . import slots
from .requests import Delta, GenerationRequest

OnDelta = Callable[[Delta | Exception], None]


@dataclasses.dataclass
class Dispatched:
    """A program's `Emitted`, not yet handed out, and the staged rows it filled."""

    emitted: slots.Emitted
    staged_rows: list[int]
    is_chunk: bool


class Ticket:
    """A submitted request: its callback gets its `Delta`s (or the exception that ended it),
    from the engine's thread (`on_delta`); `cancel()` frees its slots within one chunk
    (`wake` tells the engine)."""

    def __init__(self, request: GenerationRequest, on_delta: OnDelta,
                 wake: Callable[[], None] = lambda: None):
        self.request, self._callback, self._wake = request, on_delta, wake
        self.submitted = time.perf_counter()
        self.cancelled = self.callback_failed = False
        self.unfinished = request.n
        # The prompt tokens the prefix cache served it, less those fed for it in parts
        # (`fed_in_parts`): set when it is staged.
        self.cached_tokens: int | None = None
        self.fed_in_parts = 0

    generated = 0  # tokens each sample made before it is staged

    def on_delta(self, delta: Delta | Exception) -> None:
        """Hands `delta` to the callback. The callback is the client's code: if it raises, the
        error is logged and the request cancelled, and it hears nothing more; the engine's
        loop, and every other request, goes on."""
        if self.callback_failed:
            return
        try:
            self._callback(delta)
        except Exception:  # noqa: BLE001 - the client's error ends its own request alone
            logging.getLogger(__name__).exception("a request's callback raised; it is cancelled")
            self.callback_failed = True
            self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self._wake()

    @property
    def origin(self) -> Ticket:
        return self

    def indices(self) -> range:
        """The samples this staging makes."""
        return range(self.request.n)

    def automaton_state(self) -> int:
        """The state of its constraint (which it has) its samples start in."""
        return self.request.constraint.initial


@dataclasses.dataclass
class Sample:
    """Sample `index` of a ticket, with its id on the device (staged or in a slot)."""

    ticket: Ticket
    index: int
    id: int
    text: RowText | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    last_emitted: float = 0.0
    prefix_row: int = -1  # the prefix cache's row whose pages it reads in place (-1: none)


class Continuation:
    """A preempted sample queued again (`pages.py`): its prompt and every token it made are
    prefilled anew, and it goes on as the same sample of the same ticket, from the same
    random key position, penalty context and constraint state."""

    def __init__(self, sample: Sample):
        self.sample, self.origin = sample, sample.ticket
        request = sample.ticket.request
        self.request = dataclasses.replace(request, prompt=request.prompt + tuple(sample.tokens),
                                           n=1)
        self.generated = len(sample.tokens)

    @property
    def cancelled(self) -> bool:
        return self.origin.cancelled

    def on_delta(self, delta: Delta | Exception) -> None:
        self.origin.on_delta(delta)

    def indices(self) -> list[int]:
        return [self.sample.index]

    def automaton_state(self) -> int:
        automaton = self.request.constraint
        state = automaton.initial
        for token in self.sample.tokens:
            state = automaton.next_state(state, token)
        return state


class Outputs:
    """The samples the device holds, by id, and the ids the host ended (`to_stop`) that
    the device may still run. `tokenizer` (optional) turns tokens into text, so that stop
    strings can end a sample; `metrics` (optional) hears of first tokens and token times."""

    def __init__(self, tokenizer: TextTokenizer | None = None, metrics=None,
                 release: Callable[[int], None] = lambda prefix_row: None):
        self.tokenizer, self.metrics, self.release = tokenizer, metrics, release
        self.samples: dict[int, Sample] = {}
        self.to_stop: list[int] = []
        self.preempted: list[Sample] = []  # to be queued again, oldest first
        self.pages_used: int | None = None  # the slots' pages held, as of the last chunk

    def add(self, ticket: Ticket, index: int, sample_id: int, prefix_row: int = -1) -> None:
        """A sample staged on the device under `sample_id`, reading the pages of prefix row
        `prefix_row` in place (-1: none) until it ends (then `release(prefix_row)`)."""
        request = ticket.request
        text = None if self.tokenizer is None else RowText(
            self.tokenizer, request.stop, request.stop_ids, request.include_stop,
            request.skip_special_tokens)
        self.samples[sample_id] = Sample(ticket, index, sample_id, text, prefix_row=prefix_row)

    def take_preempted(self) -> list[Continuation]:
        """The samples preempted since the last call, oldest first, to be queued again."""
        taken = [Continuation(sample) for sample in self.preempted]
        self.preempted.clear()
        if taken and self.metrics is not None:
            self.metrics.count_preemptions(len(taken))
        return taken

    def resume(self, sample: Sample, sample_id: int, prefix_row: int = -1) -> None:
        """A preempted sample staged again under `sample_id` (`prefix_row` as in `add`)."""
        sample.id, sample.prefix_row = sample_id, prefix_row
        self.samples[sample_id] = sample

    def _drop(self, sample: Sample) -> None:
        """The device holds the sample no longer (or will not after the next chunk)."""
        del self.samples[sample.id]
        if sample.prefix_row >= 0:
            self.release(sample.prefix_row)
            sample.prefix_row = -1

    def take_stop_ids(self, count: int) -> np.ndarray:
        """The first `count` ids of `to_stop`, taken off it, for the next chunk to stop
        [count] (-2 pads: no sample has it); the rest wait for the chunk after (samples a
        chunk in flight ended can still be on the list)."""
        ids = np.full(count, -2, np.int32)
        taken, self.to_stop = self.to_stop[:count], self.to_stop[count:]
        ids[:len(taken)] = taken
        return ids

    def want_top(self) -> bool:
        """Whether some sample reports top logprobs."""
        return any(s.ticket.request.logprobs for s in self.samples.values())

    def end_cancelled(self) -> None:
        for sample in list(self.samples.values()):
            if sample.ticket.cancelled:
                self._finish(sample, Delta(sample.index, [], "", [], [], "cancelled"))
                self.to_stop.append(sample.id)

    def hand_out(self, emitted: slots.Emitted) -> None:
        """Hands each sample what a program made (`emitted`, on the host), in order."""
        if emitted.pages_used is not None:
            self.pages_used = int(emitted.pages_used)
        host = None  # the [B, O] arrays as lists, once a row has served a sample
        for row, owners in enumerate(emitted.owner.tolist()):
            for sample_id, steps in _runs(owners):
                sample = self.samples.get(sample_id)
                if sample is None:  # the host ended it (cancelled, stop string, failed)
                    continue
                if host is None:
                    host = _AsLists(emitted)
                try:
                    self._emit(sample, host, row, [s for s in steps if host.made[row][s]],
                               host.reason[row][steps[-1]])
                except Exception as error:  # noqa: BLE001 - it ends this request alone
                    logging.getLogger(__name__).exception("a request failed; it ends")
                    self.fail(sample.ticket, error)

    def _emit(self, sample: Sample, host: _AsLists, row: int, steps: list[int],
              reason: int) -> None:
        """Hands the sample the tokens row `row` made for it at `steps`; ends it at a stop
        id, its token budget, its slot's capacity (`reason`) or a stop string."""
        ids = [host.tokens[row][s] for s in steps]
        finish = None
        piece = ""
        if sample.text is not None:
            piece = sample.text.add(ids)
            if sample.text.stopped:  # a stop string: its tokens end with the one completing it
                ids = ids[:len(sample.text.ids) - len(sample.tokens)]
                finish = "stop"
                if reason == StopReason.RUNNING:
                    self.to_stop.append(sample.id)
        preempted = finish is None and reason == StopReason.PREEMPTED
        if finish is None and reason != StopReason.RUNNING and not preempted:
            finish = "stop" if reason == StopReason.EOS else "length"
            if sample.text is not None:
                sent = sample.text.sent
                sample.text.finish(sample.tokens + ids)
                piece += sample.text.text[len(sent):]
        steps = steps[:len(ids)]
        delta = Delta(sample.index, ids, piece, [host.logprobs[row][s] for s in steps],
                      host.top(row, steps, sample.ticket.request.logprobs), finish)
        self._observe(sample, len(ids))
        sample.tokens.extend(ids)
        if finish is not None:
            self._finish(sample, delta)
            return
        if ids or piece:
            sample.ticket.on_delta(delta)
        if preempted:
            self._drop(sample)
            self.preempted.append(sample)

    def _finish(self, sample: Sample, delta: Delta) -> None:
        self._drop(sample)
        sample.ticket.unfinished -= 1
        if not sample.ticket.unfinished and self.metrics is not None:
            self.metrics.observe_request(time.perf_counter() - sample.ticket.submitted)
        sample.ticket.on_delta(delta)

    def _observe(self, sample: Sample, count: int) -> None:
        """Tells the metrics when a sample's first token came, or how long each new one took."""
        if not count:
            return
        now = time.perf_counter()
        if self.metrics is not None:
            if not sample.last_emitted:
                self.metrics.observe_first_token(now - sample.ticket.submitted)
            else:
                self.metrics.observe_tokens(count, (now - sample.last_emitted) / count)
        sample.last_emitted = now

    def fail(self, ticket: Ticket, error: Exception) -> None:
        """Ends one request with `error` (its slots free with the next chunk), no other."""
        for sample in [s for s in self.samples.values() if s.ticket is ticket]:
            self._drop(sample)
            self.to_stop.append(sample.id)
        ticket.cancelled = True
        ticket.on_delta(error)


def _runs(owners: list[int]) -> list[tuple[int, list[int]]]:
    """A row's steps grouped by the sample they served, in order: (sample id, steps); a row
    serves one sample for consecutive steps, then maybe another. Steps with none are left
    out."""
    runs: list[tuple[int, list[int]]] = []
    for step, owner in enumerate(owners):
        if owner == slots.NO_SAMPLE:
            continue
        if runs and runs[-1][0] == owner:
            runs[-1][1].append(step)
        else:
            runs.append((owner, [step]))
    return runs


class _AsLists:
    """An `Emitted`'s [B, O] arrays as Python lists, read entry by entry for each sample:
    one conversion per chunk where indexing NumPy per sample costs more than the chunk's
    other host work. The top logprobs stay arrays, read only for requests that ask."""

    def __init__(self, emitted: slots.Emitted):
        self.tokens, self.made = emitted.tokens.tolist(), emitted.made.tolist()
        self.reason, self.logprobs = emitted.reason.tolist(), emitted.logprobs.tolist()
        self._top_ids, self._top_logprobs = emitted.top_ids, emitted.top_logprobs

    def top(self, row: int, steps: list[int], count: int) -> list[list[tuple[int, float]]]:
        """Per step, the `count` likeliest (id, logprob) pairs of row `row`."""
        if not count:
            return [[] for _ in steps]
        return [list(zip(self._top_ids[row, k, :count].tolist(),
                         self._top_logprobs[row, k, :count].tolist(), strict=True))
                for k in steps]
