"""Continuous batching: requests join and leave a running batch of decode slots.

The engine owns `max_slots` slots (a row of `max_len` positions each, or pages of a pool),
`max_staged` staged rows and a bounded queue of requests waiting for those (`slots.py`). It
schedules; what the programs make is handed out by `output.py`. Each turn of its host loop:
  0. runs what waits between chunks: prompts' logprobs, beam searches (`between_chunks.py`);
  1. stages: prefills a part of a prompt too long for one turn (`prefill_part`); while the
     first other waiting request's `n` samples (by `priority`, then age) fit, prefills its
     prompt once with others of its length (`prefill_groups.py`; on a CPU beside the chunk
     in flight, `prefill_thread.py`), after a kept prefix if it has one (`prefix_cache.py`),
     into `n` free staged rows, each sample with its first token (`staging.py`);
  2. dispatches one chunk of `chunk_size` decode steps over every slot (`chunk.py`): on the
     device, each slot that frees is taken at once by the next staged sample, and the
     chunk ends early if a slot frees with none staged while requests wait on the host;
  3. while that chunk runs, hands out what the previous chunk and the staging made
     (`Outputs`): each sample's new tokens and text go to its request's callback; a sample
     that met a stop string or whose request was cancelled stops with the next chunk; one
     preempted to give its pages to others (`pages.py`) is queued again, first of its priority.
Slots wait for no host turn, so a chunk can be long; a request waits one turn to be staged,
a cancelled one runs at most one chunk longer. `start` runs the loop on its own thread;
`step` runs one turn where the caller is (tests, benchmarks). `warm_up.py` compiles first."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Iterable

import jax
import numpy as np

from kvjax import model as M
from kvjax import parallel
from kvjax.decode import checks
from kvjax.decode.prepare import placement
from kvjax.model import lora_rows
from kvjax.tokenizer import TextTokenizer

from . import (
    between_chunks,
    chunk,
    constrained,
    memory,
    pages,
    prefill_groups,
    prefix_cache,
    slots,
    staging,
    warm_up,
)
from .output import Dispatched, OnDelta, Outputs, Ticket
from .prefill_thread import prefill_dispatcher
from .prompt_logprobs import prompt_logprobs
from .requests import Delta, GenerationRequest


class QueueFull(Exception):
    """The queue of requests waiting for a slot is full: try again later."""


class EngineFailed(Exception):
    """The engine failed and could not free its slots to serve again: it takes nothing more."""


class Engine:
    """Serves `GenerationRequest`s with continuous batching: a language model's, or an
    encoder-decoder's (a translator's: the prompt is its source, of up to `max_source_len`
    tokens, default `max_len`; contiguous slots, no prefix cache).

    `tokenizer` (optional) turns each sample's tokens into text as they come, so that stop
    strings can end it. Up to `prefill_batch` waiting prompts are prefilled in one call (the
    number rounded up to a power of two: a few programs serve every count). `metrics` (optional,
    see `metrics.ServeMetrics`) is told of the load, first tokens and token times. On a `mesh`
    (or the one `params` are sharded over) the slots are split over its `data` axis, each device
    decoding its share, and the params over `model` by `kvjax.parallel`'s rules; `max_slots`,
    `max_staged` and `prefix_cache_rows` must be multiples of `data`.

    Each slot holds a row of `max_len` positions, or with `page_size` the slots keep their K/V
    in a pool of `num_pages` pages of that many positions (default: `max_slots` full slots'
    worth) taken as samples grow, samples preempted and resumed when it runs short (`pages.py`).
    `max_staged` (default `max_slots`, fewer where those would not fit beside the slots) and
    `prefix_cache_rows` rows of `max_len` come beside them; the whole is refused before it is
    allocated if it would not fit the device's free memory (`memory.py`). `max_staged`
    bounds a request's `n` and the slots a chunk can refill before the host stages more.
    `chunk_size` and `steps_per_check` (a chunk runs its steps that many at a time) default
    to `chunk.default_chunk_size()`, `default_steps_per_check()`.

    `prefix_cache_rows` more rows (default a quarter of `max_staged`; 0: none) keep the K/V of
    recent prompts, so a prompt that starts like one of them prefills only the rest
    (`prefix_cache.py`), reused in blocks of `prefix_block` tokens. With them, a prompt with
    more than `prefill_part` tokens (whole blocks) to prefill is prefilled a part per turn, one
    such prompt at a time, so that the slots decode in between.

    `adapters`, LoRA adapters trained on `params` (`(adapters, lora)` pairs, or a
    `lora_rows.AdapterStack` of them), are served unmerged beside the base: a request's
    `adapter` (1 for the first, 0 for none) picks what each of its rows adds. A request's
    `beam_search` runs between chunks, on no slot (`between_chunks.py`)."""

    def __init__(self, config: M.TransformerConfig, params, *,
                 tokenizer: TextTokenizer | None = None, max_slots: int = 16,
                 max_staged: int | None = None, max_len: int | None = None,
                 chunk_size: int | None = None, steps_per_check: int | None = None,
                 max_queue: int = 64, prefill_batch: int = 8, prefix_cache_rows: int | None = None,
                 prefix_block: int = prefix_cache.DEFAULT_BLOCK, prefill_part: int = 512,
                 page_size: int | None = None, num_pages: int | None = None,
                 metrics=None, mesh=None, adapters=None, max_source_len: int | None = None):
        capacity = config.max_len if max_len is None else max_len
        chunk_size = chunk.default_chunk_size() if chunk_size is None else chunk_size
        if steps_per_check is None:
            steps_per_check = chunk.default_steps_per_check()
        for name, value in (("max_slots", max_slots),
                            ("max_staged", max_slots if max_staged is None else max_staged),
                            ("max_len", capacity), ("chunk_size", chunk_size),
                            ("steps_per_check", steps_per_check), ("max_queue", max_queue),
                            ("prefill_batch", prefill_batch), ("prefix_block", prefix_block),
                            ("prefill_part", prefill_part)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if capacity > config.max_len:
            raise ValueError(f"max_len={capacity} exceeds the model's max_len {config.max_len}")
        on = parallel.mesh_of(params) if mesh is None else mesh
        data = 1 if on is None else on.shape[parallel.DATA]
        self.source_capacity = slots.source_capacity(config, capacity, max_source_len,
                                                     prefix_cache_rows)
        prefix_cache_rows = 0 if self.source_capacity else prefix_cache_rows  # none for sources
        self.mesh, params = placement(config, params, mesh)
        self.pages = pages.choose_pages(page_size, num_pages, capacity, max_slots, config.max_len,
                                        config.attention_reach)
        max_staged, prefix_cache_rows = memory.staged_and_prefix_rows(
            config, max_slots, max_staged, prefix_cache_rows, capacity, self.mesh, self.pages,
            self.source_capacity)
        for name, rows in (("max_slots", max_slots), ("max_staged", max_staged),
                           ("prefix_cache_rows", prefix_cache_rows)):
            if rows % data:
                raise ValueError(f"{name}={rows} must be a multiple of the mesh's data={data}: "
                                 f"each device holds as many of those rows")
        self.config, self.params, self.tokenizer = config, params, tokenizer
        if adapters is not None and not isinstance(adapters, lora_rows.AdapterStack):
            adapters = lora_rows.stack(config, params, list(adapters)) if adapters else None
        self.adapters = lora_rows.placed(adapters, self.mesh)
        self.capacity, self.chunk_size, self.max_queue = capacity, chunk_size, max_queue
        self.prompt_capacity = self.source_capacity or capacity  # the longest prompt's bucket
        self.steps_per_check, self.prefill_batch = steps_per_check, prefill_batch
        self.max_slots, self.num_staged, self.metrics = max_slots, max_staged, metrics
        self.prefix_cache_rows, self.prefix_block = prefix_cache_rows, prefix_block
        self.prefill_part = max(1, prefill_part // prefix_block) * prefix_block
        memory.check_engine_fits(config, max_slots, max_staged, prefix_cache_rows, capacity,
                                 self.mesh, self.pages, self.source_capacity)
        self._dispatch_prefill = prefill_dispatcher(self.mesh)
        self._pending: collections.deque[Ticket] = collections.deque()
        self._between = between_chunks.BetweenChunks()  # scoring and beam searches
        self._placing: collections.deque = collections.deque()  # (index, adapter, future)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: Exception | None = None  # why the engine can serve no more, if it cannot
        self._reset()

    def _reset(self) -> None:
        self.state = slots.empty_state(self.config, self.max_slots, self.num_staged,
                                       self.capacity, self.mesh, self.pages,
                                       self.prefix_cache_rows if self.pages else 0,
                                       self.source_capacity)
        self.outputs = Outputs(self.tokenizer, self.metrics,  # the samples, by id
                               lambda row: self._prefixes.give_back(row))
        self._tables = constrained.TableKeeper()
        self._next_id = 0
        self._free_staged = list(range(self.num_staged))
        self._dispatched: list[Dispatched] = []
        self._staging: list[Ticket] = []
        self._live = self._waiting = 0
        self._long: Ticket | None = None  # the long prompt fed a part this turn
        self._prefixes = None if not self.prefix_cache_rows else prefix_cache.PrefixCache(
            self.config, self.prefix_cache_rows, self.prefix_block, self.capacity, self.mesh)

    # The caller's side -----------------------------------------------------------------

    @property
    def live_slots(self) -> int:
        """Slots decoding a sample, as of the last chunk handed out."""
        return self._live

    @property
    def queue_length(self) -> int:
        """Requests waiting to be staged, and samples staged waiting for a slot."""
        return len(self._pending) + self._waiting

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """`request` as `submit` queues it (seed drawn); a `checks.InvalidValue` names the
        first value this engine can never serve."""
        request = request.checked(self.config.vocab_size, self.capacity,
                                  self.source_capacity and M.prompt_slots(self.config, 0),
                                  self.source_capacity)
        served = 0 if self.adapters is None else self.adapters.count
        if not checks.is_int(request.adapter) or not 0 <= request.adapter <= served:
            raise checks.InvalidValue("adapter", f"adapter={request.adapter!r} is not among "
                                                 f"the {served} adapters served (0: none)")
        for rows, what in ((self.max_slots, "slots"), (self.num_staged, "staged rows")):
            if request.n > rows:  # a request's samples are staged together
                raise checks.InvalidValue("n", f"n={request.n} is more than the engine's "
                                               f"{rows} {what}")
        return request

    def submit(self, request: GenerationRequest, on_delta: OnDelta) -> Ticket:
        """Queues `request`; a ValueError names a bad value, `QueueFull` says to retry.
        `on_delta` is called on the engine's thread; should it raise, the request is cancelled."""
        ticket = Ticket(self.check(request), on_delta, self._notify)
        if ticket.request.beam_search:
            self._between_chunks(lambda: between_chunks.beam_deltas(self, ticket),
                                 ticket.request.adapter, ticket)
            return ticket
        with self._wake:
            self._refuse_if_broken()
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting for a slot, as "
                                f"many as the queue holds (max_queue={self.max_queue})")
            prefill_groups.enqueue(self._pending, ticket)
            self._wake.notify()
        self._report_load()
        return ticket

    def score_prompt(self, prompt: tuple[int, ...], top: int,
                     adapter: int = 0) -> concurrent.futures.Future:
        """A future of `prompt_logprobs(config, params, prompt, top)` (with `adapter`),
        computed on the engine's thread between chunks (`between_chunks.py`). `QueueFull`
        when `max_queue` programs wait there."""
        return self._between_chunks(lambda: prompt_logprobs(
            self.config, self.params, prompt, top, adapter, self.adapters), adapter)

    def _between_chunks(self, program, adapter: int, ticket=None) -> concurrent.futures.Future:
        with self._wake:
            self._refuse_if_broken()
            if len(self._between) >= self.max_queue:
                raise QueueFull(f"{len(self._between)} requests are waiting to be scored or "
                                f"searched, as many as the queue holds (max_queue="
                                f"{self.max_queue})")
            future = self._between.add(program, adapter, ticket)
            self._wake.notify()
        return future

    def put_adapter(self, index: int, adapter) -> concurrent.futures.Future:
        """A future done once adapter slot `index` (from 1) holds `adapter` (`(adapters, lora)`
        trained on the model; None: empty), placed between chunks with the stack's shapes
        kept (`lora_rows.put`: nothing compiles again), the prefixes kept with its old
        adapter dropped. Its ValueError names what the stack cannot hold, or a request for
        `index` still queued or decoding: a slot changes only while no request reads it."""
        if self.adapters is None:
            raise ValueError("this engine serves no adapters; give it a stack with room for "
                             "them (lora_rows.stack(..., capacity=N))")
        future = concurrent.futures.Future()
        with self._wake:
            self._refuse_if_broken()
            self._placing.append((index, adapter, future))
            self._wake.notify()
        return future

    def warm_up(self, prompt_lengths: Iterable[int] | None = None) -> None:
        """Compiles what serving can need before the loop starts (`warm_up.py`), so that no
        request waits for a compilation; `prompt_lengths` default to every length a slot holds."""
        warm_up.compile_programs(self, prompt_lengths)
        self._reset()

    def start(self) -> None:
        """Runs the loop on a thread of its own until `close` (and again after it)."""
        if self._thread is None:
            self._stopping = False
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
        """One turn, handing out everything it made; returns whether work remains."""
        self._turn(overlap=False)
        return self._busy()

    def _busy(self) -> bool:
        return bool(self._pending or self._between or self._placing or self.outputs.samples
                    or self._dispatched)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._busy()):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self._turn(overlap=True)
            except Exception as error:  # noqa: BLE001 - every request hears of it
                logging.getLogger(__name__).exception("the engine failed; its requests end")
                self._fail_all(error)
                if self.failure is not None:
                    return

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _turn(self, overlap: bool) -> None:
        """Stages what fits, dispatches a chunk and hands out what earlier programs made;
        with `overlap`, the chunk's own tokens wait for the next turn, so that the host's
        work here runs while the device decodes."""
        self._place_adapters()
        self._between.run_all()
        self.outputs.end_cancelled()
        self._feed_long_prompt()
        while tickets := self._admissible():
            self._staging = tickets  # off the queue, not yet on the device: see `_fail_all`
            staging.stage(self, tickets)  # prefilled into staged rows
        self._staging = []
        keep = 0  # programs left in flight
        if self.outputs.samples or self.outputs.to_stop:
            self.state, emitted = chunk.decode_chunk(
                self.config, self.params, self.state,
                self.outputs.take_stop_ids(self.max_slots + self.num_staged),
                np.bool_(self.outputs.want_top()), np.bool_(self._can_stage_more()),
                self.chunk_size, mesh=self.mesh, steps_per_check=self.steps_per_check,
                adapters=self.adapters)
            self._dispatched.append(Dispatched(emitted, [], is_chunk=True))
            keep = int(overlap)
        while len(self._dispatched) > keep:
            self._hand_out(self._dispatched.pop(0))
        self._report_load()

    def _place_adapters(self) -> None:
        while self._placing:
            index, adapter, future = self._placing.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._wake:
                    asked = {t.origin.request.adapter for t in (*self._pending, *self._staging)}
                    asked |= self._between.adapters()
                asked |= {s.ticket.request.adapter for s in self.outputs.samples.values()}
                if index in asked:
                    raise ValueError(f"adapter {index} is asked for by a request still queued "
                                     "or decoding; it changes once none is")
                self.adapters = lora_rows.placed(
                    lora_rows.put(self.config, self.params, self.adapters, index, adapter),
                    self.mesh)
                if self._prefixes is not None:
                    self._prefixes.index.forget(index)
                future.set_result(None)
            except Exception as error:  # noqa: BLE001 - it ends this call alone
                future.set_exception(error)

    def _admissible(self) -> list[Ticket]:
        """Takes the first queued ticket and those of its length near it (`prefill_groups`)
        whose samples fit the free staged rows (at most `prefill_batch`, prefilled together);
        cancelled ones are answered and dropped.

        While enough samples are staged to keep the slots busy and more tickets wait than
        the free rows take, it waits for rows to free: a prefill of a few prompts costs
        almost what one of `prefill_batch` does."""
        with self._wake:
            free, batch = len(self._free_staged), min(self.prefill_batch, self.num_staged)
            if (free < batch and len(self._pending) >= batch
                    and self._waiting >= max(1, self.max_slots // 4)):
                free = 0
            taken, dropped = prefill_groups.take_group(self._pending, free, self.prefill_batch,
                                                       self.prompt_capacity, self._too_long)
        for ticket in dropped:
            for index in ticket.indices():
                ticket.on_delta(Delta(index, [], "", [], [], "cancelled"))
        return taken

    def _can_stage_more(self) -> bool:  # a waiting request other than the long prompt
        with self._wake:
            return any(ticket is not self._long for ticket in self._pending)

    def _too_long(self, ticket: Ticket) -> bool:  # more than a part left to prefill
        prompt, origin = ticket.request.prompt, prefix_cache.origin_of(ticket.request)
        return (self._prefixes is not None and len(prompt) > self.prefill_part
                and self._prefixes.left_to_prefill(prompt, origin) > self.prefill_part)

    def _feed_long_prompt(self) -> None:
        """Prefills a part of the first waiting prompt that is too long for one turn."""
        with self._wake:
            self._long = next((t for t in self._pending
                               if not t.cancelled and self._too_long(t)), None)
        if self._prefixes is not None:
            long = self._long and self._long.request
            self._prefixes.feed_part(self.params, long and long.prompt, self.prefill_part,
                                     prefix_cache.origin_of(long), self.adapters)
            if self._long is not None:
                self._long.fed_in_parts += self.prefill_part
            self.state = pages.share_kept(self.state, self._prefixes)

    def _hand_out(self, dispatched: Dispatched) -> None:
        """Hands each sample what a program made (`Outputs`) and learns which staged rows
        are free: those not waiting after it, and not filled by a program after it."""
        emitted = jax.device_get(dispatched.emitted)
        self.outputs.hand_out(emitted)
        if preempted := self.outputs.take_preempted():  # first of their priority again
            with self._wake:
                prefill_groups.requeue_first(self._pending, preempted)
        filled = {r for later in self._dispatched for r in later.staged_rows}
        self._free_staged = [r for r in range(self.num_staged)
                             if not emitted.waiting[r] and r not in filled]
        self._waiting = int(emitted.waiting.sum()) + len(filled)
        if dispatched.is_chunk:
            self._live = int(emitted.live)

    def _report_load(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(self.queue_length, self.live_slots, self.outputs.pages_used)

    def _fail_all(self, error: Exception) -> None:
        """Ends every queued and live request with `error` and starts from free slots; if
        even that fails, the engine is broken: it ends what is queued and takes no more."""
        with self._wake:
            tickets = {id(t.origin): t.origin for t in [*self._pending, *self._staging]}
            self._pending.clear()
        tickets.update({id(s.ticket): s.ticket for s in self.outputs.samples.values()})
        try:
            self._reset()
        except Exception as reset_error:  # noqa: BLE001 - every request hears of it
            with self._wake:
                self.failure = reset_error
                tickets.update({id(t.origin): t.origin for t in self._pending})
                self._pending.clear()
                placing, self._placing = self._placing, collections.deque()
            self._between.fail_all(EngineFailed(f"the engine failed: {reset_error}"))
            for *_, future in placing:
                future.set_exception(EngineFailed(f"the engine failed: {reset_error}"))
        for ticket in tickets.values():
            ticket.on_delta(error)

    def _refuse_if_broken(self) -> None:  # holding `_wake`
        if self.failure is not None:
            raise EngineFailed(f"the engine failed and cannot serve again: {self.failure}")
