"""Templates: JSON values whose strings may contain ``${path}`` references.

Pure Python, no Django: the validator, the engine and the builder all use this module.

Syntax
------
``${path}`` references a value in the run context; whitespace inside the braces is ignored
(``${ input.x }`` is ``${input.x}``). ``$${`` is an escape: it produces a literal ``${`` and
starts no reference, so ``"$${input.x}"`` resolves to the text ``${input.x}``. Put another
way, a ``${`` directly after a ``$`` never starts a reference. A ``${`` with no closing brace,
or with a brace inside, is plain text.

A path is a dotted list of segments (``steps.search.output.hits.0.url``). On an object a
segment is a key; on an array it must be a non-negative integer written without leading
zeros (``0``, ``12``; not ``01``, ``-1``). Strings are never indexed.

The context
-----------
At run time templates and guards read one context, whose roots are ``ROOTS``::

    {
        "input": <the run input>,
        "steps": {<step id>: {"output": ..., "status": "...",
                              "error": {"class": "...", "message": "..."} | None}},
        "run": {"id": "...", "correlation": ...},
        "item": <the current foreach item>,      # inside foreach only
        "index": <int, the foreach item index>,  # inside foreach only
        "iter": {"index": <int>, "previous": <the previous iteration's output>},  # loop only
        "error": {"class": "...", "message": "...", "step": "..."},  # on_failure steps only
    }

Invariants
----------
* ``lookup`` and ``resolve`` never raise for any string path, JSON template and JSON context;
  anything that cannot be found resolves to ``None`` (``null``). The one exception is
  ``resolve(..., max_bytes=n)``, which raises :class:`TooLarge` when the result, as compact
  UTF-8 JSON, would be over ``n`` bytes, and never builds much more than that: a template that
  references a large value many times (a "template bomb": 300 KB of request turned into
  4.9 GB) is refused while it is rendered, not after.
* ``resolve`` returns a new value: the template and the context are never mutated and share no
  containers with the result. Substituted values are never resolved again, so a step output
  containing ``${...}`` text cannot inject references.
* Walks over templates are iterative, so nesting depth is bounded by memory, not by Python's
  recursion limit.
* ``translate_legacy`` is idempotent.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Literal

__all__ = [
    "ESCAPE",
    "LEGACY_REFERENCE",
    "MISSING",
    "REFERENCE",
    "ROOTS",
    "Missing",
    "TooLarge",
    "check_size",
    "interpolate",
    "is_single_reference",
    "is_valid_path",
    "join_location",
    "lookup",
    "lookup_or_missing",
    "reference_errors",
    "references",
    "resolve",
    "split_path",
    "text_form",
    "translate_legacy",
]

ROOTS: Final[frozenset[str]] = frozenset(
    {"input", "steps", "run", "item", "index", "iter", "error"}
)

# The lookbehind is what makes ``$${`` an escape: any ``${`` right after a ``$`` is literal.
REFERENCE: Final[re.Pattern[str]] = re.compile(r"(?<!\$)\$\{\s*(?P<path>[^{}]*?)\s*\}")
ESCAPE: Final[str] = "$${"

# Segments exclude ``$``, braces, dots and whitespace so that a translated reference can never
# combine with the text around it into a new legacy reference (translation is idempotent).
# A ``$`` right before ``{{`` would turn the translation into an escape (``$${``), so such a
# reference is left untouched rather than silently made literal.
LEGACY_REFERENCE: Final[re.Pattern[str]] = re.compile(
    r"(?<!\$)\{\{\s*(?P<root>workflow_input|step|loop_item)"
    r"(?P<rest>(?:\.[^.\s${}]+)*)\s*\}\}"
)

_INDEX = re.compile(r"0|[1-9][0-9]*")
# No JSON array is longer than this; also keeps int() away from its digit limit.
_MAX_INDEX_DIGITS = 18


class Missing(enum.Enum):
    """The type of ``MISSING``; an enum so that type checkers can narrow on it."""

    MISSING = "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = Missing.MISSING


def split_path(path: str) -> list[str]:
    """Split a dotted path into segments; ``[]`` when the path is malformed.

    Malformed means: not a string, empty, or with an empty segment (``a..b``, ``.a``, ``a.``).
    Never raises.
    """
    if not isinstance(path, str) or not path:
        return []
    segments = path.split(".")
    if any(segment == "" for segment in segments):
        return []
    return segments


def is_valid_path(path: str) -> bool:
    """Whether ``path`` is syntactically a dotted path. Roots are not checked (see ``ROOTS``)."""
    return bool(split_path(path))


def lookup_or_missing(context: Mapping[str, Any], path: str) -> Any | Literal[Missing.MISSING]:
    """The value at ``path`` in ``context``, or ``MISSING`` when there is none.

    Distinguishes a present ``null`` (returns ``None``) from an absent path (``MISSING``).
    A malformed path, a missing key, an out-of-range or non-canonical index, and indexing into
    a scalar are all ``MISSING``. Never raises.
    """
    segments = split_path(path)
    if not segments:
        return MISSING
    current: Any = context
    for segment in segments:
        if isinstance(current, Mapping):
            try:
                if segment not in current:
                    return MISSING
                current = current[segment]
            except (KeyError, TypeError):
                return MISSING
        elif isinstance(current, list | tuple):
            if len(segment) > _MAX_INDEX_DIGITS or not _INDEX.fullmatch(segment):
                return MISSING
            position = int(segment)
            if position >= len(current):
                return MISSING
            current = current[position]
        else:
            return MISSING
    return current


def lookup(context: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` in ``context``; ``None`` when absent. Never raises."""
    value = lookup_or_missing(context, path)
    return None if value is MISSING else value


