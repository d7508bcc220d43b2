"""The API's JSON parser: DRF's, with bodies nested past a sane depth refused as a 400.

Python's JSON parser, jsonschema and ``json.dumps`` all recurse; a body nested thousands of
levels deep would end in a ``RecursionError`` (a 500) somewhere. No workflow document or run
input needs more than ``MAX_JSON_DEPTH`` levels.
"""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_JSON_DEPTH = 100


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
        return data
