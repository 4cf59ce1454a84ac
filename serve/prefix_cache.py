"""Prefix caching: a prompt that starts like an earlier one reuses that one's K/V instead of
prefilling it again (a shared system prompt, few-shot examples, a chat's earlier turns).

The engine keeps `rows` extra cache rows, the store. After a prefill, the K/V of a prompt's
full blocks of `block` tokens are copied into a store row (the least recently used one goes),
and each of those blocks is keyed by a hash chain of the tokens up to its end, so a key
names a whole prefix, never a block alone. A new prompt looks up its own chain: the longest
prefix found (in whole blocks, leaving at least its last token to feed) is copied from the
store into its staging row, and only the rest of the prompt runs through the model, as a
continuation of that cache (`prefill_after_prefix`). A row's tokens are kept beside its
keys and compared on every hit, so no hash collision can hand out another prompt's K/V.
A prompt served with a LoRA adapter (`model.lora_rows`) has other K/V than the same tokens
without it, and a request may ask to share prefixes only with requests of its own
`cache_salt` (vLLM's: one tenant cannot learn from a faster answer what another's prompts
held). Both make its `Origin`, which starts its chain and is kept and compared as the tokens
are.

K/V at a position depend only on the tokens up to it (causal attention), so a prefix's K/V
are the same whichever longer prompt computed them; a continuation computes the rest with
other matrix shapes than one prefill would, so its logits can differ from a miss's in the
last bits, as `decode.prefill` followed by `generate(..., state=...)` does.

Shape letters: B rows of one prefill, P padded prompt length, T new tokens per row (the
prompt less its prefix, padded), C context buffer (= the staging cache's capacity), V vocab.
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel
from kvjax.decode.buckets import bucket
from kvjax.decode.prompt_state import prefill_state, prompt_context
from kvjax.decode.tracing import count_trace
from kvjax.model import lora_rows

DEFAULT_BLOCK = 16  # tokens per keyed block: prefixes are reused in whole blocks

Origin = tuple[int, str]  # (LoRA adapter index, cache salt) of a prompt, beside its tokens
PLAIN: Origin = (0, "")  # the base model's, unsalted


def origin_of(request) -> Origin:
    """A `GenerationRequest`'s origin: its adapter and cache salt (`PLAIN` for None)."""
    return PLAIN if request is None else (request.adapter, request.cache_salt or "")


