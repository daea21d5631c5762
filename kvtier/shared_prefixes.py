"""Prefixes an operator declared shareable across tenants (a system prompt), by their content, in a named scope.

A tenant's request keys its pages under a root of its own (:func:`~kvtier.hashing.tenant_scope`), so no two tenants
share a page. An operator may declare a prefix -- its tokens -- shareable in a named scope (:meth:`SharedPrefixes.declare`).
A request that starts with exactly those tokens then keys the declared full pages under the scope's root, whoever its
tenant is, and keys the rest under a root of the shared prefix's last key and its own tenant: what follows a shared
system prompt stays the tenant's own. Nothing is inferred: a request that starts with part of a declared prefix,
or holds it further in, keys all of its pages in its own scope.

Keys (see DESIGN.md's storage keys): the scope's root is :func:`~kvtier.hashing.scoped_root` of the namespace's root
and the field ``share`` + the scope's name, tagged apart from every tenant's ``salt`` field, so no tenant's root is a
scope's; the tail's root is ``scoped_root`` of the shared prefix's last key and the field ``tail`` + the tenant's
scope -- never empty, so a tail never continues the scope's own chain, and two tenants' tails never meet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.hashing import PageHash, _scope_field, hasher, page_keys, scoped_root, token_array

#: the default scope's name
DEFAULT_SCOPE = "shared"
#: declared prefixes a cache keeps at most (each costs a lookup per request long enough to start with it)
MAX_DECLARED = 64


class SharedPrefixes:
    """The prefixes declared shareable for one namespace (``root``), keyed as its pages are (``page_size``, ``algo``)."""

    def __init__(self, root: PageHash, page_size: int, algo: str = "xxh3_128"):
        self.root, self.page_size, self.algo = root, page_size, algo
        self._hash = hasher(algo)
        #: scope root -> full pages of a declared prefix -> the last page's key of each prefix of that length
        self._declared: dict[PageHash, dict[int, set[PageHash]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def scope_root(self, scope: str) -> PageHash:
        if not isinstance(scope, str) or not scope:
            raise ConfigError(f"a shared scope is a non-empty name (str); got {scope!r}")
        return scoped_root(self.root, _scope_field(b"share", b"s", scope.encode("utf-8", "surrogatepass")), self._hash)

    def declare(self, token_ids: Sequence[int] | np.ndarray, scope: str = DEFAULT_SCOPE) -> int:
        """Declare ``token_ids``' full pages shareable in ``scope``; returns how many (a tail shorter than a page is
        not part of it). Declaring a prefix twice is a no-op."""
        root = self.scope_root(scope)
        arr = token_array(token_ids)
        pages = len(arr) // self.page_size
        if pages == 0:
            raise ConfigError(f"a shared prefix needs at least one full page ({self.page_size} tokens); got {len(arr)} tokens")
        last = page_keys(arr[: pages * self.page_size], self.page_size, root, self.algo)[-1]
        lasts = self._declared.setdefault(root, {}).setdefault(pages, set())
        if last not in lasts:
            if self._count >= MAX_DECLARED:
                raise ConfigError(f"{MAX_DECLARED} shared prefixes are declared already: each costs every long enough request a "
                                  "lookup; declare fewer (one per system prompt)")
            lasts.add(last)
            self._count += 1
        return pages

    def keys(self, token_ids: Sequence[int] | np.ndarray, tenant_scope: bytes) -> list[PageHash] | None:
        """The page keys of a request that starts with a declared prefix (the longest, if several do), its tail in
        ``tenant_scope``; None when it starts with none."""
        arr = token_array(token_ids)
        ps = self.page_size
        full = len(arr) // ps
        best: tuple[int, list[PageHash]] | None = None
        for root, by_pages in self._declared.items():
            fits = [p for p in by_pages if p <= full and (best is None or p > best[0])]
            if not fits:
                continue
            chain = page_keys(arr[: max(fits) * ps], ps, root, self.algo)
            for p in sorted(fits, reverse=True):
                if chain[p - 1] in by_pages[p]:
                    best = (p, chain[:p])
                    break
        if best is None:
            return None
        pages, shared = best
        tail_root = scoped_root(shared[-1], _scope_field(b"tail", b"s", tenant_scope), self._hash)
        return shared + page_keys(arr[pages * ps : full * ps], ps, tail_root, self.algo)
