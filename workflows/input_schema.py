"""Checking run input against a version's ``input_schema`` (contract sections 4 and 9).

Two bounds on what a schema may make the server do:

* Its ``pattern``s and ``patternProperties`` run on RE2 (``workflows.regex``), in time linear
  in the input, wherever jsonschema would match them (``additionalProperties`` and
  ``unevaluatedProperties`` too); a pattern RE2 cannot compile is refused at save.
* Its ``format: "regex"`` values are judged by RE2 too (:data:`FORMAT_CHECKER`), in every
  validator here: run inputs (``POST /runs``, a subworkflow's start, a schedule), a recipe's
  ``output_schema`` against a model's reply, and the schemas themselves at save. jsonschema's
  own checker compiles them with Python's ``re``: about 6 ms for one case-insensitive class,
  a RecursionError for deep nesting. A value RE2 refuses is invalid, with RE2's reason.
* Its ``$ref``s are local (``#...``). At save any other ``$ref`` is refused; at validation the
  registry retrieves nothing, so even a document stored before that rule cannot make the
  server fetch a URL: such a reference is unresolvable, never fetched.

Pure Python, no Django.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import FormatError, SchemaError, ValidationError
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable

from .regex import compile_linear, linear_pattern_cost, linear_pattern_error
from .templates import join_location

__all__ = [
    "FORMAT_CHECKER",
    "input_validator",
    "remote_refs",
    "schema_errors",
    "schema_format_checker",
    "write_only_values",
]

_REF_KEYWORDS = frozenset({"$ref", "$dynamicRef"})
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAMED_SUBSCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _refuse_remote(uri: str) -> Resource[Any]:
    """Retrieval for the registry: nothing outside the schema itself is ever fetched."""
    raise NoSuchResource(ref=uri)


_LOCAL_ONLY: Registry[Any] = Registry(retrieve=_refuse_remote)


def _search(pattern: str, text: str) -> bool:
    compiled = compile_linear(pattern)
    # A pattern RE2 cannot run was refused at save; an older stored one matches nothing.
    return compiled is not None and compiled.search(text) is not None


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """jsonschema's own, with ``patternProperties`` matched on RE2."""
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [
        key
        for key in instance
        if key not in properties and not any(_search(pattern, key) for pattern in patterns)
    ]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif additional is False and extras:
        unexpected = ", ".join(repr(extra) for extra in sorted(extras))
        yield ValidationError(f"Additional properties are not allowed ({unexpected} unexpected)")