class PrefixIndex:
    """Which store row holds which prompt prefix; host-side bookkeeping only.

    `lookup(prompt)` finds the longest kept prefix of `prompt`; `keep(prompt)` picks the
    row to copy a prefilled prompt's full blocks into (None if a row holds them already)
    and indexes them. Rows are reused least recently used first, a hit counting as use."""

    def __init__(self, rows: int, block: int = DEFAULT_BLOCK):
        if rows < 1 or block < 1:
            raise ValueError(f"a prefix index needs rows >= 1 and block >= 1, got {rows=}, "
                             f"{block=}")
        self.rows, self.block = rows, block
        self._where: dict[bytes, tuple[int, int]] = {}  # chain key -> (row, tokens)
        self._tokens: list[tuple[int, ...]] = [()] * rows  # what each row holds
        self._origins: list[Origin] = [PLAIN] * rows  # and of which origin
        self._keys: list[list[bytes]] = [[] for _ in range(rows)]
        self._recent = collections.OrderedDict((row, None) for row in range(rows))
        self.pinned: set[int] = set()  # rows `keep` must not reuse (a prompt fed in parts)
        # Samples reading a row's pages in place (a paged engine's), which it must keep.
        self.borrowed: collections.Counter[int] = collections.Counter()

    def _chain(self, prompt, blocks: int, origin: Origin = PLAIN) -> list[bytes]:
        """The keys of `prompt`'s first 1, 2, ..., `blocks` blocks (of `origin`)."""
        adapter, salt = origin
        keys, digest = [], b"" if origin == PLAIN else hashlib.blake2b(
            adapter.to_bytes(8, "little") + salt.encode(), digest_size=16).digest()
        for i in range(blocks):
            block = np.asarray(prompt[i * self.block:(i + 1) * self.block], np.int64)
            digest = hashlib.blake2b(digest + block.tobytes(), digest_size=16).digest()
            keys.append(digest)
        return keys

    def _held(self, prompt, key: bytes, origin: Origin = PLAIN) -> tuple[int, int] | None:
        """(row, length) of the prefix `key` names, if a row holds it."""
        row, length = self._where.get(key, (-1, 0))
        if (row < 0 or self._tokens[row][:length] != tuple(prompt[:length])
                or self._origins[row] != origin):
            return None
        self._recent.move_to_end(row)
        return row, length

    def lookup(self, prompt, origin: Origin = PLAIN) -> tuple[int, int]:
        """(store row, prefix length) of the longest prefix of `prompt` kept with its
        `origin` that leaves at least its last token to feed; (-1, 0) if none."""
        for key in reversed(self._chain(prompt, (len(prompt) - 1) // self.block, origin)):
            if (held := self._held(prompt, key, origin)) is not None:
                return held
        return -1, 0

    def keep(self, prompt, origin: Origin = PLAIN) -> int | None:
        """The row to copy `prompt`'s full blocks into, now indexed as holding them; None
        when it has no full block, a row holds them all already, or every row is pinned."""
        keys = self._chain(prompt, len(prompt) // self.block, origin)
        if not keys or self._held(prompt, keys[-1], origin) is not None:
            return None
        row = next((r for r in self._recent
                    if r not in self.pinned and not self.borrowed[r]), None)
        if row is None:
            return None
        del self._recent[row]
        for key in self._keys[row]:
            if self._where.get(key, (-1,))[0] == row:
                del self._where[key]
        for i, key in enumerate(keys):
            self._where[key] = (row, (i + 1) * self.block)
        self._keys[row] = keys
        self._tokens[row] = tuple(int(t) for t in prompt[:len(keys) * self.block])
        self._origins[row] = origin
        self._recent[row] = None
        return row


    def forget(self, adapter: int) -> None:
        """Drops every prefix kept with `adapter` (its slot now holds another, or none): its
        rows are the first to be reused."""
        for row in range(self.rows):
            if adapter and self._origins[row][0] == adapter:
                for key in self._keys[row]:
                    if self._where.get(key, (-1,))[0] == row:
                        del self._where[key]
                self._keys[row], self._tokens[row], self._origins[row] = [], (), PLAIN
                self._recent.move_to_end(row, last=False)


class PrefixCache:
    """The engine's store of `rows` rows of `capacity` slots (on `mesh` split as its other
    rows are) and their index; counts the prompts that hit and the tokens they reused."""

    def __init__(self, config: M.TransformerConfig, rows: int, block: int, capacity: int,
                 mesh=None):
        self.config, self.capacity, self.mesh = config, capacity, mesh
        self.index = PrefixIndex(rows, block)
        self.store = empty_store(config, rows, capacity, mesh)
        self.hits = self.tokens_reused = 0
        self.written = np.zeros(rows, np.int32)  # positions copied into each row, not yet
        # taken by `take_written`

    def lookup(self, prompts: list, origins: list[Origin] | None = None
               ) -> list[tuple[int, int]]:
        """(store row, prefix length) of each prompt's longest kept prefix ((-1, 0): none),
        kept with its origin (`origins`, default `PLAIN`).
        A prompt's rest is fed padded to the bucket of the longest rest among the hits; a
        hit whose prefix and that padding would not fit `capacity` counts as a miss."""
        origins = [PLAIN] * len(prompts) if origins is None else origins
        found = [self.index.lookup(p, o) for p, o in zip(prompts, origins, strict=True)]
        rests = [len(p) - n for p, (_, n) in zip(prompts, found, strict=True) if n]
        rest = bucket(max(rests, default=1), self.capacity)
        return [(row, n) if n + rest <= self.capacity else (-1, 0) for row, n in found]

    def leaders(self, prompts: list, origins: list[Origin] | None = None) -> list[int]:
        """Of the prompts that no kept prefix serves and whose first full block (with a
        token after it) a later one of them shares, the first of each such set: prefilled
        and kept first, it serves the others' shared part."""
        block, first, leaders = self.index.block, {}, []
        origins = [PLAIN] * len(prompts) if origins is None else origins
        for i, (prompt, origin) in enumerate(zip(prompts, origins, strict=True)):
            if len(prompt) <= block or self.index.lookup(prompt, origin)[1]:
                continue
            head = (origin, tuple(prompt[:block]))
            if head not in first:
                first[head] = i
            elif first[head] not in leaders:
                leaders.append(first[head])
        return sorted(leaders)

    def prefill(self, params, tokens_BP: np.ndarray, lengths_B: np.ndarray,
                hits: list[tuple[int, int]], rest_BT: np.ndarray, adapters=None,
                adapter_B=None):
        """`prefill_after_prefix` of prompts that all hit (`hits` from `lookup`, one per row
        of `tokens`), `rest` their tokens after the prefix, into `capacity` slots: one
        program per row count and bucket of the rest, as many as plain prefills take. Row b
        adds adapter `adapter_B[b]` of `adapters` (`model.lora_rows`), if given."""
        tokens_BC = np.pad(tokens_BP, ((0, 0), (0, self.capacity - tokens_BP.shape[1])))
        return prefill_after_prefix(self.config, params, self.store,
                                    np.array([row for row, _ in hits], np.int32),
                                    np.array([n for _, n in hits], np.int32), tokens_BC,
                                    lengths_B, rest_BT, self.capacity, adapters, adapter_B)

    def count_hits(self, hits: list[tuple[int, int]], metrics=None) -> None:
        """Counts prompts that hit (`hits` from `lookup`) and the tokens they reused, here
        and in `metrics` (a `ServeMetrics`) if given."""
        reused = sum(n for _, n in hits)
        self.hits += len(hits)
        self.tokens_reused += reused
        if metrics is not None:
            metrics.count_prefix_hits(len(hits), reused)

    def left_to_prefill(self, prompt, origin: Origin = PLAIN) -> int:
        """The tokens of `prompt` after its longest prefix kept with its `origin`."""
        return len(prompt) - self.index.lookup(prompt, origin)[1]

    def feed_part(self, params, prompt, part: int, origin: Origin = PLAIN,
                  adapters=None) -> None:
        """Prefills the next `part` tokens (a multiple of the block) of a prompt too long to
        prefill in one turn after its longest kept prefix, and keeps the result, pinned
        until the next part: a long prompt is prefilled a part per engine turn, while the
        slots go on decoding between them. With no `prompt` (None) nothing stays pinned.
        The prompt is served with `origin`, whose adapter is one of `adapters` (0: none)."""
        self.index.pinned.clear()
        if prompt is None:
            return
        row, reused = self.index.lookup(prompt, origin)
        fed = reused + part
        tokens = np.asarray(prompt[:fed], np.int32)[None]
        adapter_B = None if adapters is None else np.array([origin[0]], np.int32)
        if reused == 0:
            prefilled = prefill_after_nothing(self.config, params, tokens,
                                              bucket(part, self.capacity), adapters, adapter_B)
        else:
            width = bucket(part, self.capacity)
            if reused + width > self.capacity:  # the padding would not fit: none
                width = part
            rest = np.zeros((1, width), np.int32)
            rest[0, :part] = prompt[reused:fed]
            prefilled = self.prefill(params, tokens, np.array([fed], np.int32),
                                     [(row, reused)], rest, adapters, adapter_B)
        self.keep([prompt[:fed]], prefilled[0], origins=[origin])
        kept, length = self.index.lookup(prompt[:fed + 1], origin)
        if length == fed:
            self.index.pinned.add(kept)

    def keep(self, prompts: list, cache: M.KVCache, rows: list[int] | None = None,
             pad_to: int | None = None, origins: list[Origin] | None = None) -> None:
        """Copies the rows of `cache` that hold `prompts` (`rows`, default 0, 1, ...; of
        `origins`, default `PLAIN`) into the store, those whose full blocks no store row
        holds; the copy is padded to `pad_to` rows (default the cache's), so that one
        program serves every count."""
        rows = range(len(prompts)) if rows is None else rows
        origins = [PLAIN] * len(prompts) if origins is None else origins
        block = self.index.block
        kept = [(row, into, len(prompt) // block * block)
                for row, prompt, origin in zip(rows, prompts, origins, strict=True)
                if (into := self.index.keep(prompt, origin)) is not None]
        if kept:
            self._copy(cache, kept, pad_to)
            for _, into, length in kept:
                self.written[into] = length

    def take_written(self) -> np.ndarray | None:
        """[rows] the positions copied into each store row since the last call (0: none),
        or None if no row was written."""
        if not self.written.any():
            return None
        written, self.written = self.written, np.zeros_like(self.written)
        return written

    def give_back(self, row: int) -> None:
        """A sample `borrow` counted for reads the row's pages no longer."""
        self.index.borrowed[row] -= 1

    def borrow(self, hits: list[tuple[int, int]], page_size: int) -> list[tuple[int, int]]:
        """(store row, whole pages) of each hit's prefix that a paged engine's sample reads
        in place; the row is kept for it until `index.borrowed[row]` is counted down."""
        shared = [(row, n // page_size) if n >= page_size else (-1, 0) for row, n in hits]
        self.index.borrowed.update(row for row, _ in shared if row >= 0)
        return shared

    def _copy(self, cache: M.KVCache, kept: list[tuple[int, int, int]],
              pad_to: int | None = None, width: int | None = None) -> None:
        """(row of `cache`, store row, full blocks' length) triples copied, padded with
        triples past the store, which copy nothing. Only the first `width` slots of each
        row are copied (default: the bucket of the longest length), not a row's capacity."""
        spare = (cache.batch_size if pad_to is None else pad_to) - len(kept)
        rows, into, lengths = zip(*(kept + [(0, self.index.rows, 0)] * spare), strict=True)
        if width is None:
            width = bucket(max(max(lengths), 1), cache.capacity)
        self.store = keep_prefixes(self.store, cache, np.array(rows, np.int32),
                                   np.array(into, np.int32), np.array(lengths, np.int32),
                                   width, mesh=self.mesh)

    def warm_up(self, cache: M.KVCache, pad_to: int | None = None,
                longest: int | None = None) -> None:
        """Compiles the copies from a cache of `cache`'s shape, copying nothing, for prompts
        of up to `longest` tokens (default: as many as it holds)."""
        longest = cache.capacity if longest is None else min(longest, cache.capacity)
        block = self.index.block
        for width in sorted({bucket(n, cache.capacity)  # a prompt keeps whole blocks
                             for n in range(block, longest + 1, block)}):
            self._copy(cache, [], pad_to, width)


def prefill_after_nothing(config, params, tokens_1P: np.ndarray, capacity: int,
                          adapters=None, adapter_B=None):
    """The first part of a long prompt, prefilled alone into `capacity` slots."""
    padded = np.zeros((1, capacity), np.int32)
    padded[0, :tokens_1P.shape[1]] = tokens_1P[0]
    return prefill_state(config, params, padded, np.array([tokens_1P.shape[1]], np.int32),
                         capacity, adapters, adapter_B)


@functools.partial(jax.jit, static_argnums=(0, 8))
def prefill_after_prefix(config, params, store: M.KVCache, store_rows_B, prefix_lengths_B,
                         tokens_BP, lengths_B, rest_BT, capacity: int, adapters=None,
                         adapter_B=None):
    """`decode.prompt_state.prefill_state`'s (cache, next_logits, context, context_lengths)
    for prompts `tokens` [B, P] (`lengths` valid) whose first `prefix_lengths` tokens are
    held by store rows `store_rows`: those are copied, and the rest, `rest` [B, T] (each
    row's prompt from its prefix on, padded), fed after them in one call."""
    count_trace("prefill_after_prefix")
    cache = store.take_prefixes(store_rows_B, prefix_lengths_B, capacity)
    rest_lengths_B = lengths_B - prefix_lengths_B
    logits_BTV, cache = M.step_fn(config, params, lora_rows.for_rows(adapters, adapter_B))(
        rest_BT, cache, rest_lengths_B)
    logits_BV = logits_BTV[jnp.arange(rest_BT.shape[0]), rest_lengths_B - 1]
    return (cache, logits_BV, *prompt_context(config, tokens_BP, lengths_B, capacity))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def empty_store(config, rows: int, capacity: int, mesh=None) -> M.KVCache:
    """A store of `rows` rows of `capacity` slots, on `mesh` split as the engine's rows are."""
    return parallel.constrain_rows(M.init_cache(config, rows, capacity), mesh)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=5, static_argnames="mesh")
def keep_prefixes(store: M.KVCache, prefilled: M.KVCache, rows_R, into_R, lengths_R,
                  width: int, mesh=None) -> M.KVCache:
    """The store with the first `lengths` [R] slots of rows `rows` of a prefill's cache
    copied into its rows `into` (a row of `into` past the last one copies nothing), `width`
    slots of each (at least every length): a copy costs what the prompts hold, not the
    rows' capacity."""
    count_trace("keep_prefixes")
    kept = prefilled.take_prefixes(rows_R, lengths_R, width)
    return parallel.constrain_rows(
        store.put_rows(kept, jnp.arange(rows_R.shape[0], dtype=jnp.int32), into_R), mesh)
