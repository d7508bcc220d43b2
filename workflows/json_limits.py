"""JSON that is valid but cannot be handled, found before anything handles it: what the API's
parser (``config.parsers``) refuses as a 400, and what the admin's JSON fields
(``workflows.forms``) refuse as a field error. Pure Python, no Django.

- Values nested past ``MAX_JSON_DEPTH``: Python's JSON parser, jsonschema and ``json.dumps``
  all recurse, and a value nested thousands of levels deep would end in a ``RecursionError``
  (a 500) somewhere. No workflow document, recipe, schema or run input needs more.
- ``\\u0000`` in a string or a key: JSON allows it, Postgres' ``jsonb`` and text do not, so
  storing it would fail after validation. Each place is named (``input.a[0].b``).
- A lone surrogate (``\\ud800`` to ``\\udfff`` not part of a pair) in a string or a key: JSON
  allows it, but it is not text that UTF-8 can carry. Stored (SQLite keeps it), it made every
  answer that included it a 500 in the renderer, for every user: one run broke the run list;
  shown on a page, it breaks the page's encoding. Python's JSON parser joins a valid pair into
  one character, so any surrogate left is lone.

:func:`json_depth` and :func:`text_problems` walk without recursion, so they are safe on any
value the parser returned.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

from .errors import FieldError
from .validation import field_path

__all__ = [
    "MAX_JSON_DEPTH",
    "UNSTORABLE",
    "NotANumber",
    "json_depth",
    "loads_numbers_only",
    "text_problems",
]

MAX_JSON_DEPTH: Final = 100
UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


def _unstorable(text: str) -> str | None:
    """What in ``text`` cannot be stored, or None."""
    found = UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "the character \\u0000"
    return f"a lone surrogate (\\u{ord(found.group()):04x})"


def text_problems(value: Any, *, top: str = "body") -> list[FieldError]:
    """Every place in ``value`` holding ``\\u0000`` or a lone surrogate; a key's problem is
    named at its object, and ``top`` names ``value`` itself."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        where = field_path(path) or top
        if isinstance(item, str):
            if (what := _unstorable(item)) is not None:
                problems.append(FieldError(where, f"a string may not contain {what}"))
        elif isinstance(item, dict):
            for key, child in item.items():
                if (what := _unstorable(key)) is not None:
                    problems.append(FieldError(where, f"a key may not contain {what}"))
                    continue  # its path cannot be named in text either
                stack.append((child, [*path, key]))
        elif isinstance(item, list):
            stack.extend((child, [*path, index]) for index, child in enumerate(item))
    return sorted(problems, key=lambda p: p.field or "")


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar is 0), computed without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return deepest


class NotANumber(ValueError):
    """``NaN``, ``Infinity`` or a number past a float's range (``1e999``): Python's parser
    takes them, but they are not JSON numbers and no JSON column stores them (Postgres'
    ``jsonb`` refuses the row: a 500 after validation)."""


def _no_constant(name: str) -> Any:
    raise NotANumber(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise NotANumber(f"{text[:40]} is out of a number's range")
    return number


def loads_numbers_only(text: str) -> Any:
    """``json.loads`` refusing what is not a JSON number (:class:`NotANumber`), as the API's
    parser does (DRF's ``STRICT_JSON``, and its JSON field for ``1e999``)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
