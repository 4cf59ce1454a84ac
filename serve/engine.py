"""Continuous batching: requests join and leave a running batch of decode slots.

The engine owns `max_slots` slots in one cache of `max_len` positions each (`slots.py`) and
a bounded queue of requests waiting for them. One host loop repeats:
  1. admit: while the oldest waiting request's `n` samples fit the free slots, prefill its
     prompt once (length bucketed, `decode`'s prefill program) and insert it into `n` slots,
     each sample with its first token;
  2. decode one chunk of `chunk_size` steps over every slot (one compiled `while_loop`),
     and while it runs, emit the first tokens of the samples just inserted;
  3. emit each sample's new tokens and text to its request's callback, and free the slots of
     samples that finished, met a stop string or whose request was cancelled.
A request therefore waits at most one chunk to join, and a cancelled one holds its slots at
most one chunk longer. `start` runs the loop on its own thread; `step` runs one turn of it
where the caller is (tests, benchmarks).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np
from kvjax.decode.generate import bucket, placement
from kvjax.decode.loop import StopReason
from kvjax.decode.prompt_state import prefill_state
from kvjax.decode.sampling import SamplingParams

from kvjax import model as M
from kvjax import parallel
from kvjax.text import _RowText as RowText  # one sample's text, stop strings and all
from kvjax.tokenizer import TextTokenizer

from . import slots
from .requests import INTEGER_FIELDS, SAMPLING_FIELDS, Delta, GenerationRequest

OnDelta = Callable[[Delta | Exception], None]


class QueueFull(Exception):
    """The queue of requests waiting for a slot is full: try again later."""


class Ticket:
    """A submitted request: `on_delta` gets its `Delta`s (or the exception that ended it),
    from the engine's thread; `cancel()` frees its slots within one chunk."""

    def __init__(self, engine: Engine, request: GenerationRequest, on_delta: OnDelta):
        self.engine, self.request, self.on_delta = engine, request, on_delta
        self.submitted = time.perf_counter()
        self.cancelled = False
        self.unfinished = request.n

    def cancel(self) -> None:
        self.cancelled = True
        self.engine._notify()


@dataclasses.dataclass
class _Sample:
    """Sample `index` of a ticket, generating in a slot."""

    ticket: Ticket
    index: int
    text: RowText | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    last_emitted: float = 0.0


