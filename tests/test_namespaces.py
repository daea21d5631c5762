"""Namespaces: an unambiguous encoding of their fields (no model name and salt splice into another
namespace's keys), and a model name that cannot name a namespace is a typed error at construction."""

import pytest
from hypothesis import given, strategies as st

from kvtier.errors import ConfigError
from kvtier.hashing import Namespace, page_keys


def test_namespace_fields_cannot_be_spliced_into_another_namespace():
    fp = "0123abcd"
    a = Namespace(f"a-{fp}-tp0-b", fp)
    b = Namespace("a", fp, salt=f"b-{fp}-tp0")
    assert str(a) != str(b) and a.root() != b.root()
    toks = list(range(64))
    assert not set(page_keys(toks, 16, a.root())) & set(page_keys(toks, 16, b.root()))


@pytest.mark.parametrize("model", ["nul\x00byte", "x" * 300, "lone\ud800surrogate", "new\nline"])
def test_bad_model_names_are_typed_errors(model):
    with pytest.raises(ConfigError, match="namespace model name"):
        Namespace(model, "fp")


_FIELD = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=12)


@given(model=_FIELD.filter(bool), fingerprint=_FIELD.filter(bool), rank=st.integers(0, 1 << 20), salt=_FIELD)
def test_a_namespace_string_parses_back_to_its_namespace_and_only_its_own_string_does(model, fingerprint, rank, salt):
    """``Namespace.parse`` (the node service derives each rank's L3 namespace from an engine's) inverts ``str()``,
    and takes no other spelling of it: lowercase escapes, a padded rank, a field unescaped."""
    ns = Namespace(model, fingerprint, rank, salt)
    text = str(ns)
    assert Namespace.parse(text) == ns
    for other in (text.replace("%2D", "%2d"), text.replace(f"-tp{rank}", f"-tp0{rank}"), text + "-x-y"):
        if other != text:
            with pytest.raises(ConfigError, match="is not a kvtier namespace"):
                Namespace.parse(other)