def is_single_reference(s: str) -> str | None:
    """The (stripped) path when ``s`` is exactly one reference and nothing else, else ``None``."""
    if not isinstance(s, str):
        return None
    match = REFERENCE.fullmatch(s)
    return match.group("path") if match else None


def text_form(value: Any) -> str:
    """How a value reads when interpolated into text.

    Strings as-is, ``None`` as the empty string, everything else as compact JSON (``true``,
    ``3``, ``{"a":1}``). Never raises.
    """
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        # Only reachable for values JSON could never have stored (cycles, extreme depth).
        return ""


def _unescape(text: str) -> str:
    return text.replace(ESCAPE, "${")


class TooLarge(ValueError):
    """A value is (or would be, once rendered) larger than allowed, as compact UTF-8 JSON."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        self.limit, self.size = limit, size
        found = f"{size} bytes" if size is not None else "more than that"
        super().__init__(f"over {limit} bytes as JSON ({found})")


def encoded_size(value: Any) -> int:
    """``value``'s size as compact UTF-8 JSON, the form the bounds are stated in."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "surrogatepass"))


class _Budget:
    """What is left of ``max_bytes`` while a template is rendered.

    Spending uses a lower bound of each piece's encoded size (a character is at least a byte,
    escapes only add), so a value refused here is over the limit for certain, and what was
    built before the refusal is at most about the limit. A value referenced many times is
    measured once (by identity: the context does not change while a template renders).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit
        self._sizes: dict[int, int] = {}
        self._texts: dict[int, str] = {}

    def spend(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise TooLarge(self.limit)

    def spend_on(self, value: Any) -> None:
        key = id(value)
        if key not in self._sizes:
            self._sizes[key] = _least_size(value, self.left)
        self.spend(self._sizes[key])

    def text_of(self, value: Any) -> str:
        """``text_form(value)``, paid for; a non-string is measured before it is dumped."""
        if isinstance(value, str):
            self.spend(len(value))
            return value
        key = id(value)
        if key not in self._texts:
            self.spend_on(value)
            self.left += self._sizes[key]  # paid below, by the text itself
            self._texts[key] = text_form(value)
        self.spend(len(self._texts[key]))
        return self._texts[key]


def _least_size(value: Any, limit: int) -> int:
    """A lower bound of ``value``'s encoded size; stops counting once past ``limit``."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, Mapping):
            total += 2 + len(item)
            for key, child in item.items():
                total += len(str(key)) + 3
                stack.append(child)
        elif isinstance(item, list | tuple):
            total += 2 + len(item)
            stack.extend(item)
        else:
            total += 1
    return total


def check_size(value: Any, max_bytes: int) -> None:
    """Raise :class:`TooLarge` when ``value`` is over ``max_bytes`` as compact UTF-8 JSON. A
    value far over is refused by its lower bound, before any text of it is built."""
    if _least_size(value, max_bytes) > max_bytes:
        raise TooLarge(max_bytes)
    size = encoded_size(value)
    if size > max_bytes:
        raise TooLarge(max_bytes, size)


