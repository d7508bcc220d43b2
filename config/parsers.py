"""The API's JSON parser: DRF's, refusing as a 400 two kinds of JSON that are valid but
cannot be handled.

- Bodies nested past ``MAX_JSON_DEPTH``: Python's JSON parser, jsonschema and ``json.dumps``
  all recurse, and a body nested thousands of levels deep would end in a ``RecursionError``
  (a 500) somewhere. No workflow document or run input needs more.
- ``\u0000`` in a string or a key: JSON allows it, Postgres' ``jsonb`` and text do not, so
  storing it would fail after validation. Each place is named (``input.a[0].b``).
- A lone surrogate (``\ud800`` to ``\udfff`` not part of a pair) in a string or a key: JSON
  allows it, but it is not text that UTF-8 can carry. Stored (SQLite keeps it), it made every
  answer that included it a 500 in the renderer, for every user: one run broke the run list.
  Python's JSON parser joins a valid pair into one character, so any surrogate left is lone.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from workflows.errors import FieldError, InvalidInput
from workflows.validation import field_path

MAX_JSON_DEPTH = 100
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _unstorable(text: str) -> str | None:
    """What in ``text`` cannot be stored, or None."""
    found = UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "the character \\u0000"
    return f"a lone surrogate (\\u{ord(found.group()):04x})"


def text_problems(value: Any) -> list[FieldError]:
    """Every place in ``value`` holding ``\u0000`` or a lone surrogate; a key's problem is
    named at its object."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        where = field_path(path) or "body"
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


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
        except ParseError as error:
            # Python refuses integers of more than 4,300 digits (CVE-2020-10735) and says so
            # with advice for Python programmers; a client needs only the limit.
            if "int_max_str_digits" in str(error.detail):
                raise ParseError(
                    f"JSON parse error: a number has more than {sys.get_int_max_str_digits()} "
                    "digits"
                ) from None
            raise
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        problems = text_problems(data)
        if problems:
            raise InvalidInput(errors=problems)
        return data
