"""Page keys: the format DESIGN.md fixes, and the C chain (kvtier._chainkeys) against the Python reference.

``key[i] = xxh3_128(key[i-1] || page i as little-endian int32)``, int64 for a page
holding an id outside int32. The C chain is what every request uses; it must give
the same bytes as the Python loop and as the formula spelled out with python-xxhash.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import hashing
from kvtier.errors import ConfigError
from kvtier.hashing import Namespace, hasher, page_keys, token_array

ROOT = Namespace("model", "fp").root()
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def formula(ids: list[int], page_size: int, root: bytes) -> list[bytes]:
    """The key format written out, one page at a time, with python-xxhash."""
    keys, prev = [], root
    for i in range(len(ids) // page_size):
        page = np.array(ids[i * page_size : (i + 1) * page_size], dtype=np.int64)
        narrow = page.min() >= I32_MIN and page.max() <= I32_MAX
        prev = xxhash.xxh3_128_digest(prev + page.astype("<i4" if narrow else "<i8").tobytes())
        keys.append(prev)
    return keys


def python_reference(ids, page_size: int, root: bytes) -> list[bytes]:
    return hashing._python_page_keys(token_array(ids), page_size, root, hasher("xxh3_128"))


def test_the_c_chain_is_built():
    # ./run.sh test installs xxhash.h (libxxhash-dev) before building; without it kvtier falls back
    # to the Python loop, ~5x slower per request, and bench cache's figures would not be these
    assert hashing.NATIVE_KEYS, "kvtier._chainkeys was not built: install a C compiler and libxxhash-dev, then pip install -e . again"


@pytest.mark.parametrize("ids", [
    list(range(1000, 1300)),  # narrow pages, a tail of 44 ids
    [2**32 + 1] + list(range(2, 64)) + list(range(64)),  # a wide page, then a narrow one
    [I32_MIN, I32_MAX] * 40,  # the int32 edges stay narrow
    [I32_MIN - 1] + [0] * 63 + [I32_MAX + 1] + [0] * 63,  # one past each edge: wide
    [-(2**63), 2**63 - 1] * 64,  # int64 extremes
    [],
])
def test_keys_follow_the_format(ids):
    want = formula(ids, 64, ROOT)
    assert page_keys(ids, 64, ROOT) == want
    assert page_keys(np.array(ids, dtype=np.int64), 64, ROOT) == want
    assert python_reference(ids, 64, ROOT) == want
    assert len(want) == len(ids) // 64


def test_wide_and_narrow_pages_never_alias():
    narrow = page_keys([1] + [0] * 15, 16, ROOT)
    wide = page_keys([2**32 + 1] + [0] * 15, 16, ROOT)
    assert narrow != wide and len(narrow) == len(wide) == 1



def test_token_ids_beyond_int32_never_alias_small_ids():
    root = Namespace("m", "fp").root()
    big = np.array([2**32 + 1] + list(range(2, 65)), dtype=np.int64)
    small = np.array([1] + list(range(2, 65)), dtype=np.int64)
    assert page_keys(big, 16, root)[0] != page_keys(small, 16, root)[0]
    assert page_keys(big, 16, root)[1:] != page_keys(small, 16, root)[1:]  # chained: every later page differs too
    # pages whose ids fit in int32 keep their keys whatever the container (list, int32 or int64 array)
    assert page_keys(small, 16, root) == page_keys(small.tolist(), 16, root) == page_keys(small.astype(np.int32), 16, root)
    for bad in ([0.5] * 16, [[1] * 16], ["a"] * 16, [2**70] * 16):
        with pytest.raises(ConfigError):
            page_keys(bad, 16, root)


_ids = st.one_of(
    st.integers(-5, 5),
    st.integers(I32_MIN - 2, I32_MIN + 2),
    st.integers(I32_MAX - 2, I32_MAX + 2),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 200_000),
)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(_ids, max_size=300), page_size=st.integers(1, 70))
def test_c_chain_equals_the_python_reference(ids, page_size):
    assert page_keys(ids, page_size, ROOT) == python_reference(ids, page_size, ROOT)


def test_non_contiguous_and_other_dtypes_hash_as_their_values():
    base = np.arange(0, 512, dtype=np.int64)
    strided = np.arange(0, 1024, dtype=np.int64)[::2]  # a view with stride 16 bytes
    assert page_keys(strided, 64, ROOT) == formula(strided.tolist(), 64, ROOT)
    for dtype in (np.int32, np.uint16, ">i8"):
        assert page_keys(base.astype(dtype), 64, ROOT) == page_keys(base, 64, ROOT), dtype


def test_c_chain_refuses_malformed_arguments():
    from kvtier._chainkeys import chain_xxh3_128

    ids = np.arange(128, dtype=np.int64)
    with pytest.raises(ValueError, match="root key must be 16 bytes"):
        chain_xxh3_128(b"short", ids, 64)
    with pytest.raises(ValueError, match="page_size > 0"):
        chain_xxh3_128(ROOT, ids, 0)
    with pytest.raises(ValueError, match="int64 buffer"):
        chain_xxh3_128(ROOT, b"123", 64)
    assert chain_xxh3_128(ROOT, ids, 64) == formula(ids.tolist(), 64, ROOT)
