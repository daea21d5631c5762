"""Page keys: one 128-bit hash per full page, chained over the previous page's key.

``key[i] = H(key[i-1] || tokens[i*page_size:(i+1)*page_size] as little-endian int32)``
with ``key[-1]`` the namespace root. Equal keys therefore mean equal prefixes
in the same namespace (model, spec fingerprint, TP rank, salt). The partial
tail page of a request never gets a key. Hashes are computed once per request
here, never inside pools or the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NewType

import numpy as np
import xxhash

from kvtier.errors import UnknownNameError

PageHash = NewType("PageHash", bytes)
HashAlgo = Literal["xxh3_128", "blake3"]

KEY_BYTES = 16


def _blake3_16(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest(KEY_BYTES)


_HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake3": _blake3_16,
}


def hasher(algo: str) -> Callable[[bytes], bytes]:
    try:
        return _HASHERS[algo]
    except KeyError:
        raise UnknownNameError("hash algorithm", algo, _HASHERS) from None


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must match for two pages to share bytes. Part of every page key and L3 key."""

    model: str
    spec_fingerprint: str
    tp_rank: int = 0
    salt: str = ""

    def __str__(self) -> str:
        tail = f"-{self.salt}" if self.salt else ""
        return f"{self.model}-{self.spec_fingerprint}-tp{self.tp_rank}{tail}"

    def root(self, algo: str = "xxh3_128") -> PageHash:
        return PageHash(hasher(algo)(b"kvtier/v1|" + str(self).encode()))


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    return np.ascontiguousarray(token_ids, dtype="<i4").tobytes()


def page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, root: PageHash, algo: str = "xxh3_128") -> list[PageHash]:
    """Chained keys of the full pages of ``token_ids`` (the tail page is left out)."""
    h = hasher(algo)
    buf = memoryview(token_bytes(token_ids))
    step = page_size * 4
    full = len(buf) // step
    keys: list[PageHash] = []
    prev = root
    for i in range(full):
        prev = h(prev + buf[i * step : (i + 1) * step])
        keys.append(prev)
    return keys  # type: ignore[return-value]
