"""The commands a Markdown page shows, and where a test runs one (tests/test_docs_commands.py).

A page's commands are the logical lines of its ``bash`` blocks (a line ending in ``\\`` or inside an
open quote goes on; ``#`` comments stripped) and its inline code that starts like a command
(:data:`COMMAND_START`). Every fenced block names its language, so no command hides in an untagged one:
``text`` holds output, diagrams and usage synopses (``kvtier plan [--json]``), whose ``kvtier`` lines
get their flags checked against the command line instead.

A command is *run by* a test when the test function's source -- or that of a helper it calls, named in
a chain each of whose links the one before names -- holds the command's distinctive part
(:func:`distinctive`): its program (subcommand words, module or script) and every flag and JSON key it
passes. Placeholders (``MODEL``, ``PATH``) and values may differ: the test runs the command's shape.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: inline code that is a command (not a path like ``kvtier/app/`` or a line of output like ``kvtier serve: listening``)
COMMAND_START = re.compile(r"(\./run\.sh|\.venv/bin/|python3? |pip install|vllm serve|kvtier (run|plan|bench|serve|spec|audit)(\s|$))")
#: languages of fenced blocks whose lines are commands
SHELL = ("bash", "sh", "shell", "console")
#: a quoted argument longer than this shows as ``'...'`` in a command's key (a JSON config is checked on its own)
LONG_ARG = 40


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, line)`` of every fenced block (``language`` '' when untagged; ``line`` 1-based)."""
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1)
            for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.S | re.M)]


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment outside quotes (one that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _open_quote(text: str) -> bool:
    """``text`` ends inside a quoted string (the command goes on on the next line)."""
    quote, escaped = None, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
    return quote is not None


def shell_lines(body: str) -> list[str]:
    """The logical command lines of a shell block, comments stripped, whitespace runs made one space."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = raw if pending and _open_quote(pending) else _strip_comment(raw)
        pending = f"{pending}\n{line}" if pending else line
        text = pending.rstrip()
        if _open_quote(text):
            continue
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        if text.strip():
            out.append(" ".join(text.split()))
        pending = ""
    assert not pending.strip(), f"a command that never ends: {pending!r}"
    return out


def without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def inline_commands(text: str) -> list[str]:
    """Inline code (on one line or wrapped over two) that starts like a command, whitespace runs made one space."""
    codes = [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", without_fences(text)) if "\n\n" not in code]
    return [code for code in codes if COMMAND_START.match(code)]


def commands_in(text: str) -> dict[str, str]:
    """Every command the page shows, in order: :func:`key` -> the command as shown (its first one of that key)."""
    cmds = [c for lang, body, _ in fenced_blocks(text) if lang in SHELL for c in shell_lines(body)] + inline_commands(text)
    out: dict[str, str] = {}
    for c in cmds:
        out.setdefault(key(c), c)
    return out


def synopses_in(text: str) -> list[str]:
    """The ``kvtier ...`` usage lines of a page's ``text`` blocks: a line that starts with ``kvtier `` and the
    indented lines after it, comments stripped, as one line."""
    out: list[str] = []
    for lang, body, _ in fenced_blocks(text):
        if lang != "text":
            continue
        entry = None
        for line in body.splitlines():
            if line.startswith("kvtier "):
                entry = len(out)
                out.append(_strip_comment(line).strip())
            elif entry is not None and line[:1].isspace() and line.strip():
                out[entry] += " " + _strip_comment(line).strip()
            else:
                entry = None
    return out


def key(cmd: str) -> str:
    """``cmd`` as the tables name it: a long quoted argument shown as ``'...'``."""
    return re.sub(r"'[^']{%d,}'" % LONG_ARG, "'...'", cmd)


def json_args(cmd: str) -> list[dict]:
    """The JSON objects ``cmd`` passes (a ``--kv-transfer-config '{...}'``, say)."""
    out = []
    for word in shlex.split(cmd):
        if word.startswith("{"):
            out.append(json.loads(word))
    return out


def json_keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in json_keys(v)}
    return set()


def words(cmd: str) -> list[str]:
    """``cmd``'s words (a synopsis's ``[``, ``]`` and ``|`` apart, not words)."""
    try:
        w = shlex.split(cmd)
    except ValueError:
        w = cmd.split()
    return [x for x in re.split(r"\s+", " ".join(w).replace("[", " ").replace("]", " ").replace("|", " ")) if x]


def flags(cmd: str) -> list[str]:
    """The long options ``cmd`` names (``--storage-url=X`` -> ``--storage-url``), a family as ``--workload-*``;
    none inside a quoted argument (a JSON config)."""
    return re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*(?:\*|(?<!-)))", re.sub(r"'[^']*'", "''", cmd))


# ---- kvtier's command line, read from its typer app (what --help shows) ------------------------------
@cache
def kvtier_commands() -> dict[tuple[str, ...], object]:
    """Every command of ``kvtier`` by its path (``("bench", "cache")``): the click command ``--help`` describes."""
    import typer.main

    from kvtier.app.cli import app

    out: dict[tuple[str, ...], object] = {}

    def walk(cmd, path):
        out[path] = cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return out


def options_of(cmd) -> set[str]:
    """The long options a click command takes (``--x`` and ``--no-x`` of a switch), ``--help`` too."""
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} | {"--help"}


def typer_options(path_or_module: str) -> set[str]:
    """The long options of a script or module run by ``typer.run(main)`` (``examples/x.py``, ``kvtier.app.bench.y``)."""
    import importlib
    import importlib.util

    import typer
    import typer.main

    if path_or_module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(path_or_module).stem, ROOT / path_or_module)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path_or_module)
    app = typer.Typer(add_completion=False)
    app.command()(module.main)
    return options_of(typer.main.get_command(app))


def kvtier_path(cmd: str) -> tuple[str, ...]:
    """The subcommand words of a ``kvtier ...`` command (``kvtier bench cache --json`` -> ``("bench", "cache")``)."""
    w, commands, path = words(cmd), kvtier_commands(), ()
    assert w[0] == "kvtier", cmd
    for x in w[1:]:
        if (*path, x) not in commands:
            break
        path = (*path, x)
    return path


def unknown_flags(cmd: str, known: set[str]) -> list[str]:
    """The options ``cmd`` names that ``known`` lacks (a family ``--x-*``: when no option starts with ``--x-``)."""
    return [f for f in flags(cmd) if (not any(k.startswith(f[:-1]) for k in known) if f.endswith("*") else f not in known)]


# ---- where a test runs a command -----------------------------------------------------------------------
def program(cmd: str) -> list[str]:
    """The words that name what ``cmd`` runs: ``kvtier``'s subcommands; ``python -m``'s module and its
    subcommand; a script's file name; ``vllm serve``'s ``serve``; ``./run.sh`` and its first word;
    another program's name and its words up to the first option."""
    w = words(cmd)
    name = Path(w[0]).name
    if name == "kvtier":
        return list(kvtier_path(cmd))
    if re.fullmatch(r"python3?", name):
        if w[1:2] == ["-m"]:
            return [w[2], *[x for x in w[3:4] if re.fullmatch(r"[a-z]+", x)]]
        return [Path(w[1]).name]
    if name == "vllm":
        return w[1:2]
    if name == "./run.sh" or w[0] == "./run.sh":
        return ["./run.sh", *[x for x in w[1:2] if not x.startswith("-")]]
    rest = []
    for x in w[1:]:
        if x.startswith("-"):
            break
        rest.append(x)
    return [name, *rest]


