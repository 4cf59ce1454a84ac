"""What the engine runs between two chunks for one request on its own: a prompt's logprobs
(`Engine.score_prompt`) and a beam search (a request with `beam_search`, vLLM's
`use_beam_search`).

Neither fits the slots: scoring makes no tokens, and a beam search keeps `n` hypotheses
that it reorders at every step, which `decode.beam_search_chunks` does over a cache of its
own. Both run on the engine's thread, in one order with its chunks (as processes serving a
model over many hosts must): a scoring to its end, a beam search one chunk of the engine's
`chunk_size` steps a turn, so that the slots decode between its chunks rather than wait for
the whole search.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Generator

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
        failure, if it has one); its future holds what it returns or raises. A program
        that returns a generator runs one step of it a turn (`run_all`) until it returns."""
        future = concurrent.futures.Future()
        self._queue.append((adapter, program, future, ticket))
        return future

    def adapters(self) -> set[int]:
        """The adapters the queued programs read."""
        return {adapter for adapter, *_ in self._queue}

    def run_all(self) -> None:
        """Runs every queued program whose future was not cancelled, in order, and one step
        of each program's generator; those their step leaves unfinished stay first in the
        queue, in the same order."""
        unfinished = collections.deque()
        while self._queue:
            adapter, program, future, ticket = self._queue.popleft()
            started = isinstance(program, Generator)
            if not (started or future.set_running_or_notify_cancel()):
                continue
            try:
                work = program if started else program()
                if isinstance(work, Generator):
                    try:
                        next(work)
                    except StopIteration as done:
                        work = done.value
                    else:
                        unfinished.append((adapter, work, future, ticket))
                        continue
                future.set_result(work)
            except Exception as error:  # noqa: BLE001 - it ends this request alone
                future.set_exception(error)
                if ticket is not None:
                    ticket.on_delta(error)
        self._queue.extendleft(reversed(unfinished))

    def fail_all(self, error: Exception) -> None:
        """Ends every queued program's future, and its request, with `error`."""
        queued, self._queue = self._queue, collections.deque()
        for _, program, future, ticket in queued:
            if isinstance(program, Generator):
                program.close()
            if not future.done():
                future.set_exception(error)
            if ticket is not None:
                ticket.on_delta(error)


def beam_deltas(engine, ticket) -> Generator[None, None, None]:
    """Runs `ticket`'s beam search a chunk at a time (yielding after each that leaves it
    unfinished) and hands its request each of the `n` best hypotheses, best first, as one
    finished `Delta` of sample j. Once its request is cancelled, each sample ends
    "cancelled" and nothing more is searched."""
    request = ticket.request
    search = decode.beam_search_chunks(
        M.build_model(engine.config), engine.params, [list(request.prompt)],
        chunk_size=engine.chunk_size, max_new_tokens=request.max_tokens,
        num_beams=request.n, num_return_sequences=request.n,
        length_penalty=request.length_penalty, eos_ids=request.stop_ids,
        return_logprobs=True, mesh=engine.mesh, constraint=request.constraint,
        adapters=engine.adapters, adapter=request.adapter,
        forced_end_id=request.forced_end_id, banned_ids=request.banned_ids,
        bad_words=request.bad_words)
    while True:
        if ticket.cancelled:
            search.close()
            for index in range(request.n):
                ticket.on_delta(Delta(index, [], "", [], [], "cancelled"))
            return
        try:
            next(search)
        except StopIteration as done:
            out = done.value
            break
        yield
    for index, (tokens, reason) in enumerate(zip(out.token_lists(), out.stop_reason,
                                                 strict=True)):
        ended = reason == StopReason.EOS
        text = "" if engine.tokenizer is None else engine.tokenizer.decode(
            tokens[:len(tokens) - ended], skip_special_tokens=request.skip_special_tokens)
        ticket.on_delta(Delta(index, tokens, text, out.logprobs[index, :len(tokens)].tolist(),
                              [[] for _ in tokens], "stop" if ended else "length"))
