"""Zero-copy byte views of one page of an SGLang host pool, and the format they make.

An SGLang host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, the DSA
indexer's ``DSAIndexerPoolHost``, ...) says what one page is through
``get_data_page(index, flat=False)``: a strided view of its buffer whose
flattened bytes are what SGLang's own file backend stores. :class:`PoolPages`
splits that view into its contiguous runs once (``layer_first`` MHA: K then V
of each layer; ``page_first``: one run per K and V), checks that every page's
runs are the first page's shifted by a fixed stride, and from then on gives
each page's runs as ``memoryview`` slices of the pool's buffer: a storage
read lands in the pool and a write reads from it, with no staging copy. The
payload of kvtier's page object is those runs back to back, so both SGLang
interfaces (v1 zero-copy and the older flat-page ``get``/``set``) store the
same object.

Host indices arrive as token slots; they must be whole pages
(:func:`kvtier.pages.slots_to_pages`), or a :class:`PageAlignmentError` names the
count, the page size and the pool before any byte moves.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import torch
import xxhash

from kvtier.errors import ConfigError, PageAlignmentError
from kvtier.pages import check_pages_in_range, slots_to_pages

#: bumped when the way a pool's page maps to the payload changes
POOL_PAGE_FORMAT = 1


@dataclass(frozen=True)
class Run:
    """One contiguous run of a page: a byte offset into the pool buffer and its length."""

    offset: int
    nbytes: int


def contiguous_runs(view: torch.Tensor) -> list[Run]:
    """The contiguous byte runs of a strided view, in its flattened order."""
    shape = [s for s in view.shape]
    stride = list(view.stride())
    item = view.element_size()
    # the innermost dims that are laid out back to back form one run
    k = len(shape)
    expected = 1
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    run_elems = math.prod(shape[k:])
    base = view.storage_offset()
    runs = []
    for idx in itertools.product(*(range(n) for n in shape[:k])):
        off = base + sum(i * s for i, s in zip(idx, stride))
        runs.append(Run(off * item, run_elems * item))
    return runs


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two views of one page, both alive: the same memory when the pool hands out views, two
    temporaries when it hands out copies."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


class PoolPages:
    """Page views and the page-object format of one registered SGLang host pool."""

    def __init__(self, pool, *, name: str, identity: dict):
        self.pool = pool
        self.name = name
        self.page_size = int(pool.page_size)
        first = pool.get_data_page(0, flat=False)
        #: the pool's pages are views of its memory (two calls for one page give the same bytes); a pool
        #: whose get_data_page builds a copy (SGLang's Mamba pool concatenates its states) is moved by
        #: copy: a page is read out whole and written back with set_from_flat_data_page
        self.aliases = _same_memory(first, pool.get_data_page(0, flat=False))
        if self.aliases:
            #: the pool's whole buffer as bytes (a CPU tensor's storage; pinned memory is CPU memory too)
            self._bytes = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
            self.buffer = memoryview(self._bytes.numpy()).cast("B")
            self.runs = contiguous_runs(first)
        else:
            if not hasattr(pool, "set_from_flat_data_page"):
                raise ConfigError(f"kvtier HiCache storage: pool {name!r} ({type(pool).__name__}) returns its pages as copies and has no "
                                  "set_from_flat_data_page to write a page back; kvtier cannot move its pages")
            self.buffer = None  # nothing of the pool's memory to register with a store
            self.runs = [Run(0, _flat_bytes(pool.get_data_page(0, flat=True)).numel())]
        self.payload_bytes = sum(r.nbytes for r in self.runs)
        self.num_pages = self._page_count()
        self._stride = self._page_stride() if self.aliases else None
        described = {"format": POOL_PAGE_FORMAT, "pool": type(pool).__name__, "name": name,
                     "layout": getattr(pool, "layout", None), "dtype": str(getattr(pool, "dtype", first.dtype)),
                     "page_size": self.page_size, "layers": getattr(pool, "layer_num", None),
                     "runs": [r.nbytes for r in self.runs], **identity}
        #: what must match for two pools to share page objects (16 hex characters, the page header's field)
        self.fingerprint = xxhash.xxh3_64_hexdigest(json.dumps(described, sort_keys=True).encode())
        self.description = described

    def _page_count(self) -> int:
        size = int(getattr(self.pool, "size", 0))
        return size // self.page_size

    def _page_stride(self) -> int | None:
        """Bytes between one page's runs and the next page's, when every page is the first shifted."""
        if self.num_pages < 2:
            return 0
        second = contiguous_runs(self.pool.get_data_page(self.page_size, flat=False))
        stride = second[0].offset - self.runs[0].offset
        last = self.num_pages - 1
        for page, runs in ((1, second), (last, contiguous_runs(self.pool.get_data_page(last * self.page_size, flat=False)))):
            if [(r.offset - page * stride, r.nbytes) for r in runs] != [(r.offset, r.nbytes) for r in self.runs]:
                return None  # not an affine layout: compute each page's runs from its view
        return stride

    def pages(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """Page numbers of ``count`` pages given as token slots; a :class:`PageAlignmentError` unless
        they are exactly ``count`` whole pages inside the pool."""
        pool = f"SGLang host pool {self.name!r} ({type(self.pool).__name__})"
        # (typed first, in slots_to_pages: floats would be truncated and 2-D flattened onto other pages)
        pages = slots_to_pages(host_indices, self.page_size, pool=pool, side="host")
        if pages.numel() != count:
            raise PageAlignmentError(
                f"host indices for {pool}: {host_indices.numel()} token slots are {pages.numel()} pages of "
                f"page_size {self.page_size}, but {count} keys were given; pass page_size slots per key")
        check_pages_in_range(pages, self.num_pages, pool=pool, side="host")
        return pages.tolist()

    def views(self, page: int) -> list[memoryview]:
        """Writable byte views of one page's runs, in payload order (for a pool moved by copy: a copy of
        the page, which :meth:`write_back` puts into the pool after a read)."""
        if not self.aliases:
            return [memoryview(_flat_bytes(self.pool.get_data_page(page * self.page_size, flat=True)).numpy()).cast("B")]
        if self._stride is None:
            runs = contiguous_runs(self.pool.get_data_page(page * self.page_size, flat=False))
            return [self.buffer[r.offset : r.offset + r.nbytes] for r in runs]
        shift = page * self._stride
        return [self.buffer[r.offset + shift : r.offset + shift + r.nbytes] for r in self.runs]

    def write_back(self, page: int, views: list[memoryview]) -> None:
        """After a read into :meth:`views`: a pool moved by copy gets the page; a pool of views has it."""
        if not self.aliases:
            self.pool.set_from_flat_data_page(page * self.page_size, torch.frombuffer(views[0], dtype=torch.uint8))

    def check_flat(self, value: torch.Tensor, what: str) -> memoryview:
        """A flat data page (the older ``set``/``get`` path) as bytes of exactly one payload."""
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{what}: expected a torch.Tensor page, got {type(value).__name__}")
        nbytes = value.numel() * value.element_size()
        if nbytes != self.payload_bytes or not value.is_contiguous():
            raise PageAlignmentError(
                f"{what}: a page of SGLang host pool {self.name!r} is {self.payload_bytes} contiguous bytes "
                f"({self.page_size} tokens), got {nbytes} bytes{'' if value.is_contiguous() else ' (not contiguous)'}; "
                "pass one whole flat data page (pool.get_data_page(index, flat=True))")
        return memoryview(value.detach().cpu().view(torch.uint8).numpy()).cast("B")