def distinctive(cmd: str) -> list[tuple[str, str]]:
    """What the code that runs ``cmd`` must name, as (what, regex): ``kvtier``'s command line (``kvtier(...)`` or
    ``kvtier.app.cli``), the :func:`program` words as strings of their own, every option, every JSON key."""
    out = []
    if Path(words(cmd)[0]).name == "kvtier":
        out.append(("kvtier's command line", r"\bkvtier\(|kvtier\.app\.cli\b"))
    out += [(w, r"[\"'/]" + re.escape(w) + r"[\"']") for w in program(cmd)]
    out += [(f, re.escape(f) + r"(?![\w-])") for f in flags(cmd)]
    out += [(k, r"[\"']" + re.escape(k) + r"[\"']|\b" + re.escape(k) + "=") for o in json_args(cmd) for k in sorted(json_keys(o))]
    return list(dict.fromkeys(out))


@cache
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def function_source(ref: str) -> str:
    """The source of ``path::name`` (``name``: a function, a class, or ``Class.method``); KeyError if none."""
    path, _, qualname = ref.partition("::")
    text, tree = (ROOT / path).read_text(), _tree(path)
    nodes, found = tree.body, None
    for part in qualname.split("."):
        found = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            raise KeyError(f"{path} has no {qualname}")
        nodes = found.body
    return ast.get_source_segment(text, found)


