"""Guards: evaluation, structural errors and paths (contract section 3)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workflows.guards import (
    MAX_DEPTH,
    OPS,
    compile_pattern,
    evaluate,
    guard_errors,
    guard_paths,
    json_equal,
    pattern_error,
)

CONTEXT: dict[str, Any] = {
    "input": {
        "n": 5,
        "f": 2.5,
        "s": "beta",
        "t": True,
        "none": None,
        "list": [1, "two", None],
        "obj": {"a": 1},
        "email": "ada@example.com",
    },
    "steps": {
        "classify": {"output": {"kind": "bug"}, "status": "succeeded", "error": None},
        "send": {
            "output": None,
            "status": "failed",
            "error": {"class": "retryable", "message": "relay busy"},
        },
    },
    "run": {"id": "run_1", "correlation": None},
    "item": {"qty": 3},
    "index": 0,
    "iter": {"index": 2, "previous": {"done": False}},
}


def g(path: str, op: str, *value: Any) -> dict[str, Any]:
    """A comparison guard; ``value`` omitted when not given."""
    guard: dict[str, Any] = {"path": path, "op": op}
    if value:
        (guard["value"],) = value
    return guard


TRUE = g("input.n", "eq", 5)
FALSE = g("input.n", "eq", 6)

# --- every op, true and false ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        # eq / ne: JSON equality
        (g("input.n", "eq", 5), True),
        (g("input.n", "eq", 5.0), True),
        (g("input.n", "eq", "5"), False),
        (g("input.t", "eq", True), True),
        (g("input.t", "eq", 1), False),
        (g("input.n", "eq", True), False),
        (g("input.none", "eq", None), True),
        (g("input.none", "eq", False), False),
        (g("input.list", "eq", [1, "two", None]), True),
        (g("input.list", "eq", [True, "two", None]), False),
        (g("input.obj", "eq", {"a": 1.0}), True),
        (g("input.obj", "eq", {"a": True}), False),
        (g("input.obj", "eq", {"a": 1, "b": 2}), False),
        (g("steps.classify.output.kind", "eq", "bug"), True),
        (g("steps.classify.status", "eq", "succeeded"), True),
        (g("steps.send.status", "eq", "failed"), True),
        (g("steps.send.error.class", "eq", "retryable"), True),
        (g("run.id", "eq", "run_1"), True),
        (g("run.correlation", "eq", None), True),
        (g("item.qty", "eq", 3), True),
        (g("index", "eq", 0), True),
        (g("iter.index", "eq", 2), True),
        (g("iter.previous.done", "eq", False), True),
        (g("input.n", "ne", 6), True),
        (g("input.n", "ne", 5), False),
        (g("input.t", "ne", 1), True),
        (g("input.none", "ne", None), False),
        # ordering: numbers with numbers, strings with strings
        (g("input.n", "lt", 6), True),
        (g("input.n", "lt", 5), False),
        (g("input.n", "lte", 5), True),
        (g("input.n", "lte", 4.9), False),
        (g("input.n", "gt", 4.5), True),
        (g("input.n", "gt", 5), False),
        (g("input.n", "gte", 5.0), True),
        (g("input.n", "gte", 6), False),
        (g("input.f", "gt", 2), True),
        (g("input.s", "lt", "gamma"), True),
        (g("input.s", "lt", "alpha"), False),
        (g("input.s", "gte", "beta"), True),
        (g("input.s", "gt", "beta"), False),
        # in: element of an array, or substring of a string
        (g("input.n", "in", [1, 5, 9]), True),
        (g("input.n", "in", [5.0]), True),
        (g("input.n", "in", [1, 2]), False),
        (g("input.t", "in", [1]), False),
        (g("input.none", "in", [None]), True),
        (g("input.obj", "in", [{"a": 1}]), True),
        (g("input.s", "in", "alphabetagamma"), True),
        (g("input.s", "in", "alpha"), False),
        (g("input.n", "in", "12345"), False),  # substring needs a string actual
        (g("input.s", "in", []), False),
        # matches: re.search on a string
        (g("input.email", "matches", r"@example\.com$"), True),
        (g("input.email", "matches", "example"), True),  # search, not fullmatch
        (g("input.email", "matches", r"^bob@"), False),
        (g("input.n", "matches", "5"), False),  # non-string actual
        (g("input.none", "matches", ".*"), False),
        # exists: present, even when null
        (g("input.n", "exists"), True),
        (g("input.none", "exists"), True),
        (g("steps.send.output", "exists"), True),
        (g("input.absent", "exists"), False),
        (g("steps.later.output", "exists"), False),
    ],
)
def test_ops(guard: dict[str, Any], expected: bool) -> None:
    assert guard_errors(guard) == []
    assert evaluate(guard, CONTEXT) is expected


@pytest.mark.parametrize(
    "guard",
    [
        g("input.n", "lt", "6"),
        g("input.s", "gt", 1),
        g("input.t", "gt", 0),  # booleans are not numbers
        g("input.t", "gte", 1),
        g("input.none", "lt", 1),
        g("input.list", "lt", 1),
        g("input.obj", "gte", "a"),
        g("input.n", "lte", "5"),
    ],
)
def test_ordering_type_mismatch_is_false(guard: dict[str, Any]) -> None:
    assert evaluate(guard, CONTEXT) is False
    assert evaluate({"not": guard}, CONTEXT) is True


VALUES_FOR_OP: dict[str, Any] = {
    "eq": 1,
    "ne": 1,
    "lt": 1,
    "lte": 1,
    "gt": 1,
    "gte": 1,
    "in": [None, 1],
    "matches": ".*",
}


@pytest.mark.parametrize(
    "path", ["input.absent", "steps.later.status", "input.n.x", "input.list.3"]
)
@pytest.mark.parametrize("op", sorted(OPS))
def test_missing_path_is_false_for_every_op(path: str, op: str) -> None:
    guard = g(path, op) if op == "exists" else g(path, op, VALUES_FOR_OP[op])
    assert guard_errors(guard) == []
    assert evaluate(guard, CONTEXT) is False
    # ``not`` only negates: a missing path under ``not`` is true.
    assert evaluate({"not": guard}, CONTEXT) is True


def test_missing_path_ne_null_is_false_but_present_null_is_not_missing() -> None:
    assert evaluate(g("input.absent", "ne", None), CONTEXT) is False
    assert evaluate(g("input.none", "ne", 1), CONTEXT) is True


# --- combinators --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        ({"all": [TRUE]}, True),
        ({"all": [TRUE, TRUE]}, True),
        ({"all": [TRUE, FALSE]}, False),
        ({"any": [FALSE, TRUE]}, True),
        ({"any": [FALSE, FALSE]}, False),
        ({"not": TRUE}, False),
        ({"not": FALSE}, True),
        ({"not": {"not": TRUE}}, True),
        ({"all": [TRUE, {"any": [FALSE, {"not": FALSE}]}]}, True),
        ({"any": [{"all": [TRUE, FALSE]}, {"not": {"any": [TRUE]}}]}, False),
        (
            {
                "all": [
                    g("steps.send.status", "eq", "failed"),
                    {"not": g("steps.send.error.class", "in", ["fatal", "invalid_input"])},
                ]
            },
            True,
        ),
    ],
)
def test_combinators(guard: dict[str, Any], expected: bool) -> None:
    assert guard_errors(guard) == []
    assert evaluate(guard, CONTEXT) is expected


# --- structural errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "locations"),
    [
        ("steps.a.status", [""]),
        (None, [""]),
        ([TRUE], [""]),
        ({}, [""]),
        ({"pth": "input.n", "op": "eq", "value": 5}, ["pth", "path"]),
        ({"path": "input.n", "op": "eq", "value": 5, "note": "x"}, ["note"]),
        ({"alll": [TRUE]}, ["alll", ""]),
        ({"path": "input.n", "op": "eq", "value": 5, "all": [TRUE]}, [""]),
        ({"all": [TRUE], "any": [TRUE]}, [""]),
        ({"not": TRUE, "op": "exists"}, [""]),
        (g("input.n", "equals", 5), ["op"]),
        (g("input.n", "EQ", 5), ["op"]),
        ({"path": "input.n", "op": 1, "value": 5}, ["op"]),
        ({"path": "input.n", "value": 5}, ["op"]),
        ({"op": "exists"}, ["path"]),
        (g("input.n", "eq"), ["value"]),
        (g("input.n", "in"), ["value"]),
        (g("input.n", "matches"), ["value"]),
        (g("input.n", "exists", True), ["value"]),
        (g("input.n", "exists", None), ["value"]),
        (g("input.n", "in", 5), ["value"]),
        (g("input.n", "in", {"a": 1}), ["value"]),
        (g("input.n", "in", None), ["value"]),
        (g("input.s", "matches", 5), ["value"]),
        (g("input.s", "matches", ["a"]), ["value"]),
        (g("input.s", "matches", "(unclosed"), ["value"]),
        (g("input.s", "matches", "a{2,1}"), ["value"]),
        (g("input.s", "matches", "*"), ["value"]),
        (g("input.n", "gt", [1]), ["value"]),
        (g("input.n", "gt", None), ["value"]),
        (g("input.n", "lt", True), ["value"]),
        ({"all": []}, ["all"]),
        ({"any": []}, ["any"]),
        ({"all": TRUE}, ["all"]),
        ({"any": "x"}, ["any"]),
        ({"not": []}, ["not"]),
        ({"not": None}, ["not"]),
        (g("", "exists"), ["path"]),
        (g(5, "exists"), ["path"]),  # type: ignore[arg-type]
        (g(None, "exists"), ["path"]),  # type: ignore[arg-type]
        (g("${input.n}", "exists"), ["path"]),
        (g("input..n", "exists"), ["path"]),
        (g("input.", "exists"), ["path"]),
        ({"all": [TRUE, g("input.n", "eq")]}, ["all[1].value"]),
        (
            {"any": [TRUE, {"not": {"path": "input.n", "op": "near", "value": 1}}]},
            ["any[1].not.op"],
        ),
        ({"all": [{"pth": "x", "op": "exists"}]}, ["all[0].pth", "all[0].path"]),
        ({"all": [FALSE, {"any": []}, "x"]}, ["all[1].any", "all[2]"]),
    ],
)
def test_guard_errors(guard: Any, locations: list[str]) -> None:
    errors = guard_errors(guard)
    assert [location for location, _ in errors] == locations
    assert all(message for _, message in errors)
    # A malformed guard is false as a whole, even under ``not``, and whatever its parts say.
    assert evaluate(guard, CONTEXT) is False


def test_unknown_field_suggests_the_intended_one() -> None:
    [(location, message), *_] = guard_errors({"pth": "input.n", "op": "exists"})
    assert location == "pth"
    assert "'path'" in message


def test_error_messages_name_the_problem() -> None:
    assert "takes no 'value'" in guard_errors(g("input.n", "exists", 1))[0][1]
    assert "invalid regular expression" in guard_errors(g("input.s", "matches", "("))[0][1]
    assert "unknown op 'near'" in guard_errors(g("input.s", "near", 1))[0][1]
    assert "empty" in guard_errors({"any": []})[0][1]
    assert "required field 'value'" in guard_errors(g("input.n", "eq"))[0][1]
    assert "required field 'path'" in guard_errors({"op": "exists"})[0][1]


def test_a_broken_branch_makes_the_whole_guard_false() -> None:
    # ``any`` would be true through its first branch; the second is misspelt.
    guard = {"any": [TRUE, {"pth": "input.n", "op": "exists"}]}
    assert guard_errors(guard)
    assert evaluate(guard, CONTEXT) is False
    assert evaluate({"not": {"path": "input.n", "op": "eq"}}, CONTEXT) is False


def test_nesting_deeper_than_max_depth_is_an_error() -> None:
    ok: Any = TRUE
    for _ in range(MAX_DEPTH):
        ok = {"all": [ok]}
    assert guard_errors(ok) == []
    assert evaluate(ok, CONTEXT) is True

    deep: Any = TRUE
    for _ in range(10_000):
        deep = {"not": deep}
    errors = guard_errors(deep)
    assert len(errors) == 1
    assert "deeper" in errors[0][1]
    assert evaluate(deep, CONTEXT) is False
    assert guard_paths(deep) == []


def test_regex_helpers() -> None:
    assert pattern_error("^a+$") is None
    assert pattern_error("(") is not None
    pattern = compile_pattern("^a+$")
    assert pattern is not None and pattern.search("aaa")
    assert compile_pattern("(") is None


def test_matches_runs_in_linear_time() -> None:
    # On Python's backtracking ``re`` this search doubles with each "a": 0.4 s at 24, hours at 40.
    guard = {"path": "input.s", "op": "matches", "value": "^(a+)+$"}
    started = time.monotonic()
    assert evaluate(guard, {"input": {"s": "a" * 40 + "!"}}) is False
    assert time.monotonic() - started < 1.0
    assert evaluate(guard, {"input": {"s": "a" * 40}}) is True


@pytest.mark.parametrize("pattern", [r"(a)\1", "(?=a)a", "(?<!a)b"])
def test_patterns_re2_cannot_run_are_refused(pattern: str) -> None:
    assert "RE2" in (pattern_error(pattern) or "")
    assert compile_pattern(pattern) is None
    guard = {"path": "input.s", "op": "matches", "value": pattern}
    assert [location for location, _ in guard_errors(guard)] == ["value"]
    assert evaluate(guard, {"input": {"s": "aa"}}) is False


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (1, 1.0, True),
        (True, 1, False),
        (0, False, False),
        ([1, [True]], [1.0, [True]], True),
        ([1, [True]], [1, [1]], False),
        ({"a": None}, {"a": None}, True),
        ({"a": None}, {"b": None}, False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ([], {}, False),
        ("1", 1, False),
        (None, 0, False),
        ([1, 2], [2, 1], False),
    ],
)
def test_json_equal(a: Any, b: Any, equal: bool) -> None:
    assert json_equal(a, b) is equal
    assert json_equal(b, a) is equal


# --- guard_paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        (
            {"all": [{"path": "steps.a.status", "op": "exists"}]},
            [("all[0].path", "steps.a.status")],
        ),
        (g("input.n", "eq", 1), [("path", "input.n")]),
        (
            {"any": [TRUE, {"not": g("steps.b.output.x", "exists")}], "all": [FALSE]},
            [
                ("all[0].path", "input.n"),
                ("any[0].path", "input.n"),
                ("any[1].not.path", "steps.b.output.x"),
            ],
        ),
        ({"all": [{"path": 5, "op": "exists"}]}, []),
        ("x", []),
        ({"not": {"not": {"path": "", "op": "exists"}}}, [("not.not.path", "")]),
    ],
)
def test_guard_paths(guard: Any, expected: list[tuple[str, str]]) -> None:
    assert guard_paths(guard) == expected


# --- properties ---------------------------------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None)

json_leaves = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
segments = st.sampled_from(["input", "steps", "run", "item", "index", "iter", "a", "0", "1"])
guard_paths_text = st.lists(segments, min_size=1, max_size=4).map(".".join) | st.text(max_size=12)
ops = st.sampled_from(sorted(OPS)) | st.text(max_size=6)
regexes = st.sampled_from(["a", "^a+$", "(", "[", "a{2,1}", ".*", r"\d+", "(?P<x>a)"])
leaf_guards = st.fixed_dictionaries(
    {"path": guard_paths_text | json_leaves, "op": ops},
    optional={"value": json_values | regexes | st.lists(json_leaves, max_size=3)},
)
guards = st.recursive(
    leaf_guards | json_values,
    lambda children: (
        st.fixed_dictionaries({"all": st.lists(children, max_size=3)})
        | st.fixed_dictionaries({"any": st.lists(children, max_size=3)})
        | st.fixed_dictionaries({"not": children})
        | st.dictionaries(
            st.sampled_from(["all", "any", "not", "path", "op", "value", "pth"]),
            children,
            max_size=3,
        )
    ),
    max_leaves=12,
)
contexts = st.fixed_dictionaries(
    {},
    optional={
        "input": json_values,
        "steps": st.dictionaries(
            st.sampled_from(["a", "b"]),
            st.fixed_dictionaries(
                {"output": json_values, "status": st.sampled_from(["succeeded", "failed"])}
            ),
        ),
        "run": json_values,
        "item": json_values,
        "index": st.integers(0, 3),
        "iter": json_values,
    },
)


@PROPERTY
@given(guard=json_values, context=json_values)
def test_evaluate_never_raises_on_arbitrary_json(guard: Any, context: Any) -> None:
    context = context if isinstance(context, dict) else {"input": context}
    assert evaluate(guard, context) in (True, False)
    guard_errors(guard)
    guard_paths(guard)


@PROPERTY
@given(guard=guards, context=contexts)
def test_evaluate_never_raises_on_guard_shaped_json(guard: Any, context: dict[str, Any]) -> None:
    result = evaluate(guard, context)
    assert result in (True, False)
    if guard_errors(guard):
        assert result is False
    else:
        assert evaluate({"not": guard}, context) is (not result)
    for location, path in guard_paths(guard):
        assert location.endswith("path")
        assert isinstance(path, str)