class Engine:
    """Serves `GenerationRequest`s of a decoder-only LM with continuous batching.

    `tokenizer` (optional) turns each sample's tokens into text as they come, so that
    stop strings can end it. Up to `prefill_batch` waiting prompts are prefilled in one
    call (the number rounded up to a power of two: a few programs serve every count).
    `metrics` (optional, see `metrics.ServeMetrics`) is told of the load, first tokens and
    token times. On a `mesh` (or the one `params` are sharded over) the slots are split over
    its `data` axis, each device decoding its share, and the params over `model` by
    `kvjax.parallel`'s rules; `max_slots` must be a multiple of `data`."""

    def __init__(self, config: M.TransformerConfig, params, *,
                 tokenizer: TextTokenizer | None = None, max_slots: int = 16,
                 max_len: int | None = None, chunk_size: int = 8, max_queue: int = 64,
                 prefill_batch: int = 8, metrics=None, mesh=None):
        capacity = config.max_len if max_len is None else max_len
        for name, value in (("max_slots", max_slots), ("max_len", capacity),
                            ("chunk_size", chunk_size), ("max_queue", max_queue),
                            ("prefill_batch", prefill_batch)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if capacity > config.max_len:
            raise ValueError(f"max_len={capacity} exceeds the model's max_len {config.max_len}")
        on = parallel.mesh_of(params) if mesh is None else mesh
        if on is not None and max_slots % on.shape[parallel.DATA]:
            raise ValueError(f"max_slots={max_slots} must be a multiple of the mesh's "
                             f"data={on.shape[parallel.DATA]}: each device holds as many "
                             f"slots")
        self.mesh, params = placement(config, params, mesh)
        self.config, self.params, self.tokenizer = config, params, tokenizer
        self.capacity, self.chunk_size, self.max_queue = capacity, chunk_size, max_queue
        self.prefill_batch = prefill_batch
        self.metrics = metrics
        self.state = slots.empty_state(config, max_slots, capacity, self.mesh)
        self._slots: list[_Sample | None] = [None] * max_slots
        self._pending: collections.deque[Ticket] = collections.deque()
        # Inserts whose first tokens are not yet sent: (Emitted [R, 1], [(slot, sample)]).
        self._unsent: list[tuple[slots.Emitted, list[tuple[int, _Sample]]]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # The caller's side -----------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        return len(self._slots)

    @property
    def live_slots(self) -> int:
        return sum(sample is not None for sample in self._slots)

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    def submit(self, request: GenerationRequest, on_delta: OnDelta) -> Ticket:
        """Queues `request`; a ValueError names a bad value, `QueueFull` says to retry."""
        request = request.checked(self.config.vocab_size, self.capacity)
        if request.n > self.max_slots:
            raise ValueError(f"n={request.n} is more than the engine's {self.max_slots} slots")
        ticket = Ticket(self, request, on_delta)
        with self._wake:
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting for a slot, as "
                                f"many as the queue holds (max_queue={self.max_queue})")
            self._pending.append(ticket)
            self._wake.notify()
        self._report_load()
        return ticket

    def warm_up(self, prompt_lengths: Iterable[int] | None = None) -> None:
        """Compiles what serving can need before the loop starts, so that no request waits
        for a compilation: the prefill of every prompt-length bucket (of `prompt_lengths`,
        default every length a slot holds) and the insert at every row count, the chunk."""
        lengths = range(1, self.capacity) if prompt_lengths is None else prompt_lengths
        buckets = sorted({bucket(n, self.capacity) for n in lengths})
        rows = sorted({min(1 << k, self.prefill_batch)
                       for k in range(self.prefill_batch.bit_length() + 1)})
        for count, length in itertools.product(rows, buckets):
            prefilled = prefill_state(self.config, self.params,
                                      np.zeros((count, length), np.int32),
                                      np.ones(count, np.int32), length)
            self.state, _ = slots.insert(  # slot `max_slots`: compiled, nothing inserted
                self.state, *prefilled, np.zeros(count, np.int32),
                np.full(count, self.max_slots, np.int32),
                _row_settings([(GenerationRequest((0,), seed=0), 0)] * count),
                mesh=self.mesh)
        self.state, _ = slots.decode_chunk(self.config, self.params, self.state,
                                           np.zeros(self.max_slots, bool), np.bool_(False),
                                           self.chunk_size, mesh=self.mesh)
        self.state = slots.empty_state(self.config, self.max_slots, self.capacity,
                                       self.mesh)

    def start(self) -> None:
        """Runs the loop on a thread of its own until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def run_until_idle(self) -> None:
        """Steps until nothing is queued or generating."""
        while self.step():
            pass

    # The loop ------------------------------------------------------------------------

    def step(self) -> bool:
        """Admits what fits, decodes one chunk and emits; returns whether work remains."""
        self._admit()
        if self.live_slots:
            self._decode_chunk()
        self._send_first_tokens()
        self._report_load()
        return bool(self._pending or self.live_slots)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._pending or self.live_slots):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - every request hears of it
                logging.getLogger(__name__).exception("the engine failed; its requests end")
                self._fail_all(error)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _admit(self) -> None:
        while tickets := self._admissible():
            self._insert(tickets)

    def _admissible(self) -> list[Ticket]:
        """Takes the oldest queued tickets whose samples fit the free slots (at most
        `prefill_batch`, prefilled together); cancelled ones are answered and dropped."""
        taken, dropped = [], []
        with self._wake:
            free = self._slots.count(None)
            while self._pending and len(taken) < self.prefill_batch:
                ticket = self._pending[0]
                if not ticket.cancelled and ticket.request.n > free:
                    break
                self._pending.popleft()
                if ticket.cancelled:
                    dropped.append(ticket)
                else:
                    taken.append(ticket)
                    free -= ticket.request.n
        for ticket in dropped:
            for index in range(ticket.request.n):
                ticket.on_delta(Delta(index, [], "", [], [], "cancelled"))
        return taken

    def _insert(self, tickets: list[Ticket]) -> None:
        """Prefills the tickets' prompts in one call (rows and length bucketed; spare rows
        repeat the first) and inserts each prompt into a free slot per sample."""
        prompts = [ticket.request.prompt for ticket in tickets]
        rows = min(1 << (len(prompts) - 1).bit_length(), self.prefill_batch)
        padded = np.zeros((rows, bucket(max(map(len, prompts)), self.capacity)), np.int32)
        lengths = np.full(rows, len(prompts[0]), np.int32)
        for row, prompt in enumerate(prompts + [prompts[0]] * (rows - len(prompts))):
            padded[row, :len(prompt)] = prompt
            lengths[row] = len(prompt)
        # The prompts' cache holds only them: the insert writes it into the slots' rows.
        prefilled = prefill_state(self.config, self.params, padded, lengths, padded.shape[1])
        free = [b for b, sample in enumerate(self._slots) if sample is None]
        entries = [(row, ticket, index) for row, ticket in enumerate(tickets)
                   for index in range(ticket.request.n)]
        for start in range(0, len(entries), rows):  # `rows` samples per insert
            group = entries[start:start + rows]
            group_slots = [free.pop(0) for _ in group]
            spare = rows - len(group)  # padding: slot `max_slots` inserts nothing
            settings = _row_settings([(t.request, i) for _, t, i in group + group[:1] * spare])
            self.state, first = slots.insert(
                self.state, *prefilled, np.array([r for r, _, _ in group] + [0] * spare,
                                                 np.int32),
                np.array(group_slots + [self.max_slots] * spare, np.int32), settings,
                mesh=self.mesh)
            placed = []
            for (_, ticket, index), slot in zip(group, group_slots, strict=True):
                text = (None if self.tokenizer is None
                        else RowText(self.tokenizer, ticket.request.stop))
                self._slots[slot] = _Sample(ticket, index, text)
                placed.append((slot, self._slots[slot]))
            self._unsent.append((first, placed))

    def _send_first_tokens(self) -> None:
        """Hands out the first tokens of the samples inserted since the last call: the
        chunk after their insert is dispatched first, so the host does this while it runs."""
        unsent, self._unsent = self._unsent, []
        for first, placed in unsent:
            first = jax.device_get(first)
            for row, (slot, sample) in enumerate(placed):
                if self._slots[slot] is sample:
                    self._emit(slot, sample, first, row)

    def _decode_chunk(self) -> None:
        keep = np.array([s is not None and not s.ticket.cancelled for s in self._slots])
        want_top = any(s is not None and s.ticket.request.logprobs for s in self._slots)
        self.state, emitted = slots.decode_chunk(self.config, self.params, self.state,
                                                 keep, np.bool_(want_top), self.chunk_size,
                                                 mesh=self.mesh)
        self._send_first_tokens()  # before the chunk's tokens, which come after them
        emitted = jax.device_get(emitted)
        for slot, sample in enumerate(self._slots):
            if sample is None:
                continue
            if sample.ticket.cancelled:
                self._finish(slot, sample, Delta(sample.index, [], "", [], [], "cancelled"))
            elif emitted.counts[slot] or not emitted.running[slot]:
                self._emit(slot, sample, emitted, slot)

    def _emit(self, slot: int, sample: _Sample, emitted: slots.Emitted, row: int) -> None:
        """Hands the sample its new tokens (row `row` of `emitted`) and frees its slot if it
        is done: a stop id, its token budget, its slot's capacity or a stop string."""
        count = int(emitted.counts[row])
        ids = emitted.tokens[row, :count].tolist()
        finish = None
        piece = ""
        if sample.text is not None:
            piece = sample.text.add(ids)
            if sample.text.stopped:  # a stop string: its tokens end with the one completing it
                ids = ids[:len(sample.text.ids) - len(sample.tokens)]
                finish = "stop"
        if finish is None and not emitted.running[row]:
            finish = "stop" if emitted.stop_reason[row] == StopReason.EOS else "length"
            if sample.text is not None:
                sent = sample.text.sent
                sample.text.finish(sample.tokens + ids)
                piece += sample.text.text[len(sent):]
        top = sample.ticket.request.logprobs
        delta = Delta(
            sample.index, ids, piece, emitted.logprobs[row, :len(ids)].tolist(),
            [list(zip(emitted.top_ids[row, k, :top].tolist(),
                      emitted.top_logprobs[row, k, :top].tolist(), strict=True))
             for k in range(len(ids))], finish)
        self._observe(sample, len(ids))
        sample.tokens.extend(ids)
        if finish is None:
            sample.ticket.on_delta(delta)
        else:
            self._finish(slot, sample, delta)

    def _finish(self, slot: int, sample: _Sample, delta: Delta) -> None:
        self._slots[slot] = None
        sample.ticket.unfinished -= 1
        sample.ticket.on_delta(delta)

    def _observe(self, sample: _Sample, count: int) -> None:
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

    def _report_load(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(self.queue_length, self.live_slots)

    def _fail_all(self, error: Exception) -> None:
        """Ends every queued and live request with `error` and starts from free slots."""
        with self._wake:
            tickets = {id(t): t for t in self._pending}
            self._pending.clear()
        tickets.update({id(s.ticket): s.ticket for s in self._slots if s is not None})
        self._slots = [None] * self.max_slots
        self._unsent = []
        self.state = slots.empty_state(self.config, self.max_slots, self.capacity,
                                       self.mesh)
        for ticket in tickets.values():
            ticket.on_delta(error)


def _row_settings(samples: list[tuple[GenerationRequest, int]]) -> slots.RowSettings:
    """Samples (request, index) as slots hold them (NumPy, so nothing runs eagerly)."""
    stop_ids = np.full((len(samples), slots.MAX_STOP_IDS), -1, np.int32)
    for row, (request, _) in enumerate(samples):
        stop_ids[row, :len(request.stop_ids)] = request.stop_ids
    sampling = SamplingParams(**{
        name: np.array([getattr(request, name) for request, _ in samples],
                       np.int32 if name in INTEGER_FIELDS else np.float32)
        for name in SAMPLING_FIELDS})
    return slots.RowSettings(
        max_tokens=np.array([r.max_tokens for r, _ in samples], np.int32), stop_ids=stop_ids,
        seed=np.stack([slots.seed_key(r.seed) for r, _ in samples]),
        sample=np.array([index for _, index in samples], np.int32), sampling=sampling)