def chain_problems(refs: tuple[str, ...]) -> list[str]:
    """What is wrong with a chain of ``path::name`` refs (each named in the source of the one before); a ref
    without ``::`` is a whole file."""
    problems, before = [], None
    for ref in refs:
        try:
            source = function_source(ref) if "::" in ref else (ROOT / ref).read_text()
        except (KeyError, FileNotFoundError) as e:
            problems.append(str(e))
            continue
        name = ref.partition("::")[2].split(".")[0]
        if before is not None and name and not re.search(rf"\b{re.escape(name)}\b", before):
            problems.append(f"{ref}: the link before it does not name {name}")
        before = source
    return problems


def chain_source(refs: tuple[str, ...]) -> str:
    return "\n".join(function_source(r) if "::" in r else (ROOT / r).read_text() for r in refs)


# ---- systemd units shown in a page ------------------------------------------------------------------------
def systemd_units(text: str) -> dict[str, dict[str, list[str]]]:
    """The units of a page's ``ini`` blocks, each opening with ``# /etc/systemd/system/NAME``: NAME -> key -> its
    values (a line ending in ``\\`` goes on; comments dropped)."""
    units: dict[str, dict[str, list[str]]] = {}
    for lang, body, _ in fenced_blocks(text):
        if lang != "ini":
            continue
        name = re.match(r"# /etc/systemd/system/([\w@.-]+?)(?::|\s|$)", body).group(1)
        unit: dict[str, list[str]] = {}
        pending = ""
        for raw in body.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if not line or line.startswith(("#", ";", "[")):
                continue
            k, _, v = line.partition("=")
            unit.setdefault(k.strip(), []).append(v.strip())
        units[name] = unit
    return units


def exec_argvs(value: str) -> list[list[str]]:
    """The commands an ``Exec*=`` line runs: its own argv, and each command of a ``sh -c`` script it runs
    (cut at ``;``, ``&&``, ``||``, ``|`` and redirections; ``until``/``do``/``done`` dropped)."""
    argv = shlex.split(value.lstrip("-@+!:"))
    if Path(argv[0]).name not in ("sh", "bash") or "-c" not in argv:
        return [argv]
    script = argv[argv.index("-c") + 1]
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current, tokens = [], [], list(lexer)
    skip = False
    for i, tok in enumerate(tokens):
        if skip:
            skip = False
        elif tok in (";", "&&", "||", "|", "&") or tok in ("until", "while", "do", "done", "then", "fi", "if"):
            out.append(current)
            current = []
        elif tok[0] in "<>":  # a redirection: its fd before it, its target after it
            if current and current[-1].isdigit() and i and tokens[i - 1] == current[-1]:
                current.pop()
            skip = True
        else:
            current.append(tok)
    out.append(current)
    return [a for a in out if a]
