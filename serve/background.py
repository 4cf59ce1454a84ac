"""Responses API answers made in the background (`background: true`, as OpenAI has them for
long tasks): the request is answered at once with the response queued; a task of the event
loop gathers the engine's tokens while the client reads the response as it stands
(`GET /v1/responses/{id}`), cancels it (`POST /v1/responses/{id}/cancel`, which frees its
slot) or deletes it. Ended (completed, incomplete, cancelled or failed), it is kept in the
response store as any other answer is; a server shutting down cancels those still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .response_answers import ResponseAnswer


class BackgroundResponses:
    """The background answers still running; `count` counts a request by how it ended
    (the server's metrics)."""

    def __init__(self, count: Callable[[str], None]):
        self._count = count
        self._running: dict[str, tuple[ResponseAnswer, asyncio.Task]] = {}

    def start(self, answer: ResponseAnswer, next_delta: Callable[[], Awaitable]) -> dict:
        """Runs `answer`, whose `tickets` the engine serves, adding what each `next_delta()`
        brings until it is done; the response as it stands now, kept as it stands so that a
        request going on from it is told it has not ended."""
        task = asyncio.ensure_future(self._run(answer, next_delta))
        self._running[answer.id] = (answer, task)
        if answer.store is not None:
            answer.store.put(answer.current(), [], answer.items)
        return answer.current()

    async def _run(self, answer: ResponseAnswer, next_delta) -> None:
        try:
            while not answer.done:
                await next_delta()
            answer.final()
            self._count("completed")
        except Exception as error:  # noqa: BLE001 - the engine failed: the answer says so
            answer.end("failed", {"code": "server_error",
                                  "message": f"generation failed: {error!r}"})
            self._count("error")
        finally:
            self._running.pop(answer.id, None)

    def get(self, response_id: str) -> ResponseAnswer | None:
        """The running answer `response_id`, or None if it is not running."""
        running = self._running.get(response_id)
        return None if running is None else running[0]

    def cancel(self, response_id: str) -> dict | None:
        """Stops the running answer `response_id` and frees its slot: the response, now
        cancelled; None if it is not running."""
        running = self._running.pop(response_id, None)
        if running is None:
            return None
        answer, task = running
        task.cancel()
        for ticket in answer.tickets:
            ticket.cancel()
        self._count("cancelled")
        return answer.end("cancelled")

    def cancel_all(self) -> None:
        """Stops every running answer, as the server shuts down."""
        for response_id in list(self._running):
            self.cancel(response_id)
