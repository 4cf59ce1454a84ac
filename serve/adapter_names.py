"""The names a server serves LoRA adapters under, and adapters loaded and unloaded while it
serves (vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`).

The engine holds a stack of adapter slots (`model.lora_rows`): slot i is what a request for
the i-th name adds. Loading reads an adapter with the server's loader (off the event loop),
then has the engine place it in a free slot between chunks; nothing compiles again. Unloading
takes the name away at once (a request for it is then a 404) and empties its slot once no
running request reads it; until then the slot is not free for another adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .protocol import APIError

EMPTY_RETRY_SECONDS = 0.05  # how often an unloaded slot is tried again while requests read it


class ServedAdapters:
    """The adapters' names by slot (slot i + 1 is `slots[i]`, None when free), over `engine`;
    `load` (a directory -> `(adapters, lora)`) enables loading while serving."""

    def __init__(self, engine, base_name: str, names: Sequence[str], capacity: int,
                 load: Callable[[str], tuple] | None = None):
        self.engine, self.base_name, self.load_from = engine, base_name, load
        self.slots: list[str | None] = [*names, *[None] * (capacity - len(names))]
        self._changing: set[int] = set()  # slots being filled or emptied
        self._loading: set[str] = set()  # names whose adapters are being read
        self._emptying: set[asyncio.Task] = set()

    @property
    def names(self) -> tuple[str | None, ...]:
        return tuple(self.slots)

    def served(self) -> list[str]:
        return [name for name in self.slots if name is not None]

    async def load(self, name, path) -> str:
        """Serves the adapter in `path` as `name`; an `APIError` says why it cannot."""
        if not isinstance(name, str) or not name:
            raise APIError(400, f"lora_name={name!r} must be a non-empty string", "lora_name")
        if not isinstance(path, str) or not path:
            raise APIError(400, f"lora_path={path!r} must be a directory on the server",
                           "lora_path")
        if name == self.base_name or name in self.slots or name in self._loading:
            raise APIError(400, f"`{name}` is the base model's name" if name == self.base_name
                           else f"The lora adapter `{name}` has already been loaded", "lora_name")
        free = self._free()
        if not free and self._emptying:  # slots unloaded, emptied once their requests end
            await asyncio.wait(set(self._emptying))
            free = self._free()
        if not free:
            raise APIError(400, f"every one of the {len(self.slots)} adapter slots holds an "
                                "adapter (or is being emptied): unload one first, or serve "
                                "with more (--max-loras)", "lora_name")
        slot = free[0]
        self._changing.add(slot)
        self._loading.add(name)
        try:
            try:  # what the directory holds is the client's: any error reading it is a 400
                adapter = await asyncio.to_thread(self.load_from, path)
            except Exception as error:  # noqa: BLE001
                raise APIError(400, f"cannot load the adapter in {path}: {error}",
                               "lora_path") from None
            try:
                await asyncio.wrap_future(self.engine.put_adapter(slot + 1, adapter))
            except ValueError as error:
                raise APIError(400, f"cannot serve the adapter in {path}: {error}",
                               "lora_path") from None
            self.slots[slot] = name
        finally:
            self._changing.discard(slot)
            self._loading.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def check_serves(self, name: str, index: int) -> None:
        """A 404 unless `name` is still what slot `index` serves (0: the base): a request
        parsed before its adapter was unloaded must not reach the slot's next adapter."""
        if index and self.slots[index - 1] != name:
            raise APIError(404, f"The model `{name}` was unloaded while this request was read",
                           "model", kind="not_found_error")

    def _free(self) -> list[int]:
        return [i for i, held in enumerate(self.slots) if held is None and i not in self._changing]

    async def unload(self, name) -> str:
        """Stops serving `name`; its slot is emptied once no running request reads it."""
        if not isinstance(name, str) or not name:
            raise APIError(400, f"lora_name={name!r} must be a non-empty string", "lora_name")
        if name not in self.slots:
            raise APIError(404, f"The lora adapter `{name}` is not loaded: this server serves "
                                f"{', '.join(f'`{n}`' for n in self.served()) or 'none'}",
                           "lora_name", kind="not_found_error")
        slot = self.slots.index(name)
        self.slots[slot] = None
        self._changing.add(slot)
        task = asyncio.ensure_future(self._empty(slot))
        self._emptying.add(task)
        task.add_done_callback(self._emptying.discard)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _empty(self, slot: int) -> None:
        try:
            while True:
                try:
                    await asyncio.wrap_future(self.engine.put_adapter(slot + 1, None))
                    return
                except ValueError:  # requests still read it: they end within their budget
                    await asyncio.sleep(EMPTY_RETRY_SECONDS)
        finally:
            if self.slots[slot] is None:
                self._changing.discard(slot)
