"""Whether the engine's cache fits its devices' memory, checked before it is allocated.

The engine allocates every slot and staged row at full length up front. Its `max_len`
defaults to the model's, which for an imported model is its whole context (32k-128k
positions): 32 rows of such a cache can take hundreds of GiB. Allocated blindly, that fails
deep inside XLA, or on a CPU pushes the machine into swap; checked here, it is refused with
the sizes and the longest `max_len` that would fit.
"""

from __future__ import annotations

import logging

import jax

from kvjax import model as M
from kvjax import parallel
from kvjax.model.cache_size import format_bytes
from kvjax.model.paged import most_pages_a_row_holds

# The cache may take this share of what is free when the engine starts: the prefill's and a
# step's activations and XLA's scratch space need the rest.
CACHE_SHARE = 0.9
CONTEXT_BYTES = 4  # int32 context tokens per row and position, which the penalties read


def free_bytes(device: jax.Device) -> int | None:
    """Bytes free on `device`: its allocator's limit less what is in use (GPU, TPU), or on a
    CPU the host's available memory (Linux's MemAvailable); None where neither is known."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def bytes_per_position(config: M.TransformerConfig, mesh=None) -> float:
    """Bytes one row of the engine's state takes per position on the device holding it: its
    K/V (kv heads split over `model` on a mesh) and its context token. Per row, so rows
    split over `data` are counted where they lie."""
    kv = M.cache_size_bytes(config, 1, 1).total
    if mesh is not None:
        kv /= mesh.shape[parallel.MODEL]
    return kv + CONTEXT_BYTES


def source_bytes_per_position(config: M.TransformerConfig, mesh=None) -> float:
    """Bytes one row's cross-attention K/V take per source position (0 for a language
    model): a translator's rows hold `max_source_len` of them beside their targets."""
    cross = M.cache_size_bytes(config, 1, 1).cross_attention
    return cross / (1 if mesh is None else mesh.shape[parallel.MODEL])


def devices_of(mesh) -> list:
    """The devices an engine's cache lies on, each of which it must fit: the mesh's local
    ones, or the default device."""
    return jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)


def least_free_bytes(devices) -> int | None:
    """The least free memory among `devices` in bytes, or None where none reports it."""
    known = [f for f in map(free_bytes, devices) if f is not None]
    return min(known) if known else None


