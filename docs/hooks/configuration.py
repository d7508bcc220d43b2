"""The configuration reference, generated from the code so it cannot drift (an MkDocs hook).

The variables, how each is read and its default come from the code: ``config/settings.py``
read with :mod:`ast` (every ``env(...)``, ``env.int(...)``, ``env.list(...)``... call whose
first argument is a literal name), and the few variables other modules read themselves
(``os.environ.get("NAME")`` in :data:`ELSEWHERE`). What each means is written once, in
``configuration.yml`` beside this file. The page ``reference/configuration.md`` holds the
markers :data:`MARKER` and :data:`END_MARKER`, whose span the hook replaces with the tables;
``tests/test_docs.py`` checks that every variable read is described and nothing described is
unread.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

BASE_DIR = Path(__file__).resolve().parents[2]
SETTINGS = BASE_DIR / "config" / "settings.py"
DESCRIPTIONS = Path(__file__).with_name("configuration.yml")
# Modules that read a variable of their own with os.environ.get (the settings cannot: they
# are read per process, after the settings, or by a command before Django starts).
ELSEWHERE = (
    BASE_DIR / "config" / "tracing.py",
    BASE_DIR / "workers" / "management" / "commands" / "standalone.py",
)
MARKER = "<!-- configuration: generated from config/settings.py -->"
# What stands between the two markers is for readers of the page's source (GitHub): the
# hook replaces it with the tables.
END_MARKER = "<!-- configuration: end -->"
# How django-environ reads a value, as the table says it.
READ_AS = {
    "env": "text",
    "str": "text",
    "bool": "boolean",
    "int": "integer",
    "float": "number",
    "list": "comma-separated list",
    "json": "JSON",
    "db_url": "database URL",
    "cache_url": "cache URL",
}


@dataclass(frozen=True)
class Read:
    """One place the code reads an environment variable."""

    name: str
    read_as: str
    # The literal default (when the code gives one that is a plain value), else None.
    default: Any
    where: str


def _literal(node: ast.expr | None) -> Any:
    """The node's value when it is a constant expression (``64 * 1_048_576`` included)."""
    if node is None:
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(left, int | float) and isinstance(right, int | float):
            return left * right if isinstance(node.op, ast.Mult) else left + right
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _env_call(node: ast.Call) -> str | None:
    """``env`` or the method of ``env.<method>(...)``, when ``node`` is such a call."""
    func = node.func
    if isinstance(func, ast.Name) and func.id == "env":
        return "env"
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "env"
    ):
        return func.attr
    return None


def _environ_get(node: ast.Call) -> bool:
    """Whether ``node`` is ``os.environ.get(...)``."""
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "get"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "environ"
    )


def variables_read() -> dict[str, Read]:
    """Every environment variable the settings (and :data:`ELSEWHERE`) read, by name; the
    first read of a name wins (the settings read a few twice)."""
    found: dict[str, Read] = {}
    for path in (SETTINGS, *ELSEWHERE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.args[0]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            method = _env_call(node) if path == SETTINGS else None
            if method is not None:
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                read_as = READ_AS.get(method, method)
                value = _literal(default)
            elif path != SETTINGS and _environ_get(node):
                read_as, value = "text", _literal(node.args[1] if len(node.args) > 1 else None)
            else:
                continue
            where = f"{path.relative_to(BASE_DIR)}:{node.lineno}"
            found.setdefault(name.value, Read(name.value, read_as, value, where))
    return found


def descriptions() -> list[dict[str, Any]]:
    """The sections of ``configuration.yml``: ``{section, variables: [{name, default,
    meaning}]}``."""
    sections: list[dict[str, Any]] = yaml.safe_load(DESCRIPTIONS.read_text())
    return sections


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    """The tables of the page: one per section, every variable's name, how it is read, its
    default and what it means."""
    read = variables_read()
    parts = []
    for section in descriptions():
        parts.append(f"## {section['section']}\n")
        parts.append("| variable | read as | default | meaning |\n|---|---|---|---|")
        for entry in section["variables"]:
            how = read[entry["name"]].read_as if entry["name"] in read else "not read"
            parts.append(
                f"| `{entry['name']}` | {how} | {_cell(entry['default'])} "
                f"| {_cell(entry['meaning'])} |"
            )
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' hook: the configuration page gets its tables, in place of what stands
    between :data:`MARKER` and :data:`END_MARKER`."""
    if MARKER not in markdown:
        return markdown
    before, rest = markdown.split(MARKER, 1)
    return before + render() + rest.split(END_MARKER, 1)[-1]


if __name__ == "__main__":  # python docs/hooks/configuration.py: print the tables
    sys.stdout.write(render())
