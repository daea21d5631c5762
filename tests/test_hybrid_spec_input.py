"""Hybrid spec input is checked where it is built: a KV group, a model and a cache given what they
cannot serve raise a typed error naming the field at construction, never a ``StopIteration``,
``TypeError`` or a save left in flight later (issue 44, item 6)."""

from __future__ import annotations

import threading

import pytest

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.core import CacheCore
from kvtier.errors import ConfigError, SpecError
from kvtier.executors.accounting import AccountingExecutor
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.spec import KVSpec

P = 4
ATTN = KVSpec.mha("v", 1, kv_heads=1, head_dim=8, page_size=P, dtype="float32")
STATE = (StateTensor("h", (2, 4), "float32"),)


def full(layers=(0,)) -> KVGroup:
    return KVGroup("full", "full", layers, attention=ATTN.with_(num_layers=len(layers)))


@pytest.mark.parametrize("window", ["8", None, 1.5, True, -2, 0])
def test_a_window_that_is_not_a_positive_int_is_refused_naming_the_field(window):
    with pytest.raises(SpecError, match="window"):
        KVGroup("w", "sliding_window", (0,), attention=ATTN, window=window)


@pytest.mark.parametrize("window", [5, "8", 1.5])
def test_a_window_on_a_group_that_is_not_sliding_is_refused(window):
    with pytest.raises(SpecError, match="window"):
        KVGroup("f", "full", (0,), attention=ATTN, window=window)


@pytest.mark.parametrize("layers", [None, [0], (0, 0), (), ("0",), (-1,), (True,), (0.0,)])
def test_layers_that_are_not_a_tuple_of_distinct_layer_indices_are_refused(layers):
    with pytest.raises(SpecError, match="layers"):
        KVGroup("f", "full", layers, attention=ATTN)


@pytest.mark.parametrize("name", ["\udc80", "", None, 7])
def test_a_group_name_that_cannot_name_l3_keys_is_refused(name):
    with pytest.raises(SpecError, match="name"):
        KVGroup(name, "full", (0,), attention=ATTN)


@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="full", attention="mha"), "attention"),
    (dict(kind="state", state=[StateTensor("h", (2,), "float32")]), "state"),
    (dict(kind="state", state=()), "state"),
    (dict(kind="state", state=STATE, attention=ATTN), "attention"),
    (dict(kind="full", attention=ATTN, state=STATE), "state"),
    (dict(kind="paged"), "kind"),
])
def test_a_group_of_the_wrong_parts_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(SpecError, match=field):
        KVGroup("g", layers=(0,), **kwargs)


@pytest.mark.parametrize("shape", [None, [2], (0,), ("2",), (2.0,)])
def test_a_state_tensor_of_no_shape_is_refused(shape):
    with pytest.raises(SpecError, match="shape"):
        StateTensor("h", shape, "float32")


@pytest.mark.parametrize("num_layers, groups, match", [
    (0, (), "num_layers"),
    ("1", (full(),), "num_layers"),
    (1, (), "groups"),
    (1, [full()], "groups"),
    (1, (KVGroup("s", "state", (0,), state=STATE),), "no attention group"),
    (2, (full(),), "exactly one group"),
])
def test_a_model_that_cannot_be_served_is_refused_at_construction(num_layers, groups, match):
    with pytest.raises(SpecError, match=match):
        ModelSpec("m", num_layers, groups)


TWO_FULL = ModelSpec("two-full", 2, (full((0,)), KVGroup("full2", "full", (1,), attention=ATTN)))
WINDOW = ModelSpec("w", 2, (full((0,)), KVGroup("swa", "sliding_window", (1,), attention=ATTN, window=8)))


def _pools(spec: KVSpec = ATTN, pages: int = 8):
    return DevicePool(spec, pages), HostPool(spec, pages)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_a_cache_refuses_a_model_with_two_full_attention_groups():
    before = _threads()
    with pytest.raises(ConfigError, match="one full-attention group's pages, it has 2"):
        HierarchicalCache(*_pools(), model=TWO_FULL, group_pools={"full2": _pools()})
    with pytest.raises(ConfigError, match="it has 2"):
        CacheCore(ATTN, PageAllocator(8), PageAllocator(8), AccountingExecutor(), model=TWO_FULL,
                  group_pools={"full2": (PageAllocator(8), PageAllocator(8))})
    assert _threads() <= before  # a refused cache leaves no transfer thread running


@pytest.mark.parametrize("other", [ATTN.with_(page_size=2 * P), ATTN.with_(num_layers=2), ATTN.with_(head_dim=16),
                                   KVSpec.mla("v", 1, kv_lora_rank=8, qk_rope_dim=0, page_size=P, dtype="float32")])
def test_a_cache_whose_pools_do_not_hold_the_models_full_group_is_refused(other):
    """Requests would be offered hits without the full group's KV: refused, naming both specs."""
    before = _threads()
    with pytest.raises(ConfigError, match="not model 'w''s full-attention group 'full'"):
        HierarchicalCache(*_pools(other), model=WINDOW, group_pools={"swa": _pools()})
    with pytest.raises(ConfigError, match="build the pools from model.full_group"):
        CacheCore(other, PageAllocator(8), PageAllocator(8), AccountingExecutor(), model=ModelSpec.of(ATTN))
    assert _threads() <= before


def test_the_pools_of_the_models_own_full_group_are_taken_whatever_the_display_name():
    cache = HierarchicalCache(*_pools(ATTN.with_(name="another name")), model=WINDOW, group_pools={"swa": _pools()})
    cache.close()


def test_group_pools_without_a_model_are_refused_not_ignored():
    before = _threads()
    with pytest.raises(ConfigError, match="without model="):
        HierarchicalCache(*_pools(), group_pools={"swa": _pools()})
    with pytest.raises(ConfigError, match="without model="):
        CacheCore(ATTN, PageAllocator(8), PageAllocator(8), AccountingExecutor(), group_pools={"swa": (PageAllocator(8), PageAllocator(8))})
    with pytest.raises(ConfigError, match="no KV group beside full attention"):
        CacheCore(ATTN, PageAllocator(8), PageAllocator(8), AccountingExecutor(), model=ModelSpec.of(ATTN),
                  group_pools={"swa": (PageAllocator(8), PageAllocator(8))})
    assert _threads() <= before