def check_cache_fits(config: M.TransformerConfig, rows: int, capacity: int, mesh=None,
                     free: int | None = None,
                     rows_are: str = "max_slots + max_staged",
                     source_capacity: int | None = None, ring_rows: int = 0) -> None:
    """Raises ValueError when `rows` rows of `capacity` positions take more than
    `CACHE_SHARE` of the `free` bytes of the device that holds the most of them (default:
    measured on the mesh's local devices, or the default device), naming the sizes, the
    longest capacity that fits and the most rows that do. Does nothing where free memory is
    unknown. `rows_are` names the settings that add up to `rows`. A translator's rows hold
    `source_capacity` source positions each (default: `capacity`). `ring_rows` of the rows
    (the slots) hold windowed layers in rings of their window (`model/ring.py`): they are
    counted so; the largest sizes it names are those of rows of every position."""
    devices = devices_of(mesh)
    free = least_free_bytes(devices) if free is None else free
    if free is None:
        return
    data = 1 if mesh is None else mesh.shape[parallel.DATA]
    rows_per_device, per_position = -(-rows // data), bytes_per_position(config, mesh)
    sources = 0.0  # bytes a row holds apart from max_len: its sources, where sized apart
    if source_capacity is not None:
        per_source = source_bytes_per_position(config, mesh)
        per_position, sources = per_position - per_source, per_source * source_capacity
    per_row = per_position * capacity + sources
    ring_saves = 0.0  # bytes a row whose windowed layers keep rings holds less
    if ring_rows and source_capacity is None:
        ring_saves = (M.cache_size_bytes(config, 1, capacity).self_attention
                      - M.generate_cache_bytes(config, 1, capacity))
        ring_saves /= 1 if mesh is None else mesh.shape[parallel.MODEL]
    need = per_row * rows_per_device - ring_saves * -(-ring_rows // data)
    budget = CACHE_SHARE * free
    if need <= budget:
        return
    length_fits = max(0, int((budget / rows_per_device - sources) // per_position)) // 64 * 64
    rows_fit = int(budget // per_row) * data
    where = "each device" if mesh is not None else str(devices[0])
    of_sources = ("" if source_capacity is None
                  else f" and max_source_len={source_capacity} source positions")
    raise ValueError(
        f"the engine's cache of {rows} rows x max_len={capacity} positions{of_sources} takes "
        f"{format_bytes(int(need))} on {where}, more than {CACHE_SHARE:.0%} of its "
        f"{format_bytes(free)} free: lower max_len ("
        + (f"{length_fits} at most" if length_fits else "none is small enough")
        + f" for {rows} rows) or {rows_are} ({rows_fit} at most for "
        f"max_len={capacity})")


def check_engine_fits(config: M.TransformerConfig, slots: int, staged: int,
                      prefix_rows: int, capacity: int, mesh=None,
                      pages: tuple[int, int] | None = None,
                      source_capacity: int | None = None, free: int | None = None) -> None:
    """The check of an engine's cache: contiguous slots (a translator's with sources of
    `source_capacity`), or `pages` (num_pages, page_size) beside staged and prefix rows,
    whose kept prefixes a paged engine also holds in a row's pages each
    (`pages.share_kept`)."""
    if pages is None:
        check_cache_fits(config, slots + staged + prefix_rows, capacity, mesh, free,
                         rows_are="max_slots + max_staged + prefix_cache_rows",
                         source_capacity=source_capacity, ring_rows=slots)
    else:
        check_paged_cache_fits(config, staged, capacity, slots, *pages, free, mesh=mesh,
                               prefix_rows=prefix_rows, source_capacity=source_capacity)


def staged_and_prefix_rows(config: M.TransformerConfig, slots: int, staged: int | None,
                           prefix_rows: int | None, capacity: int, mesh=None,
                           pages: tuple[int, int] | None = None,
                           source_capacity: int | None = None,
                           free: int | None = None) -> tuple[int, int]:
    """(max_staged, prefix_cache_rows) of an engine, each given or its default. Staged rows
    default to one a slot, or to the most (a multiple of the mesh's `data`) that fit
    `check_engine_fits` beside the slots where those would not: a staged row holds every
    position, where a slot of a model with windowed layers holds rings, so a long context's
    staged rows would otherwise take most of the memory. Kept prefixes default to a quarter
    of the staged rows. Where nothing fits, the defaults are those of
    the most memory: the engine's check then says what to lower."""
    if not (prefix_rows is None or isinstance(prefix_rows, int) and prefix_rows >= 0):
        raise ValueError(f"prefix_cache_rows={prefix_rows!r} must be an int >= 0")
    data = 1 if mesh is None else mesh.shape[parallel.DATA]

    def rows(staged: int) -> tuple[int, int]:
        if prefix_rows is not None:
            return staged, prefix_rows
        return staged, -(-max(1, staged // 4) // data) * data

    if staged is not None:
        return rows(staged)
    free = least_free_bytes(devices_of(mesh)) if free is None else free

    def fits(staged: int) -> bool:
        try:
            check_engine_fits(config, slots, *rows(staged), capacity, mesh, pages,
                              source_capacity, free=free)
        except ValueError:
            return False
        return True

    if free is None or slots % data or fits(slots) or not fits(data):
        return rows(slots)
    low, high = 1, slots // data  # staged rows in multiples of data: low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * data) else (low, middle)
    logging.getLogger(__name__).warning(
        "max_staged=%d: %d staged rows of max_len=%d beside the %d slots would not fit the "
        "device's free memory", low * data, slots, capacity, slots)
    return rows(low * data)


def check_paged_cache_fits(config: M.TransformerConfig, rows: int, capacity: int,
                           slots: int, num_pages: int, page_size: int,
                           free: int | None = None,
                           rows_are: str = "max_staged",
                           mesh=None, prefix_rows: int = 0,
                           source_capacity: int | None = None) -> None:
    """`check_cache_fits` for an engine whose `slots` keep their K/V in a pool of `num_pages`
    pages of `page_size` positions (each slot still keeps its `capacity` context tokens,
    and the rings of a model that mixes windowed layers with global ones),
    and after them a row's pages for each of `prefix_rows` kept prefixes, beside `rows`
    contiguous rows and those prefix rows: raises ValueError when all of it takes more than
    `CACHE_SHARE` of the `free` bytes (default: measured), naming the most pages that fit.
    On a `mesh` it counts one device's share: the rows and slots of its `data` shard, and
    the whole pool, of its kv heads (the pool is split over `model` only). A translator's
    slots and rows each hold `source_capacity` source positions besides."""
    free = least_free_bytes(devices_of(mesh)) if free is None else free
    if free is None:
        return
    data = 1 if mesh is None else mesh.shape[parallel.DATA]
    per_source = 0 if source_capacity is None else source_bytes_per_position(config, mesh)
    sources = per_source * (source_capacity or 0)  # a row's or slot's source
    per_position = bytes_per_position(config, mesh) - per_source
    kv = per_position - CONTEXT_BYTES
    per_row = -(-capacity // page_size)
    page_kv, slot_rings = (x / (1 if mesh is None else mesh.shape[parallel.MODEL])
                           for x in M.paged_cache_bytes(config, per_row * page_size))
    slots_per_device = -(-slots // data)
    fixed = ((per_position * capacity + sources) * -(-rows // data)
             + (CONTEXT_BYTES * capacity + slot_rings + sources) * slots_per_device
             + kv * -(-prefix_rows // data) * capacity  # a prefix row: no context ...
             + page_kv * prefix_rows * per_row * page_size)  # ... and its pages
    need, budget = fixed + page_kv * num_pages * page_size, CACHE_SHARE * free
    if need <= budget:
        return
    pages_fit = max(0, int((budget - fixed) // (page_kv * page_size)))
    least = most_pages_a_row_holds(per_row, config.attention_reach, page_size)
    hint = (f"lower num_pages ({pages_fit} at most)" if pages_fit >= least else
            f"lower max_len, max_slots or {rows_are} (a slot's {least} pages do not fit)")
    raise ValueError(
        f"the engine's cache of {num_pages} pages of {page_size} positions for {slots} slots "
        f"and {rows} rows x max_len={capacity} positions ({rows_are}) takes "
        f"{format_bytes(int(need))}, more than {CACHE_SHARE:.0%} of the "
        f"{format_bytes(free)} free: {hint}")


def pages_in(config: M.TransformerConfig, cache_bytes: int, page_size: int, slots: int,
             capacity: int, source_capacity: int | None = None) -> int:
    """Pages of `page_size` positions that `cache_bytes` hold beside the rings each of
    `slots` slots of `capacity` positions keeps for a model's windowed layers, where it
    mixes them with global ones (`M.paged_cache_bytes`), and a translator's slots' sources
    of `source_capacity` positions: `kvjax serve --cache-memory`."""
    per_row = -(-capacity // page_size)
    page_kv, slot_rings = M.paged_cache_bytes(config, per_row * page_size)
    sources = 0 if source_capacity is None else (
        source_bytes_per_position(config) * source_capacity)
    return max(0, int((cache_bytes - slots * (slot_rings + sources)) // (page_kv * page_size)))
