"""kvtier's modules in layers: each imports only its own layer and the ones below it (checked from the
source, imports inside functions included). The order: the spec (and what every layer reads: errors,
configs, keys, stats) -> pages -> the prefix tree -> the policy core -> what moves bytes (pools,
transfers, L3) -> executors -> the node service (its policy, region and socket) -> the caches composed
from them -> engine integrations -> the application."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("spec", ("kvtier.errors", "kvtier.spec", "kvtier.groups", "kvtier.layout", "kvtier.config", "kvtier.metrics", "kvtier.hashing",
              "kvtier.logs", "kvtier._chainkeys", "kvtier.shared_prefixes")),
    ("pages", ("kvtier.pages", "kvtier.alloc", "kvtier.jobs")),
    ("radix", ("kvtier.radix",)),
    ("core", ("kvtier.core",)),
    ("movers", ("kvtier.pools", "kvtier.transfer", "kvtier.l3")),
    ("executors", ("kvtier.executors",)),
    ("service", ("kvtier.service",)),
    ("compositions", ("kvtier.cache", "kvtier.build", "kvtier.offload")),
    ("integrations", ("kvtier.integrations",)),
    ("app", ("kvtier.app",)),
]


def layer_of(module: str) -> int | None:
    """The layer of a kvtier module (None: the package's own face, ``kvtier/__init__``, which may import any)."""
    for i, (_name, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "kvtier").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvtier")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("kvtier"):
                out |= {f"{base}.{a.name}" for a in node.names}  # (a name, or a submodule: layer_of reads both)
    return out


def test_every_module_has_a_layer():
    modules = _modules()
    assert [m for m in modules if m != "kvtier" and layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    bad = []
    for name, path in _modules().items():
        mine = layer_of(name)
        if mine is None:
            continue
        for imported in _imports(name, path):
            theirs = layer_of(imported)
            if imported == "kvtier" or imported.startswith("kvtier.") and theirs is None and imported.count(".") == 1:
                bad.append(f"{name} imports the package face ({imported}): import from the module that defines it")
            elif theirs is not None and theirs > mine:
                bad.append(f"{name} ({LAYERS[mine][0]}) imports {imported} ({LAYERS[theirs][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circle_between_modules():
    """Module by module, imports inside functions included (a circle is a loop a reader has to untangle)."""
    modules = _modules()

    def owner(imported: str) -> str | None:
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        return imported or None

    graph = {name: {m for m in map(owner, _imports(name, path)) if m and m != name and m != "kvtier"} for name, path in modules.items()}
    seen: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        assert m not in stack, f"import circle: {' -> '.join(stack[stack.index(m):] + [m])}"
        if m in seen:
            return
        for d in sorted(graph[m]):
            visit(d, stack + [m])
        seen.add(m)

    for m in sorted(graph):
        visit(m, [])