def _unevaluated_properties(
    validator: Any, unevaluated: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """jsonschema's own, with the keys ``patternProperties`` evaluates matched on RE2."""
    if not validator.is_type(instance, "object"):
        return
    evaluated = set(_evaluated_keys(validator, instance, schema))
    invalid = [
        key
        for key in instance
        if key not in evaluated
        and next(validator.descend(instance[key], unevaluated, path=key, schema_path=key), None)
        is not None
    ]
    if not invalid:
        return
    # jsonschema's own messages, word for word.
    verb = "was" if len(invalid) == 1 else "were"
    if unevaluated is False:
        shown = ", ".join(repr(key) for key in sorted(invalid, key=str))
        yield ValidationError(f"Unevaluated properties are not allowed ({shown} {verb} unexpected)")
    else:
        shown = ", ".join(repr(key) for key in invalid)
        yield ValidationError(
            f"Unevaluated properties are not valid under the given schema ({shown} {verb} "
            "unevaluated and invalid)"
        )


def _valid(errors: Iterator[ValidationError]) -> bool:
    return next(errors, None) is None


def _evaluated_keys(validator: Any, instance: Any, schema: Any) -> list[str]:
    """The keys of ``instance`` that ``schema`` evaluates: jsonschema's
    ``find_evaluated_property_keys_by_schema``, whose ``patternProperties`` ran on Python's
    backtracking ``re`` (a ReDoS in an input_schema that only ``unevaluatedProperties`` saw)."""
    if validator.is_type(schema, "boolean"):
        return []
    found: list[str] = []
    for keyword in ("$ref", "$dynamicRef"):
        ref = schema.get(keyword)
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            inner = validator.evolve(schema=resolved.contents, _resolver=resolved.resolver)
            found += _evaluated_keys(inner, instance, resolved.contents)
    properties = schema.get("properties")
    if validator.is_type(properties, "object"):
        found += properties.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        subschema = schema.get(keyword)
        if subschema is not None:
            found += (
                key
                for key, value in instance.items()
                if _valid(validator.descend(value, subschema))
            )
    for pattern in schema.get("patternProperties", {}):
        found += (key for key in instance if _search(pattern, key))
    for name, subschema in schema.get("dependentSchemas", {}).items():
        if name in instance:
            found += _evaluated_keys(validator, instance, subschema)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _valid(validator.descend(instance, subschema)):
                found += _evaluated_keys(validator, instance, subschema)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            found += _evaluated_keys(validator, instance, schema["if"])
            if "then" in schema:
                found += _evaluated_keys(validator, instance, schema["then"])
        elif "else" in schema:
            found += _evaluated_keys(validator, instance, schema["else"])
    return found


class NotLinearRegex(ValueError):
    """A ``format: "regex"`` value RE2 cannot compile; its message says why."""


def _is_linear_regex(instance: object) -> bool:
    if isinstance(instance, str):
        reason = linear_pattern_error(instance)
        if reason is not None:
            raise NotLinearRegex(reason)
    return True


def _linear_format_checker() -> FormatChecker:
    checker = FormatChecker()
    checker.checkers = dict(Draft202012Validator.FORMAT_CHECKER.checkers)
    checker.checkers["regex"] = (_is_linear_regex, (NotLinearRegex,))
    return checker


# jsonschema's formats with ``regex`` judged by RE2 (``workflows.regex``): the only format
# checker of the project. Every other format it checks costs time linear in the value.
FORMAT_CHECKER = _linear_format_checker()


def schema_format_checker() -> FormatChecker:
    """The format checker for ``check_schema``: ``format: regex`` (every ``pattern`` and
    ``patternProperties`` key) means a pattern RE2 can compile."""
    return FORMAT_CHECKER


# What one validation (an input, a model's reply) judges of ``format: "regex"`` values: at
# most this many values, of at most this many characters and compiled program instructions in
# all. RE2 takes 7 to 35 us a value, most of it fixed cost, and up to 3 us a character of wide
# case-insensitive classes (measured here, under load): a 1 MiB body holds 100,000 short
# values (2.8 s of a web worker with no bound) or one 1 MiB pattern (about a second). Neither
# count bounds compile work: a counted repetition of a wide class, ``[\pL\pN]{63}``, is 45
# characters and 84,550 instructions (about 30 ms; a thousand of them, 30 s). So the
# instructions RE2 built are counted too (``workflows.regex.linear_pattern_cost``: a program
# refused as too large counts ``TOO_LARGE_COST``), 0.3 us each at worst here (1.2 us under
# load), so 1 Mi of them is 0.3 to 1.3 s; a thousand short patterns use under 100,000. Past
# any bound, a value is refused unjudged, naming its field; the instruction bound is checked
# before each compile, so the one value that crosses it (at most ``MAX_MEM``) is judged.
MAX_REGEX_VALUES = 1000
MAX_REGEX_CHARS = 65_536
MAX_REGEX_PROGRAM = 1024 * 1024


class _Budgeted(FormatChecker):
    """:data:`FORMAT_CHECKER` with what it may still judge of regex values: one per
    validator, so a validation compiles at most :data:`MAX_REGEX_VALUES` values of
    :data:`MAX_REGEX_CHARS` characters and about :data:`MAX_REGEX_PROGRAM` instructions in
    all."""

    def __init__(self) -> None:
        super().__init__()
        self.checkers = FORMAT_CHECKER.checkers
        self.values_left = MAX_REGEX_VALUES
        self.chars_left = MAX_REGEX_CHARS
        self.program_left = MAX_REGEX_PROGRAM


def _regex_problem(checker: Any, pattern: str) -> str | None:
    if not isinstance(checker, _Budgeted):
        return linear_pattern_error(pattern)
    if checker.values_left <= 0 or len(pattern) > checker.chars_left or checker.program_left <= 0:
        return (
            f"a value is checked for at most {MAX_REGEX_VALUES} regular expressions "
            f"(format: regex) of {MAX_REGEX_CHARS} characters in all (and {MAX_REGEX_PROGRAM} "
            "compiled instructions), and this one is past that"
        )
    checker.values_left -= 1
    checker.chars_left -= len(pattern)
    reason, cost = linear_pattern_cost(pattern)
    checker.program_left -= cost
    return reason


def _format(
    validator: Any, format: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """jsonschema's ``format``, with a message that quotes at most 80 characters of the value
    and says why: its own repeats the whole value (a 1 MiB one, several times escaped).
    ``regex`` is judged here, raising nothing: 100,000 refusals through jsonschema's
    exceptions (each a FormatError holding a traceback) took 18 s."""
    checker = validator.format_checker
    if checker is None:
        return
    if format == "regex":
        reason = _regex_problem(checker, instance) if isinstance(instance, str) else None
        if reason is not None:
            yield ValidationError(f"{shown_value(instance)} is not a 'regex': {reason}")
        return
    try:
        checker.check(instance, format)
    except FormatError:
        yield ValidationError(f"{shown_value(instance)} is not a {format!r}")


def shown_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_LinearValidator = validators.extend(
    Draft202012Validator,
    {
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
        "unevaluatedProperties": _unevaluated_properties,
        "format": _format,
    },
)


def input_validator(schema: Any) -> Any:
    """A Draft 2020-12 validator for ``schema`` with RE2 patterns and ``format: regex``, and
    local references only."""
    return _LinearValidator(schema, registry=_LOCAL_ONLY, format_checker=_Budgeted())


def remote_refs(schema: Any, where: list[str | int]) -> Iterator[tuple[list[str | int], str]]:
    """Every ``$ref``/``$dynamicRef`` in ``schema`` that is not local (does not start with
    ``#``), as ``(path to it, value)``; nested anywhere in subschemas. Values that are data, not
    schemas (``const``, ``enum``, ``default``, ``examples``) are not searched, and the names in
    ``properties`` and the like are names, not keywords. Iterative, so depth cannot exhaust the
    stack."""
    # (path, node, whether node maps names to subschemas)
    stack: list[tuple[list[str | int], Any, bool]] = [(where, schema, False)]
    while stack:
        path, node, named = stack.pop()
        if isinstance(node, list):
            stack.extend(([*path, index], item, False) for index, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if named:
                stack.append(([*path, key], value, False))
            elif key in _REF_KEYWORDS:
                if not (isinstance(value, str) and value.startswith("#")):
                    yield [*path, key], value
            elif key not in _DATA_KEYWORDS:
                stack.append(([*path, key], value, key in _NAMED_SUBSCHEMAS))


def schema_errors(schema: Any, where: str) -> list[tuple[str, str]]:
    """What makes ``schema`` unusable as a saved schema (``input_schema``, a recipe's
    ``output_schema``), as ``(field, message)`` with fields under ``where``: not valid Draft
    2020-12 (its patterns compiled by RE2), or a ``$ref`` that is not local."""
    errors: list[tuple[str, str]] = []
    try:
        Draft202012Validator.check_schema(schema, format_checker=schema_format_checker())
    except SchemaError as exc:
        message = exc.message
        if exc.validator == "format" and exc.validator_value == "regex":
            message = f"{exc.instance!r} is not a regular expression: "
            message += linear_pattern_error(exc.instance) or "invalid"
        errors.append(
            (_located(where, list(exc.absolute_path)), f"is not a valid JSON Schema: {message}")
        )
    for path, message in [*cost_problems(schema), *write_only_problems(schema)]:
        errors.append((_located(where, path), message))
    for path, ref in remote_refs(schema, []):
        shown = json.dumps(ref, ensure_ascii=False)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        errors.append(
            (
                _located(where, path),
                f"{shown} is not a local reference: only $refs starting with # are allowed "
                "(the server fetches nothing)",
            )
        )
    return errors


def _located(where: str, path: list[Any]) -> str:
    out = where
    for part in path:
        out = join_location(out, f"[{part}]" if isinstance(part, int) else str(part))
    return out


# --- secrets: the fields a schema marks ``"writeOnly": true`` (contract section 8) -----------

_WRITE_ONLY = "writeOnly"


def _write_only(
    validator: Any, value: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    # Not a failure: a marker whose ``absolute_path`` is where the secret sits in the input.
    if value is True:
        yield ValidationError("write-only")


def _markers_only(errors: Iterator[ValidationError]) -> list[ValidationError] | None:
    """The markers among ``errors``, or None when any real failure is among them."""
    found = []
    for error in errors:
        if error.validator != _WRITE_ONLY:
            return None
        found.append(error)
    return found


def _branches(
    validator: Any, subschemas: list[Any], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """``anyOf``/``oneOf``: the markers of every branch the instance satisfies. jsonschema's
    own stop at the first branch without errors, and a marker would count as one."""
    for index, subschema in enumerate(subschemas):
        try:
            markers = _markers_only(validator.descend(instance, subschema, schema_path=index))
        except Unresolvable:
            continue  # a branch whose reference does not resolve holds for nothing
        if markers:
            yield from markers


def _if(
    validator: Any, if_schema: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    holds = _markers_only(validator.evolve(schema=if_schema).iter_errors(instance)) is not None
    branch = "then" if holds else "else"
    if branch in schema:
        yield from validator.descend(instance, schema[branch], schema_path=branch)


def _ignore(
    validator: Any, value: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    return iter(())


_SecretFinder = validators.extend(
    _LinearValidator,
    {_WRITE_ONLY: _write_only, "anyOf": _branches, "oneOf": _branches, "if": _if, "not": _ignore},
)


def mentions_write_only(schema: Any) -> bool:
    """Does ``schema`` mark anything in it ``"writeOnly": true``?"""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get(_WRITE_ONLY) is True:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def write_only_values(schema: Any, instance: Any) -> list[tuple[list[str | int], Any]]:
    """``(path, value)`` of every part of ``instance`` that ``schema`` marks
    ``"writeOnly": true``, wherever the schema applies it: nested ``properties``, ``items``,
    ``additionalProperties``, ``patternProperties``, local ``$ref``s, ``allOf``, and every
    branch of ``anyOf``/``oneOf`` the instance satisfies (more masked rather than less).

    It runs the schema over the instance, with ``writeOnly`` as a keyword that reports where it
    applies, so a secret is found exactly where validation would look. Only meaningful for an
    instance that is valid; a schema without ``writeOnly`` costs one walk of the schema.
    """
    if not mentions_write_only(schema):
        return []
    finder = _SecretFinder(schema, registry=_LOCAL_ONLY, format_checker=_Budgeted())
    found: dict[tuple[str | int, ...], Any] = {}
    for error in finder.iter_errors(instance):
        if error.validator == _WRITE_ONLY:
            found.setdefault(tuple(error.absolute_path), error.instance)
    return [(list(path), value) for path, value in found.items()]


# --- what one check of a value may cost (contract section 9) ----------------------------------

# Keywords whose subschemas apply to the same value as their schema: evaluating a schema
# evaluates these too, at the same place of the input. (Those that descend into the value's
# members, properties, items and the like, are paid for by the value's size.)
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_ONE = ("not", "if", "then", "else")
# The most subschemas one check of a value at one place may evaluate, every $ref followed as
# often as it is used. Schemas people write stay under a few dozen; a chain of allOf's naming
# one $ref twice doubles at each link (30 links: 2**30 evaluations a value, hours of a worker;
# security review of the start page, issue 37).
MAX_IN_PLACE_EVALUATIONS = 1000


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/a/b`` or ``#anchor``) names in ``root``, or
    None when it names none (validation reports that)."""
    from urllib.parse import unquote

    fragment = unquote(ref[1:])
    if not fragment.startswith("/"):
        return _anchor(root, fragment) if fragment else root
    node = root
    for raw in fragment.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _anchor(root: Any, name: str) -> Any:
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if name in (node.get("$anchor"), node.get("$dynamicAnchor")):
                return node
            stack.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _in_place(root: Any, node: Any) -> list[Any]:
    """The subschemas of ``node`` that apply where it applies (see above)."""
    if not isinstance(node, dict):
        return []
    found: list[Any] = []
    for key in _IN_PLACE_LISTS:
        if isinstance(node.get(key), list):
            found.extend(node[key])
    found.extend(node[key] for key in _IN_PLACE_ONE if key in node)
    if isinstance(node.get("dependentSchemas"), dict):
        found.extend(node["dependentSchemas"].values())
    for key in _REF_KEYWORDS:
        ref = node.get(key)
        if isinstance(ref, str) and ref.startswith("#"):
            target = _pointer(root, ref)
            if target is not None:
                found.append(target)
    return [child for child in found if isinstance(child, dict)]


def _schemas(
    schema: Any,
) -> Iterator[tuple[list[str | int], dict[str, Any], frozenset[str]]]:
    """Every subschema of ``schema`` (objects only), with its path and the keywords it sits
    under (names of properties and the like left out); iterative."""
    stack: list[tuple[list[str | int], Any, bool, frozenset[str]]] = [
        ([], schema, False, frozenset())
    ]
    while stack:
        path, node, named, under = stack.pop()
        if isinstance(node, list):
            stack.extend(([*path, index], item, False, under) for index, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if not named:
            yield path, node, under
        for key, value in node.items():
            if named:
                stack.append(([*path, key], value, False, under))
            elif key not in _DATA_KEYWORDS:
                stack.append(([*path, key], value, key in _NAMED_SUBSCHEMAS, under | {key}))


# Where a ``writeOnly`` mark cannot be honoured: the value it would mark is found by a
# keyword that reports no place for it (a secret there would be stored in the clear).
_NO_SECRETS_UNDER = frozenset(
    {"contains", "unevaluatedProperties", "unevaluatedItems", "not", "propertyNames"}
)


def write_only_problems(schema: Any) -> list[tuple[list[str | int], str]]:
    """``writeOnly`` marks under keywords the secret finder cannot follow (see above)."""
    return [
        (
            [*path, _WRITE_ONLY],
            f"writeOnly is not honoured under {', '.join(sorted(under & _NO_SECRETS_UNDER))}: "
            "mark the property that holds the secret (under properties, items ...)",
        )
        for path, node, under in _schemas(schema)
        if node.get(_WRITE_ONLY) is True and under & _NO_SECRETS_UNDER
    ]


def cost_problems(schema: Any) -> list[tuple[list[str | int], str]]:
    """Where checking a value against ``schema`` would never end or cost too much:
    ``$ref``s that lead back to where they started without descending into the value (a
    RecursionError at every check), and subschemas whose check at one place evaluates more
    than MAX_IN_PLACE_EVALUATIONS subschemas. Linear in the schema's size: each subschema's
    count is computed once (iteratively, so a long chain cannot exhaust the stack)."""
    cost: dict[int, int] = {}
    problems: list[tuple[list[str | int], str]] = []
    for path, start, _ in _schemas(schema):
        if id(start) in cost:
            continue
        # Depth-first, children before parents; ``open_`` holds the nodes being counted.
        open_: set[int] = set()
        stack: list[tuple[dict[str, Any], bool]] = [(start, False)]
        cycle = False
        while stack and not cycle:
            node, counted_children = stack.pop()
            key = id(node)
            if counted_children:
                open_.discard(key)
                total = 1 + sum(cost[id(child)] for child in _in_place(schema, node))
                cost[key] = min(total, MAX_IN_PLACE_EVALUATIONS + 1)
                continue
            if key in cost:
                continue
            if key in open_:
                cycle = True
                break
            open_.add(key)
            stack.append((node, True))
            for child in _in_place(schema, node):
                if id(child) in open_:
                    cycle = True
                    break
                if id(child) not in cost:
                    stack.append((child, False))
        if cycle:
            problems.append(
                (
                    path,
                    "its $refs lead back to it without descending into the value: "
                    "checking a value would never end",
                )
            )
            return problems
        if cost[id(start)] > MAX_IN_PLACE_EVALUATIONS:
            problems.append(
                (
                    path,
                    f"checking one value against it evaluates more than "
                    f"{MAX_IN_PLACE_EVALUATIONS} subschemas (allOf, anyOf, oneOf, $ref ... "
                    "in place): simplify it",
                )
            )
            return problems
    return problems
