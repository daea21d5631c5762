"""The policy core's shape, checked from its source: no class in ``kvtier/core`` reads an attribute that
neither it nor a class it derives from defines (a mixin reading what only its siblings set is how a
bug came back through base-class order), and no import circle inside ``kvtier/core``."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "kvtier" / "core"


def _classes() -> dict[str, tuple[ast.ClassDef, str]]:
    out = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                assert node.name not in out, f"two classes named {node.name} in kvtier/core"
                out[node.name] = (node, path.name)
    return out


def _defined(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its methods, class attributes and annotations, slots, and every
    ``self.X`` it assigns anywhere."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    names.add(n.attr)
    return names


def _read(cls: ast.ClassDef) -> dict[str, int]:
    """``self.X`` reads in the class's own methods -> the first line."""
    out: dict[str, int] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Load):
                out.setdefault(node.attr, node.lineno)
    return out


def test_no_core_class_reads_what_neither_it_nor_a_base_defines():
    classes = _classes()
    inherited = set(dir(object))
    problems = []
    for name, (cls, file) in classes.items():
        defined, todo = set(), [name]
        external = False
        while todo:  # the class and its bases within the core; a base from elsewhere (a dataclass, Protocol, Enum) is its own
            c = todo.pop()
            if c not in classes:
                external = True
                continue
            defined |= _defined(classes[c][0])
            todo += [b.id if isinstance(b, ast.Name) else b.attr for b in classes[c][0].bases if isinstance(b, (ast.Name, ast.Attribute))]
        if external and any(isinstance(b, ast.Name) and b.id in ("Protocol", "Enum", "IntEnum") for b in cls.bases):
            continue  # declared faces and enums define what they read themselves
        for attr, line in _read(cls).items():
            if attr not in defined and attr not in inherited and not hasattr(builtins, attr):
                problems.append(f"{file}:{line} {name} reads self.{attr}, which neither it nor a base in kvtier/core defines")
    assert not problems, "\n".join(problems)


def test_no_import_circle_inside_the_core():
    modules = {p.stem: ast.parse(p.read_text()) for p in CORE.glob("*.py")}
    graph = {}
    for name, tree in modules.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier.core."):
                deps.add(node.module.split(".")[2])
        graph[name] = deps & modules.keys()
    seen, stack = set(), []

    def visit(m: str) -> None:
        assert m not in stack, f"import circle: {' -> '.join(stack[stack.index(m):] + [m])}"
        if m in seen:
            return
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()
        seen.add(m)

    for m in sorted(graph):
        visit(m)


def test_every_completion_answers_the_same_questions():
    """Readers of completions never probe them (``getattr(c, "existing", 0)`` at seven sites before): every
    kind has an op, a reason (None when done), pages the store already held and corrupt objects, and
    still pickles as it is."""
    import pickle

    from kvtier.core.plans import CutShort, Done, Failed, Reason

    for c, want in [(Done(1, existing=2), (None, 2, 0)), (CutShort(2, 3, Reason.CORRUPT, corrupt=1, existing=1), (Reason.CORRUPT, 1, 1)),
                    (Failed(3, Reason.MISS, "gone"), (Reason.MISS, 0, 0))]:
        assert (c.reason, c.existing, c.corrupt) == want
        assert pickle.loads(pickle.dumps(c)) == c
