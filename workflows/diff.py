"""Workflow documents rendered for people: reading order and line diffs. Pure: no Django.

Both documents are rendered the same canonical way (pretty-printed, keys sorted, the
``version`` key dropped) before diffing, so a diff shows what changed in the body and never
noise from key order or from the version number every saved document carries.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

# The contract's own order for a document's top-level fields; a step reads best as id, kind, rest.
TOP_LEVEL_ORDER = (
    "id",
    "version",
    "description",
    "input_schema",
    "limits",
    "concurrency",
    "steps",
    "output",
)


def reading_order(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with its keys in the order people write them.

    The database gives ``jsonb`` keys back in its own order (shortest first), which makes an
    editor prefill hard to read. Top-level fields follow the contract's order, unknown ones
    after; in every nested object that has them, ``id`` and ``kind`` come first. Only the
    order changes: the result equals ``document``.
    """
    top = {k: document[k] for k in TOP_LEVEL_ORDER if k in document}
    top.update((k, v) for k, v in document.items() if k not in top)
    return {k: _steps_first(v) for k, v in top.items()}


def _steps_first(value: Any) -> Any:
    if isinstance(value, list):
        return [_steps_first(v) for v in value]
    if isinstance(value, dict):
        head = {k: value[k] for k in ("id", "kind") if k in value}
        head.update((k, v) for k, v in value.items() if k not in head)
        return {k: _steps_first(v) for k, v in head.items()}
    return value


def document_text(document: dict[str, Any]) -> str:
    """The canonical pretty-printed text of ``document`` without its ``version`` key."""
    body = {k: v for k, v in document.items() if k != "version"}
    return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False)


def document_diff(
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    fromfile: str = "old",
    tofile: str = "new",
    context: int = 3,
) -> list[str]:
    """Unified diff of ``old`` → ``new`` as lines without line endings.

    Equal bodies (whatever their key order or ``version``) give an empty list. Otherwise the
    list starts with the ``---``/``+++`` header, then ``@@`` hunks whose lines start with
    ``' '``, ``'-'`` or ``'+'``.
    """
    return list(
        difflib.unified_diff(
            document_text(old).splitlines(),
            document_text(new).splitlines(),
            fromfile=fromfile,
            tofile=tofile,
            n=context,
            lineterm="",
        )
    )


def diff_line_kind(line: str) -> str:
    """What a line of :func:`document_diff` is: header, hunk, added, removed or context."""
    if line.startswith(("--- ", "+++ ")):
        return "header"
    if line.startswith("@@"):
        return "hunk"
    if line.startswith("+"):
        return "added"
    if line.startswith("-"):
        return "removed"
    return "context"
