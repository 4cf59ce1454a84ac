"""What the engine runs between two chunks for one request on its own: a prompt's logprobs
(`Engine.score_prompt`) and a beam search (a request with `beam_search`, vLLM's
`use_beam_search`).

Neither fits the slots: scoring makes no tokens, and a beam search keeps `n` hypotheses
that it reorders at every step, which `decode.beam_search` does in one compiled loop over a
cache of its own. Both run on the engine's thread, in one order with its chunks (as
processes serving a model over many hosts must), each to its end: the slots wait meanwhile.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable

from kvjax import decode
from kvjax import model as M
from kvjax.decode.loop import StopReason

from .requests import Delta


class BetweenChunks:
    """A queue of programs, each for one request: (adapter, program, future, ticket)."""

    def __init__(self):
        self._queue: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, program: Callable[[], object], adapter: int, ticket=None
            ) -> concurrent.futures.Future:
        """Queues `program` (run for a request of `adapter`, whose `ticket` hears of a
        failure, if it has one); its future holds what it returns or raises."""
        future = concurrent.futures.Future()
        self._queue.append((adapter, program, future, ticket))
        return future

    def adapters(self) -> set[int]:
        """The adapters the queued programs read."""
        return {adapter for adapter, *_ in self._queue}

    def run_all(self) -> None:
        """Runs every queued program whose future was not cancelled, in order."""
        while self._queue:
            _, program, future, ticket = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(program())
                except Exception as error:  # noqa: BLE001 - it ends this request alone
                    future.set_exception(error)
                    if ticket is not None:
                        ticket.on_delta(error)

    def fail_all(self, error: Exception) -> None:
        """Ends every queued program's future, and its request, with `error`."""
        queued, self._queue = self._queue, collections.deque()
        for *_, future, ticket in queued:
            future.set_exception(error)
            if ticket is not None:
                ticket.on_delta(error)


def beam_deltas(engine, ticket) -> None:
    """Runs `ticket`'s beam search and hands its request each of the `n` best hypotheses,
    best first, as one finished `Delta` of sample j (after a cancel: nothing is run)."""
    request = ticket.request
    if ticket.cancelled:
        for index in range(request.n):
            ticket.on_delta(Delta(index, [], "", [], [], "cancelled"))
        return
    out = decode.beam_search(
        M.build_model(engine.config), engine.params, [list(request.prompt)],
        max_new_tokens=request.max_tokens, num_beams=request.n,
        num_return_sequences=request.n, length_penalty=request.length_penalty,
        eos_ids=request.stop_ids, return_logprobs=True, mesh=engine.mesh,
        constraint=request.constraint, adapters=engine.adapters, adapter=request.adapter,
        forced_end_id=request.forced_end_id, banned_ids=request.banned_ids)
    for index, (tokens, reason) in enumerate(zip(out.token_lists(), out.stop_reason,
                                                 strict=True)):
        ended = reason == StopReason.EOS
        text = "" if engine.tokenizer is None else engine.tokenizer.decode(
            tokens[:len(tokens) - ended], skip_special_tokens=request.skip_special_tokens)
        ticket.on_delta(Delta(index, tokens, text, out.logprobs[index, :len(tokens)].tolist(),
                              [[] for _ in tokens], "stop" if ended else "length"))
