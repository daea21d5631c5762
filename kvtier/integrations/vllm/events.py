"""kvtier's tiers as vLLM KV events, so a KV-aware router sees more than the GPU.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` for its GPU prefix cache
(``--kv-events-config``); a connector adds its own through ``take_events`` on
the scheduler side. kvtier reports, in vLLM's block hashes (the ones the router
already tracks):

* ``BlockStored(medium="CPU")`` when a block's copy in host memory became
  readable (its copy out of vLLM's block completed on every rank);
* ``BlockStored(medium="STORAGE")`` when its L3 save completed on every rank;
* ``BlockRemoved(medium="CPU")`` when host memory evicts it;
* ``BlockRemoved(medium="STORAGE")`` when a lookup finds a block reported
  stored in L3 gone from the store: the store evicts on its own (a file cap,
  Redis maxmemory, a flushed or lost server), so the scheduler learns of it
  when it next asks, and says so then. A lookup stops at the first missing
  block, which is also where a router's prefix match would stop.

A hybrid model's events carry vLLM's group fields (``group_idx``,
``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``): the full group's
for every block, another group's for the blocks whose object (window page, state
snapshot) went out with it (one event per contiguous run); a block leaving host
memory takes its objects with it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.hashing import PageHash
from kvtier.radix import STORED


@dataclass
class _Planned:
    copy_op: int | None
    save_op: int | None
    keys: list[PageHash]
    #: per page: (vLLM block hash, parent hash, token ids)
    blocks: list[tuple[object, object, list[int]]]
    on_host: bool = False
    #: a hybrid model: per other group, whether each page's object (window page, state snapshot) went out with it
    objects: dict[str, list[bool]] | None = None


class TierEvents:
    def __init__(self, block_size: int, max_storage_entries: int = 1 << 20, groups: list | None = None):
        self.block_size = block_size
        #: a hybrid model's groups (:class:`~kvtier.integrations.vllm.groups.VllmGroup`); None: one group, no group fields
        self.groups = groups
        self._full = next((g for g in groups if g.kind == "full"), None) if groups else None
        #: per other group, the pages whose object was reported stored on host
        self._objects_on_host: dict[str, set[PageHash]] = {g.name: set() for g in groups or () if g.kind != "full"}
        self._planned: list[_Planned] = []
        #: page key -> vLLM block hash, for the pages whose host copy was reported stored
        self._on_host: dict[PageHash, object] = {}
        #: the same for pages reported stored in L3 (bounded: the oldest are forgotten, not reported)
        self._in_storage: OrderedDict[PageHash, object] = OrderedDict()
        self.max_storage_entries = max_storage_entries
        self._events: list[KVCacheEvent] = []

    def planned(self, request, first: int, keys: list[PageHash], copy_op: int | None, save_op: int | None,
                objects: dict[str, list[bool]] | None = None) -> None:
        """Pages ``first:first + len(keys)`` of ``request`` are being copied out (and saved); ``objects``: per
        other group, whether each of them goes with its object."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        if len(hashes) < first + len(keys) or copy_op is None:
            return  # vLLM hashes blocks only with its prefix cache on: nothing a router could match
        bs = self.block_size
        tokens = request.all_token_ids
        blocks = [(maybe_convert_block_hash(hashes[i]), maybe_convert_block_hash(hashes[i - 1]) if i else None,
                   list(tokens[i * bs : (i + 1) * bs])) for i in range(first, first + len(keys))]
        self._planned.append(_Planned(copy_op, save_op, list(keys), blocks, objects=objects))

    def _stored(self, blocks, medium: str, p: _Planned | None = None) -> None:
        if self.groups is None:
            self._events.append(BlockStored(block_hashes=[b[0] for b in blocks], parent_block_hash=blocks[0][1],
                                            token_ids=[t for b in blocks for t in b[2]], block_size=self.block_size,
                                            lora_id=None, medium=medium, lora_name=None))
            return
        self._group_stored(self._full, blocks, medium)
        for g in self.groups:
            if g.kind == "full" or p is None or not p.objects or g.name not in p.objects:
                continue
            went = p.objects[g.name]
            run: list = []
            for i, b in enumerate(blocks):  # one event per contiguous run of blocks whose object went out
                if went[i]:
                    run.append(b)
                    if medium == MEDIUM_CPU:
                        self._objects_on_host[g.name].add(p.keys[i])
                elif run:
                    self._group_stored(g, run, medium)
                    run = []
            if run:
                self._group_stored(g, run, medium)

    def _group_stored(self, g, blocks, medium: str) -> None:
        self._events.append(BlockStored(block_hashes=[b[0] for b in blocks], parent_block_hash=blocks[0][1],
                                        token_ids=[t for b in blocks for t in b[2]], block_size=self.block_size,
                                        lora_id=None, medium=medium, lora_name=None, group_idx=g.index,
                                        kv_cache_spec_kind=g.spec_kind, kv_cache_spec_sliding_window=g.sliding_window))

    def update(self, core) -> None:
        """After completions were applied: report what became readable on host, then stored in L3."""
        pending = []
        for p in self._planned:
            if not p.on_host:
                if core.in_flight(p.copy_op):
                    pending.append(p)
                    continue
                held = [i for i, k in enumerate(p.keys) if core.holds(k)]
                if len(held) != len(p.keys):  # the copy failed: nothing was stored
                    continue
                self._stored(p.blocks, MEDIUM_CPU, p)
                self._on_host.update((k, b[0]) for k, b in zip(p.keys, p.blocks))
                p.on_host = True
            if p.save_op is not None and core.in_flight(p.save_op):
                pending.append(p)
                continue
            saved = []
            for k, b in zip(p.keys, p.blocks):
                node = core.tree.nodes.get(k)
                if node is None or node.stored != STORED:
                    break
                saved.append(b)
                self._in_storage[k] = b[0]
                self._in_storage.move_to_end(k)
            if saved:
                self._stored(saved, MEDIUM_STORAGE, p)
        while len(self._in_storage) > self.max_storage_entries:
            self._in_storage.popitem(last=False)
        self._planned = pending

    def missing_from_storage(self, key: PageHash) -> None:
        """A lookup asked L3 for ``key`` and the store does not hold it (on some rank)."""
        block = self._in_storage.pop(key, None)
        if block is not None:
            self._events.append(BlockRemoved(block_hashes=[block], medium=MEDIUM_STORAGE,
                                             group_idx=self._full.index if self._full is not None else None))

    def evicted(self, keys: list[PageHash]) -> None:
        """Host memory evicts these pages (a hybrid model's objects leave with them)."""
        if self.groups is not None:
            for g in self.groups:
                if g.kind != "full":
                    mine = self._objects_on_host[g.name]
                    gone = [self._on_host[k] for k in keys if k in mine and k in self._on_host]
                    mine.difference_update(keys)
                    if gone:
                        self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_CPU, group_idx=g.index))
        gone = [self._on_host.pop(k) for k in keys if k in self._on_host]
        if gone:
            group = self._full.index if self._full is not None else None
            self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_CPU, group_idx=group))

    def take(self) -> list[KVCacheEvent]:
        out, self._events = self._events, []
        return out