def _resolve_string(s: str, context: Mapping[str, Any], budget: _Budget | None = None) -> Any:
    path = is_single_reference(s)
    if path is not None:
        value = lookup(context, path)
        if budget is not None:
            budget.spend_on(value)
        return _copy(value)
    if "${" not in s:
        if budget is not None:
            budget.spend(len(s) + 2)
        return s
    parts: list[str] = []
    end = 0
    for match in REFERENCE.finditer(s):
        parts.append(_unescape(s[end : match.start()]))
        value = lookup(context, match.group("path"))
        parts.append(text_form(value) if budget is None else budget.text_of(value))
        end = match.end()
    parts.append(_unescape(s[end:]))
    if budget is not None:
        budget.spend(len(parts[-1]) + sum(len(p) for p in parts[:-1:2]) + 2)
    return "".join(parts)


def map_json(
    value: Any,
    fn: Callable[[Any], Any],
    *,
    keys: Callable[[str], str] | None = None,
    scalars: bool = False,
    budget: _Budget | None = None,
) -> Any:
    """A copy of the JSON-like ``value`` with every string value replaced by ``fn(string)``;
    with ``scalars``, every other scalar by ``fn(scalar)`` too; with ``keys``, every string key
    by ``keys(key)``. Tuples come back as lists (JSON has none).

    Iterative, so deep nesting cannot exhaust the stack. What ``fn`` returns is placed as-is
    and never walked again. With a ``budget``, every container and key is paid for.
    """

    def convert(item: Any) -> tuple[Any, tuple[Any, Any] | None]:
        if isinstance(item, str):
            return fn(item), None
        if budget is not None:
            budget.spend(2 + len(item) if isinstance(item, Mapping | list | tuple) else 1)
        if isinstance(item, Mapping):
            new_dict: dict[Any, Any] = {}
            if budget is not None:
                budget.spend(sum(len(str(key)) + 3 for key in item))
            return new_dict, (item, new_dict)
        if isinstance(item, list | tuple):
            new_list: list[Any] = []
            return new_list, (item, new_list)
        return (fn(item) if scalars else item), None

    result, pending = convert(value)
    stack = [pending] if pending is not None else []
    while stack:
        source, target = stack.pop()
        if isinstance(target, dict):
            for key, child in source.items():
                name = keys(key) if keys is not None and isinstance(key, str) else key
                target[name], pending = convert(child)
                if pending is not None:
                    stack.append(pending)
        else:
            for child in source:
                new_child, pending = convert(child)
                target.append(new_child)
                if pending is not None:
                    stack.append(pending)
    return result


def _copy(value: Any) -> Any:
    return map_json(value, lambda s: s)


def resolve(template: Any, context: Mapping[str, Any], *, max_bytes: int | None = None) -> Any:
    """Resolve every reference in ``template`` against ``context``; return a new value.

    Objects and arrays are resolved recursively; keys are not templated. A string that is
    exactly one reference becomes the referenced value with its JSON type (a missing one
    becomes ``None``). In any other string each reference is replaced by ``text_form`` of its
    value and ``$${`` becomes ``${``. Never raises for JSON input, except :class:`TooLarge`
    when ``max_bytes`` is given and the result would be over it (checked while rendering).
    """
    if max_bytes is None:
        return map_json(template, lambda s: _resolve_string(s, context))
    budget = _Budget(max_bytes)
    resolved = map_json(template, lambda s: _resolve_string(s, context, budget), budget=budget)
    check_size(resolved, max_bytes)
    return resolved


