"""Guards: the JSON conditions of ``when``, ``if`` and ``until`` (contract section 3).

Pure Python, no Django.

Grammar
-------
A guard is exactly one of::

    {"path": "steps.a.status", "op": "eq", "value": "failed"}   # a comparison
    {"all": [<guard>, ...]}                                     # non-empty; true when all are
    {"any": [<guard>, ...]}                                     # non-empty; true when one is
    {"not": <guard>}

``path`` is a plain dotted path (no ``${}``) over the template context, read with
``templates.lookup_or_missing``. ``value`` is literal JSON, never a template.

Semantics
---------
* A path that does not exist makes every comparison false, ``ne`` and ``exists`` included;
  ``not`` simply negates its child, so ``{"not": {"path": <missing>, "op": "eq", ...}}`` is
  true.
* ``exists`` is true when the path is present, even when its value is ``null``.
* ``eq``/``ne`` are JSON equality: ``1`` equals ``1.0``; ``true`` is not ``1``; objects and
  arrays compare structurally.
* ``lt``/``lte``/``gt``/``gte`` compare a number with a number or a string with a string
  (code point order); booleans are not numbers. Any other pairing is false.
* ``in``: when ``value`` is an array, the actual value equals one of its elements; when
  ``value`` is a string, the actual value is a string contained in it.
* ``matches``: ``value`` is a regular expression searched in the actual value, which must be
  a string. It runs on RE2 (``workflows.regex``), in time linear in the value: no
  backreferences, no lookarounds.

Invariants
----------
* ``evaluate`` never raises, for any JSON guard and any JSON context.
* A guard with any structural problem (anything ``guard_errors`` reports) evaluates to false
  as a whole, never to the negation of a broken part. The validator rejects such guards at
  save, so at run time this only protects against documents that bypassed it.
* Nesting is bounded by ``MAX_DEPTH``, which keeps every walk far from the recursion limit.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any, Final

from workflows.regex import compile_linear, linear_pattern_error
from workflows.templates import MISSING, join_location, lookup_or_missing, split_path

__all__ = [
    "COMBINATORS",
    "MAX_DEPTH",
    "OPS",
    "compile_pattern",
    "evaluate",
    "guard_errors",
    "guard_paths",
    "json_equal",
    "pattern_error",
]

OPS: Final[frozenset[str]] = frozenset(
    {"eq", "ne", "lt", "lte", "gt", "gte", "in", "exists", "matches"}
)
COMBINATORS: Final[frozenset[str]] = frozenset({"all", "any", "not"})
_LEAF_KEYS: Final[frozenset[str]] = frozenset({"path", "op", "value"})
_ORDERING: Final[frozenset[str]] = frozenset({"lt", "lte", "gt", "gte"})
# Hand-written guards never come near this; it keeps recursion bounded for hostile input.
MAX_DEPTH: Final[int] = 64

_SHAPE = (
    "a guard must be exactly one of {path, op, value}, {all: [...]}, {any: [...]}, {not: {...}}"
)


def pattern_error(pattern: str) -> str | None:
    """Why ``pattern`` is not a regular expression RE2 can run, or ``None`` when it is."""
    return linear_pattern_error(pattern)


def compile_pattern(pattern: str) -> Any | None:
    """The compiled ``matches`` pattern, or ``None`` when RE2 cannot compile it."""
    return compile_linear(pattern) if isinstance(pattern, str) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (``1 == 1.0``), booleans only equal booleans.

    Python's ``==`` says ``True == 1`` (also inside containers), which JSON does not. Iterative,
    so deep values cannot exhaust the stack.
    """
    stack: list[tuple[Any, Any]] = [(a, b)]
    while stack:
        x, y = stack.pop()
        if isinstance(x, bool) or isinstance(y, bool):
            if not (isinstance(x, bool) and isinstance(y, bool) and x == y):
                return False
        elif _is_number(x) or _is_number(y):
            if not (_is_number(x) and _is_number(y) and x == y):
                return False
        elif isinstance(x, str) or isinstance(y, str):
            if not (isinstance(x, str) and isinstance(y, str) and x == y):
                return False
        elif x is None or y is None:
            if not (x is None and y is None):
                return False
        elif isinstance(x, Mapping) and isinstance(y, Mapping):
            if len(x) != len(y) or any(key not in y for key in x):
                return False
            stack.extend((x[key], y[key]) for key in x)
        elif isinstance(x, list | tuple) and isinstance(y, list | tuple):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        else:
            return False
    return True


def _compare(actual: Any, op: str, value: Any) -> bool:
    """One comparison on a present value; ``op`` and ``value`` are already well-formed."""
    if op == "exists":
        return True
    if op == "eq":
        return json_equal(actual, value)
    if op == "ne":
        return not json_equal(actual, value)
    if op in _ORDERING:
        comparable = (_is_number(actual) and _is_number(value)) or (
            isinstance(actual, str) and isinstance(value, str)
        )
        if not comparable:
            return False
        if op == "lt":
            return bool(actual < value)
        if op == "lte":
            return bool(actual <= value)
        if op == "gt":
            return bool(actual > value)
        return bool(actual >= value)
    if op == "in":
        if isinstance(value, str):
            return isinstance(actual, str) and actual in value
        return isinstance(value, list) and any(json_equal(actual, item) for item in value)
    if op == "matches":
        pattern = compile_pattern(value) if isinstance(value, str) else None
        return pattern is not None and isinstance(actual, str) and bool(pattern.search(actual))
    return False


