"""Serving: a continuous-batching engine and an OpenAI-compatible HTTP server (`kvjax serve`).

`engine.Engine` keeps a fixed number of decode slots busy with requests that join and leave
a running batch: the host prefills them into staged rows (`slots.py`) and the compiled decode
chunk moves each into a slot as one frees (`chunk.py`); `server.build_app` puts it behind
`/v1/completions` and `/v1/chat/completions`. Nothing here is imported by `kvjax` itself.
"""

from .engine import Engine, EngineFailed, QueueFull
from .output import Ticket
from .requests import Delta, GenerationRequest

__all__ = ["Delta", "Engine", "EngineFailed", "GenerationRequest", "QueueFull", "Ticket"]
