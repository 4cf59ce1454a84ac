"""The responses a server keeps (the Responses API's `store`, on by default as OpenAI has it),
so that a request can go on from one (`previous_response_id`) and a client can read one back
(`GET /v1/responses/{id}`) or delete it.

They are kept in memory, at most `capacity` of them: storing one more drops the least
recently stored or read. A server that restarts has none. Each holds the response as it was
answered, the conversation a later request goes on from: the messages its input ended
with (the earlier turns included, its `instructions` not, as OpenAI does not carry them
over) and its answer as the assistant's message, and its input items
(`response_items.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Kept:
    response: dict
    conversation: list[dict]
    items: list[dict] = dataclasses.field(default_factory=list)


class ResponseStore:
    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"a response store holds capacity >= 0 responses, got {capacity!r}")
        self.capacity = capacity
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests are parsed off the event loop

    def put(self, response: dict, conversation: list[dict], items: list[dict] = ()) -> None:
        """Keeps `response`, the chat messages a request that goes on from it starts with,
        and its input items."""
        with self._lock:
            self._kept[response["id"]] = Kept(response, conversation, list(items))
            self._kept.move_to_end(response["id"])
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> Kept | None:
        """The response kept under `response_id`, or None."""
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is not None:
                self._kept.move_to_end(response_id)
            return kept

    def delete(self, response_id: str) -> bool:
        """Whether the response was kept (it is not now)."""
        with self._lock:
            return self._kept.pop(response_id, None) is not None