def _evaluate(guard: Any, context: Mapping[str, Any], depth: int) -> bool:
    """Evaluate a guard that ``guard_errors`` accepted; still defensive, never raises."""
    if depth > MAX_DEPTH or not isinstance(guard, Mapping):
        return False
    if "all" in guard:
        children = guard["all"]
        return isinstance(children, list) and all(
            _evaluate(child, context, depth + 1) for child in children
        )
    if "any" in guard:
        children = guard["any"]
        return isinstance(children, list) and any(
            _evaluate(child, context, depth + 1) for child in children
        )
    if "not" in guard:
        return not _evaluate(guard["not"], context, depth + 1)
    path = guard.get("path")
    op = guard.get("op")
    if not isinstance(path, str) or not isinstance(op, str):
        return False
    actual = lookup_or_missing(context, path)
    if actual is MISSING:
        return False
    return _compare(actual, op, guard.get("value"))


def evaluate(guard: Any, context: Mapping[str, Any]) -> bool:
    """Whether ``guard`` holds in ``context``. False for a malformed guard. Never raises."""
    if guard_errors(guard):
        return False
    return _evaluate(guard, context, 0)


def guard_paths(guard: Any) -> list[tuple[str, str]]:
    """Every string ``path`` in ``guard`` as ``(location, path)``, in document order.

    ``{"all": [{"path": "steps.a.status", ...}]}`` gives ``[("all[0].path", "steps.a.status")]``.
    Walks malformed guards too, as far as they have the shape of one; never raises.
    """
    found: list[tuple[str, str]] = []
    stack: list[tuple[str, Any, int]] = [("", guard, 0)]
    while stack:
        location, node, depth = stack.pop()
        if not isinstance(node, Mapping) or depth > MAX_DEPTH:
            continue
        path = node.get("path")
        if isinstance(path, str):
            found.append((join_location(location, "path"), path))
        children: list[tuple[str, Any, int]] = []
        for key in ("all", "any"):
            items = node.get(key)
            if isinstance(items, list):
                children.extend(
                    (join_location(location, f"{key}[{i}]"), item, depth + 1)
                    for i, item in enumerate(items)
                )
        if "not" in node:
            children.append((join_location(location, "not"), node["not"], depth + 1))
        stack.extend(reversed(children))
    return found


def _node_errors(node: Any, location: str, depth: int, errors: list[tuple[str, str]]) -> None:
    def at(child: str) -> str:
        return join_location(location, child)

    if depth > MAX_DEPTH:
        errors.append((location, f"guards nest deeper than {MAX_DEPTH} levels"))
        return
    if not isinstance(node, Mapping):
        errors.append((location, _SHAPE))
        return

    known = COMBINATORS | _LEAF_KEYS
    for key in node:
        if key not in known:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            errors.append((at(str(key)), f"unknown field {key!r}{suggestion}"))

    combinators = [key for key in ("all", "any", "not") if key in node]
    leaf_keys = [key for key in ("path", "op", "value") if key in node]
    if len(combinators) + (1 if leaf_keys else 0) != 1:
        errors.append((location, _SHAPE))
        return

    if combinators:
        key = combinators[0]
        child = node[key]
        if key == "not":
            _node_errors(child, at("not"), depth + 1, errors)
        elif not isinstance(child, list):
            errors.append((at(key), f"{key} must be a non-empty array of guards"))
        elif not child:
            errors.append((at(key), f"{key} must not be empty"))
        else:
            for i, item in enumerate(child):
                _node_errors(item, at(f"{key}[{i}]"), depth + 1, errors)
        return

    _leaf_errors(node, at, errors)


def _leaf_errors(
    node: Mapping[str, Any], at: Callable[[str], str], errors: list[tuple[str, str]]
) -> None:
    if "path" not in node:
        errors.append((at("path"), "required field 'path'"))
    else:
        path = node["path"]
        if not isinstance(path, str) or not path:
            errors.append((at("path"), "path must be a non-empty string"))
        elif "${" in path:
            errors.append(
                (at("path"), "a guard path is a plain dotted path such as steps.a.output, no ${}")
            )
        elif not split_path(path):
            errors.append((at("path"), f"malformed path {path!r}: a segment is empty"))

    if "op" not in node:
        errors.append((at("op"), "required field 'op'"))
        return
    op = node["op"]
    if not isinstance(op, str) or op not in OPS:
        expected = ", ".join(sorted(OPS))
        errors.append((at("op"), f"unknown op {op!r}; must be one of {expected}"))
        return

    if op == "exists":
        if "value" in node:
            errors.append((at("value"), "op exists takes no 'value'"))
        return
    if "value" not in node:
        errors.append((at("value"), f"required field 'value' for op {op}"))
        return
    value = node["value"]
    if op in _ORDERING and not (_is_number(value) or isinstance(value, str)):
        errors.append((at("value"), f"{op} compares numbers or strings; got {_kind(value)}"))
    elif op == "in" and not isinstance(value, list | str):
        errors.append((at("value"), f"in needs an array or a string; got {_kind(value)}"))
    elif op == "matches":
        if not isinstance(value, str):
            message = f"matches needs a regular expression string; got {_kind(value)}"
            errors.append((at("value"), message))
        else:
            problem = pattern_error(value)
            if problem is not None:
                errors.append((at("value"), f"invalid regular expression: {problem}"))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def guard_errors(guard: Any) -> list[tuple[str, str]]:
    """Every structural problem in ``guard`` as ``(location, message)``; ``[]`` when well-formed.

    Locations are relative to the guard (``"path"``, ``"op"``, ``"all[1].value"``; ``""`` for
    the guard itself). Unknown fields are errors, never ignored: a misspelt guard must not
    become a skipped guard. Roots and step ids are not checked here; the validator does that
    with ``guard_paths``. Never raises.
    """
    errors: list[tuple[str, str]] = []
    _node_errors(guard, "", 0, errors)
    return errors