def interpolate(text: str, context: Mapping[str, Any], *, max_bytes: int | None = None) -> str:
    """``text`` with every reference replaced by ``text_form`` of its value: always text, even
    when the whole string is one reference (a prompt is text, not a value). A missing path, as
    a present ``null``, reads as the empty string; ``$${`` becomes ``${``. Never raises, except
    :class:`TooLarge` when ``max_bytes`` is given and the result, as UTF-8, would be over it
    (checked while it is built, so a value referenced many times is refused before the text
    is)."""
    budget = _Budget(max_bytes) if max_bytes is not None else None
    parts: list[str] = []
    end = 0
    for match in REFERENCE.finditer(text):
        parts.append(_unescape(text[end : match.start()]))
        value = lookup(context, match.group("path"))
        parts.append(text_form(value) if budget is None else budget.text_of(value))
        end = match.end()
    parts.append(_unescape(text[end:]))
    if budget is not None:
        budget.spend(sum(len(p) for p in parts[::2]))
    result = "".join(parts)
    if max_bytes is not None:
        size = len(result.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise TooLarge(max_bytes, size)
    return result


def join_location(base: str, child: str) -> str:
    """Join two locations: ``join_location("steps[2].input", "a[0]") == "steps[2].input.a[0]"``.

    Either side may be ``""`` (the root); a child starting with ``[`` is appended directly.
    """
    if not base:
        return child
    if not child:
        return base
    if child.startswith("["):
        return base + child
    return f"{base}.{child}"


def _walk_strings(value: Any) -> Iterator[tuple[str, str]]:
    """Every string value in ``value`` with its location, in document order. Iterative."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        location, item = stack.pop()
        if isinstance(item, str):
            yield location, item
        elif isinstance(item, Mapping):
            children = [(join_location(location, str(key)), child) for key, child in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple):
            children = [(f"{location}[{i}]", child) for i, child in enumerate(item)]
            stack.extend(reversed(children))


def references(template: Any) -> list[tuple[str, str]]:
    """Every reference in ``template`` as ``(location, path)``, in document order.

    Locations join object keys with ``.`` and write array indexes as ``[n]``; the root is
    ``""``: ``{"a": ["x ${input.x}"]}`` gives ``[("a[0]", "input.x")]``. Escaped ``$${`` is not
    a reference. Paths are reported as written (stripped), malformed ones included, so that
    the validator can reject them.
    """
    found: list[tuple[str, str]] = []
    for location, text in _walk_strings(template):
        if "${" in text:
            found.extend((location, m.group("path")) for m in REFERENCE.finditer(text))
    return found


# Every ``${`` that is not part of the ``$${`` escape; each must start a REFERENCE match.
_OPENING = re.compile(r"(?<!\$)\$\{")


def reference_errors(template: Any) -> list[tuple[str, str]]:
    """Syntax problems with references as ``(location, message)``, in document order.

    Reports a ``${`` that starts no reference (unclosed, or with a brace inside; ``$${`` is the
    escape and never reported) and a reference whose path is malformed (``${}``, ``${a..b}``).
    Roots and step ids are the validator's business, not checked here. Never raises.
    """
    errors: list[tuple[str, str]] = []
    for location, text in _walk_strings(template):
        if "${" not in text:
            continue
        matches = {m.start(): m for m in REFERENCE.finditer(text)}
        for opening in _OPENING.finditer(text):
            match = matches.get(opening.start())
            if match is None:
                snippet = text[opening.start() : opening.start() + 30]
                errors.append(
                    (
                        location,
                        f"unclosed reference {snippet!r}: ${{...}} needs a closing brace and no "
                        "braces inside (write $${ for a literal ${)",
                    )
                )
            elif not is_valid_path(match.group("path")):
                errors.append(
                    (
                        location,
                        f"malformed reference path {match.group('path')!r} in {match.group(0)!r}",
                    )
                )
    return errors


def _translate_reference(match: re.Match[str]) -> str:
    root = match.group("root")
    rest = match.group("rest")  # "" or ".a.b"
    if root == "workflow_input":
        return "${input" + rest + "}"
    if root == "loop_item":
        return "${item" + rest + "}"
    # step: the first segment is the step id; the rest reads inside its output.
    if not rest:
        return match.group(0)
    step_id, _, inner = rest[1:].partition(".")
    return "${steps." + step_id + ".output" + ("." + inner if inner else "") + "}"


def _translate_string(s: str) -> str:
    if "{{" not in s:
        return s
    return LEGACY_REFERENCE.sub(_translate_reference, s)


def translate_legacy(template: Any) -> Any:
    """Rewrite ``{{...}}`` references of the other common syntax to ``${...}``.

    ``{{workflow_input.x}}`` → ``${input.x}``, ``{{step.a.b}}`` → ``${steps.a.output.b}``
    (``{{step.a}}`` → ``${steps.a.output}``), ``{{loop_item.x}}`` → ``${item.x}``
    (``{{loop_item}}`` → ``${item}``). Whitespace inside the braces is allowed. Anything else in
    ``{{ }}`` is left untouched, as is a reference right after a ``$`` (its translation would
    read as the ``$${`` escape). String values only, never keys. Returns a new value;
    idempotent.
    """
    return map_json(template, _translate_string)
