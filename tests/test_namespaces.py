"""Namespaces: an unambiguous encoding of their fields (no model name and salt splice into another
namespace's keys), and a model name that cannot name a namespace is a typed error at construction."""

import pytest

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
