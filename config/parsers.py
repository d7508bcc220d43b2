"""The API's JSON parser: DRF's, refusing as a 400 two kinds of JSON that are valid but
cannot be handled.

- Bodies nested past ``MAX_JSON_DEPTH``: Python's JSON parser, jsonschema and ``json.dumps``
  all recurse, and a body nested thousands of levels deep would end in a ``RecursionError``
  (a 500) somewhere. No workflow document or run input needs more.
- ``\u0000`` in a string or a key: JSON allows it, Postgres' ``jsonb`` and text do not, so
  storing it would fail after validation. Each place is named (``input.a[0].b``).
"""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from workflows.errors import FieldError, InvalidInput
from workflows.validation import field_path

MAX_JSON_DEPTH = 100
NUL = "the character \\u0000"


def nul_problems(value: Any) -> list[FieldError]:
    """Every place in ``value`` holding ``\u0000``; a key's problem is named at its object."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        where = field_path(path) or "body"
        if isinstance(item, str):
            if "\x00" in item:
                problems.append(FieldError(where, f"a string may not contain {NUL}"))
        elif isinstance(item, dict):
            for key, child in item.items():
                if "\x00" in key:
                    problems.append(
                        FieldError(where, "a key may not contain the character \\u0000")
                    )
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
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        problems = nul_problems(data)
        if problems:
            raise InvalidInput(errors=problems)
        return data
