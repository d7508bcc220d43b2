"""What a step's output can be read as: the static check, at save, of template and guard paths
into steps whose output shape is known (contract sections 4 and 17).

Pure Python, no Django: the validator (``workflows.validation``) asks :func:`output_problem`
about every ``steps.<id>.output...`` path it meets.

Shapes
------
A shape says which paths a value can have. Only what is certain is a shape; everything else is
:data:`UNKNOWN`, which has every path. The known ones:

* a recipe step with ``output: "json"`` and an inline ``output_schema``: the schema (the worker
  checks every reply against it, and a reply that does not match fails the step), walked
  through ``properties``, ``patternProperties``, ``additionalProperties``, ``prefixItems``,
  ``items``, ``maxItems``, local ``$ref``, ``const``, ``enum``, ``type``, ``allOf``, ``anyOf``
  and ``oneOf``; a text recipe (``output`` ``"text"``, the default): a string. A recipe step
  that names a stored recipe is unknown: which version runs is settled when it runs.
* ``http``: ``{status, headers, body}``, ``status`` a number, ``headers`` an object of text
  whose names are lower case, ``body`` unknown.
* ``approval``: ``{decision, by, comment}``, each text. ``write_kb``: ``{kb, key, version}``.
* ``sleep``, ``sleep_until``, ``handoff``: null.
* ``parallel``: ``{branch: the branch's output}`` with exactly its branches (``all_settled``:
  ``{branch: {status, output, error}}``); ``foreach``: an array of its body's output; ``loop``:
  its body's output; ``condition``: the output of the last step of either branch (null for a
  branch that is missing). A body of several steps answers its last step's output.
* Everything else (``task``, ``agent``, ``mcp_tool``, ``wait_event``, ``subworkflow``, a
  deployment's own kinds, a json recipe without a schema): unknown.

Invariants
----------
* A path is refused only when no value of the shape can have it: a key an object cannot hold
  (its schema's ``additionalProperties`` is ``false`` and neither ``properties`` nor a matching
  ``patternProperties`` names it), a key of an array, an index past a closed tuple or
  ``maxItems``, anything past a string, number, boolean or null. Strings are never indexed
  (``workflows.templates``). A key that is declared but not required is allowed: it may be
  there.
* ``anyOf``/``oneOf``: a path is refused only when every alternative refuses it. ``allOf``, a
  ``$ref`` and the keywords beside them all hold of one value, so a path any of them refuses
  cannot be there; a keyword not listed above (``not``, ``if``, ``unevaluatedProperties``...)
  only narrows further and is ignored, which never refuses a path it would allow.
* A ``$ref`` that is not local, or that cannot be resolved, or a cycle of ``$ref``s with no
  structure in between (``{"$ref": "#"}`` at the root), is unknown.
* The walk is iterative over the path's segments and bounded: a shape that grows past
  :data:`MAX_SHAPE_NODES` (alternatives of alternatives) is taken as unknown. Never raises for
  any JSON step and path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from .regex import compile_linear

__all__ = ["MAX_SHAPE_NODES", "UNKNOWN", "Shape", "output_problem", "output_shape"]

# Shapes looked at (and alternatives and conjuncts held at once) for one segment of a path. A
# real schema needs a handful; past this the walk gives up and allows the path. Each look is a
# frame of recursion, so this also keeps a schema that refers to itself (``{"$ref": "#",
# "type": "object"}``) well inside Python's recursion limit.
MAX_SHAPE_NODES: Final = 200
_INDEX_DIGITS: Final = 18


@dataclass(frozen=True)
class Unknown:
    """Any value: every path is allowed."""


@dataclass(frozen=True)
class Leaf:
    """A value nothing can be read from: ``type`` is a JSON type name, or ``nothing`` for a
    schema that allows no value (``false``)."""

    type: str


@dataclass(frozen=True)
class Obj:
    """An object: ``properties`` by name, ``patterns`` (RE2 patterns, searched as
    ``patternProperties`` are) for the keys they match, ``rest`` for any other key (``None``:
    no other key). ``noun`` is how its keys are called in messages (a parallel's are branches),
    ``lower_keys`` that every key is lower case (HTTP header names)."""

    properties: Mapping[str, Shape]
    patterns: tuple[tuple[str, Shape], ...] = ()
    rest: Shape | None = None
    noun: str = "property"
    lower_keys: bool = False


@dataclass(frozen=True)
class Arr:
    """An array: ``prefix`` for its first items, ``items`` for the others (``None``: none),
    ``max_items`` its largest length when known."""

    items: Shape | None
    prefix: tuple[Shape, ...] = ()
    max_items: int | None = None


@dataclass(frozen=True)
class Either:
    """One of ``options`` (``anyOf``, ``oneOf``, a schema's list of types, a condition's
    branches)."""

    options: tuple[Shape, ...]


@dataclass(frozen=True)
class Both:
    """All of ``parts`` at once (``allOf``, a ``$ref`` and its sibling keywords)."""

    parts: tuple[Shape, ...]


@dataclass(frozen=True)
class Schema:
    """A JSON Schema node, expanded into the shapes above when a path reaches it (so a
    recursive schema is walked only as deep as the path goes). ``root`` is the document its
    local ``$ref``s point into."""

    node: Any
    root: Any = field(compare=False, repr=False)


Shape = Unknown | Leaf | Obj | Arr | Either | Both | Schema

UNKNOWN: Final = Unknown()
_NULL: Final = Leaf("null")
_TEXT: Final = Leaf("string")
_NUMBER: Final = Leaf("integer")
_SCALARS: Final = ("string", "number", "integer", "boolean", "null")
# The keywords that say what an object or an array holds; a node with none of them and no
# type holds anything.
_STRUCTURE: Final = frozenset(
    {"properties", "patternProperties", "additionalProperties", "prefixItems", "items", "maxItems"}
)


# --- each kind's output -----------------------------------------------------------------------


def _closed(**properties: Shape) -> Obj:
    return Obj(properties=properties)


_FIXED: Final[dict[str, Shape]] = {
    "sleep": _NULL,
    "sleep_until": _NULL,
    "handoff": _NULL,
    # approvals.services.approval_decide: {"decision", "by": the approver's label, "comment"}.
    "approval": _closed(decision=_TEXT, by=_TEXT, comment=_TEXT),
    "write_kb": _closed(kb=_TEXT, key=_TEXT, version=_NUMBER),
    # workers.kinds.http: header names as httpx gives them (lower case), repeated ones joined
    # into one text; the body is whatever the server answered.
    "http": _closed(
        status=_NUMBER,
        headers=Obj(properties={}, rest=_TEXT, noun="header", lower_keys=True),
        body=UNKNOWN,
    ),
}


def output_shape(step: Mapping[str, Any], memo: dict[int, Shape] | None = None) -> Shape:
    """The shape of ``step``'s output (``UNKNOWN`` where it is not certain). ``memo`` keeps
    the shapes of steps already seen (by identity), so that a document's composite steps are
    each worked out once however often they are read."""
    memo = {} if memo is None else memo
    key = id(step)
    if key not in memo:
        memo[key] = _output_shape(step, memo)
    return memo[key]


def _output_shape(step: Mapping[str, Any], memo: dict[int, Shape]) -> Shape:
    kind = step.get("kind")
    if not isinstance(kind, str):
        return UNKNOWN
    if kind in _FIXED:
        return _FIXED[kind]
    if kind == "recipe":
        return _recipe_shape(step)
    if kind == "parallel":
        return _parallel_shape(step, memo)
    if kind == "foreach":
        return Arr(items=_body_shape(step.get("do"), memo))
    if kind == "loop":
        return _body_shape(step.get("do"), memo)
    if kind == "condition":
        return _either(
            _body_shape(step.get(name), memo) if step.get(name) else _NULL
            for name in ("then", "else")
        )
    return UNKNOWN


def _recipe_shape(step: Mapping[str, Any]) -> Shape:
    if "prompt" not in step or "recipe" in step:
        return UNKNOWN  # a stored recipe: the version that runs is chosen when it runs
    output = step.get("output", "text")
    if output == "text":
        return _TEXT
    schema = step.get("output_schema")
    if output == "json" and isinstance(schema, Mapping | bool):
        return Schema(schema, schema)
    return UNKNOWN


def _parallel_shape(step: Mapping[str, Any], memo: dict[int, Shape]) -> Shape:
    branches = step.get("branches")
    if not isinstance(branches, Mapping):
        return UNKNOWN
    settled = step.get("mode") == "all_settled"
    properties: dict[str, Shape] = {}
    for name, body in branches.items():
        output = _body_shape(body, memo)
        # The error of a settled branch is the engine's failure record: only its presence is
        # certain, so it is not looked into here.
        properties[str(name)] = (
            _closed(status=_TEXT, output=output, error=UNKNOWN) if settled else output
        )
    return Obj(properties=properties, noun="branch")


def _body_shape(body: Any, memo: dict[int, Shape]) -> Shape:
    """A ``do`` or a branch: one step, or a list whose last step's output is the body's."""
    if isinstance(body, list):
        body = body[-1] if body else None
    if not isinstance(body, Mapping):
        return UNKNOWN
    return output_shape(body, memo)


# --- JSON Schema ------------------------------------------------------------------------------


def _expand(schema: Schema) -> Shape:
    """One schema node as the shapes above, its ``$ref``s followed (a cycle of bare ``$ref``s
    is unknown)."""
    node, root = schema.node, schema.root
    seen: set[str] = set()
    while isinstance(node, Mapping) and set(node) == {"$ref"}:
        ref = node["$ref"]
        if not isinstance(ref, str) or ref in seen:
            return UNKNOWN
        seen.add(ref)
        node = _resolve(ref, root)
    if node is True or node is None:
        return UNKNOWN
    if node is False:
        return Leaf("nothing")
    if not isinstance(node, Mapping):
        return UNKNOWN
    parts: list[Shape] = []
    if "$ref" in node:
        parts.append(Schema(_resolve(node["$ref"], root), root))
    if isinstance(node.get("allOf"), list):
        parts.extend(Schema(member, root) for member in node["allOf"])
    for name in ("anyOf", "oneOf"):
        if isinstance(node.get(name), list) and node[name]:
            parts.append(Either(tuple(Schema(member, root) for member in node[name])))
    if "const" in node:
        parts.append(_literal(node["const"]))
    if isinstance(node.get("enum"), list) and node["enum"]:
        parts.append(Either(tuple(_literal(value) for value in node["enum"])))
    parts.append(_own_shape(node, root))
    return _both(parts)


def _resolve(ref: Any, root: Any) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/x``) points to; ``True`` (anything) for any
    other reference or one that points nowhere."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return True
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return True  # an anchor (``#name``): not followed
    node = root
    for token in pointer.split("/")[1:] if pointer else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return True
    return node


def _own_shape(node: Mapping[str, Any], root: Any) -> Shape:
    """What ``type``, the object keywords and the array keywords say."""
    declared = node.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        types = None  # no type: any value, objects and arrays under their keywords
        if not _STRUCTURE.intersection(node):
            return UNKNOWN
    options: list[Shape] = []
    if types is None or "object" in types:
        options.append(_object_schema(node, root))
    if types is None or "array" in types:
        options.append(_array_schema(node, root))
    if types is None:
        return _either(options) if options else UNKNOWN
    options.extend(Leaf(t) for t in types if t in _SCALARS)
    return _either(options)


def _object_schema(node: Mapping[str, Any], root: Any) -> Shape:
    properties = node.get("properties")
    patterns = node.get("patternProperties")
    additional = node.get("additionalProperties", True)
    return Obj(
        properties={
            str(name): Schema(value, root)
            for name, value in (properties.items() if isinstance(properties, Mapping) else ())
        },
        patterns=tuple(
            (str(pattern), Schema(value, root))
            for pattern, value in (patterns.items() if isinstance(patterns, Mapping) else ())
        ),
        rest=None if additional is False else Schema(additional, root),
    )


def _array_schema(node: Mapping[str, Any], root: Any) -> Shape:
    prefix = node.get("prefixItems")
    items = node.get("items", True)
    if isinstance(items, list):
        return UNKNOWN  # the old tuple form, not 2020-12 (refused at save): not trusted
    maximum = node.get("maxItems")
    return Arr(
        items=None if items is False else Schema(items, root),
        prefix=tuple(Schema(p, root) for p in prefix) if isinstance(prefix, list) else (),
        max_items=maximum if isinstance(maximum, int) and not isinstance(maximum, bool) else None,
    )


def _literal(value: Any) -> Shape:
    """The shape of one known value (``const``, an ``enum`` member)."""
    if isinstance(value, Mapping):
        return Obj(properties={str(k): _literal(v) for k, v in value.items()})
    if isinstance(value, list):
        return Arr(items=None, prefix=tuple(_literal(v) for v in value))
    return Leaf(_json_type(value))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string"


def _either(options: Any) -> Shape:
    options = tuple(options)
    if any(isinstance(o, Unknown) for o in options):
        return UNKNOWN
    return options[0] if len(options) == 1 else Either(options)


def _both(parts: Sequence[Shape]) -> Shape:
    kept = tuple(p for p in parts if not isinstance(p, Unknown))
    if not kept:
        return UNKNOWN
    return kept[0] if len(kept) == 1 else Both(kept)


# --- walking a path ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Refusal:
    """Why a shape cannot have a segment: ``has`` is what it has instead (for the message)."""

    reason: str
    keys: tuple[str, ...] = ()


def _member(shape: Shape, segment: str, budget: list[int]) -> Shape | _Refusal:
    """What ``shape`` holds at ``segment``, or why it holds nothing there."""
    budget[0] -= 1
    if budget[0] < 0:
        return UNKNOWN
    if isinstance(shape, Schema):
        return _member(_expand(shape), segment, budget)
    if isinstance(shape, Unknown):
        return UNKNOWN
    if isinstance(shape, Leaf):
        return _Refusal(_leaf_text(shape.type))
    if isinstance(shape, Obj):
        return _object_member(shape, segment)
    if isinstance(shape, Arr):
        return _array_member(shape, segment)
    if isinstance(shape, Either):
        found = [_member(option, segment, budget) for option in shape.options]
        allowed = [f for f in found if not isinstance(f, _Refusal)]
        if allowed:
            return _either(allowed)
        return _merge([f for f in found if isinstance(f, _Refusal)])
    found = [_member(part, segment, budget) for part in shape.parts]
    for result in found:
        if isinstance(result, _Refusal):
            return result
    return _both([f for f in found if not isinstance(f, _Refusal)])


def _object_member(shape: Obj, segment: str) -> Shape | _Refusal:
    matched: list[Shape] = []
    if segment in shape.properties:
        matched.append(shape.properties[segment])
    for pattern, value in shape.patterns:
        compiled = compile_linear(pattern)
        if compiled is None:
            return UNKNOWN  # refused at save already; it decides nothing here
        if compiled.search(segment):
            matched.append(value)
    if matched:
        return _both(matched)
    if shape.lower_keys and segment != segment.lower():
        return _Refusal(f"has lower-case {shape.noun} names only: read '{segment.lower()}'")
    if shape.rest is not None:
        return shape.rest
    keys = tuple(shape.properties)
    if shape.patterns:
        keys += tuple(f"keys matching /{pattern}/" for pattern, _ in shape.patterns)
    return _Refusal(f"has no {shape.noun} '{segment}'", keys)


def _array_member(shape: Arr, segment: str) -> Shape | _Refusal:
    if len(segment) > _INDEX_DIGITS or not segment.isdigit() or str(int(segment)) != segment:
        return _Refusal("is an array; index it with a number")
    index = int(segment)
    if shape.max_items is not None and index >= shape.max_items:
        return _Refusal(f"is an array of at most {shape.max_items} items")
    if index < len(shape.prefix):
        return shape.prefix[index]
    if shape.items is None:
        return _Refusal(f"is an array of at most {len(shape.prefix)} items")
    return shape.items


def _leaf_text(type_name: str) -> str:
    if type_name == "nothing":
        return "allows no value"
    if type_name == "null":
        return "is null"
    article = "an" if type_name == "integer" else "a"
    return f"is {article} {type_name}" + (" (strings are never indexed)" * (type_name == "string"))


def _merge(refusals: list[_Refusal]) -> _Refusal:
    """The refusals of every alternative as one: keys missing from objects first (with every
    key any alternative has), else the first reason."""
    missing = [r for r in refusals if r.reason.startswith("has no ")]
    if missing:
        keys: list[str] = []
        for refusal in missing:
            keys.extend(k for k in refusal.keys if k not in keys)
        return _Refusal(missing[0].reason, tuple(keys))
    return refusals[0]


def _size(shape: Shape) -> int:
    if isinstance(shape, Either):
        return 1 + sum(_size(o) for o in shape.options)
    if isinstance(shape, Both):
        return 1 + sum(_size(p) for p in shape.parts)
    return 1


def output_problem(
    shape: Shape, tail: Sequence[str], owner: str, describe: Callable[[int], str]
) -> str | None:
    """Why no output of ``shape`` can have the path ``tail`` (the segments after ``.output``),
    or None when one may. ``owner`` names the output in the message (``recipe step 'classify''s
    output_schema``); ``describe(n)`` names where the first ``n`` segments lead
    (``output.meta``)."""
    current: Shape = shape
    for position, segment in enumerate(tail):
        budget = [MAX_SHAPE_NODES]
        found = _member(current, segment, budget)
        if isinstance(found, _Refusal):
            where = "" if position == 0 else f" at {describe(position)}"
            has = f" (it has: {', '.join(found.keys)})" if found.keys else ""
            if found.keys == () and found.reason.startswith("has no "):
                has = " (it has none)"
            return f"{owner}{where} {found.reason}{has}"
        if isinstance(found, Unknown) or budget[0] < 0 or _size(found) > MAX_SHAPE_NODES:
            return None
        current = found
    return None
