"""How the command line prints rows and checks output paths (shared by its commands)."""

from __future__ import annotations

import json
import sys

from kvtier.errors import ConfigError


def emit(rows: object, as_json: bool) -> None:
    """``rows`` (a dict or a list of dicts with the same keys) as JSON, or as a table."""
    if as_json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    rows_list = rows if isinstance(rows, list) else [rows]
    table = Table()
    for key in rows_list[0]:
        table.add_column(key)
    for row in rows_list:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)


def check_output_path(what: str, path: str | None) -> None:
    """``path`` can be written: its directory exists and is writable, and it is not a directory."""
    import os

    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory; give a file path")
    if not os.path.isdir(parent):
        raise ConfigError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{what} {path!r} is not writable; choose another path")
