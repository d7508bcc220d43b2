"""Templates: lookup, resolve, references and legacy translation (contract section 2)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workflows.templates import (
    MISSING,
    REFERENCE,
    ROOTS,
    is_single_reference,
    is_valid_path,
    join_location,
    lookup,
    lookup_or_missing,
    reference_errors,
    references,
    resolve,
    split_path,
    text_form,
    translate_legacy,
)

CONTEXT: dict[str, Any] = {
    "input": {"ticket": "Q: where is my order?", "count": 3, "tags": ["a", "b"], "none": None},
    "steps": {
        "classify": {
            "output": {"kind": "bug", "score": 0.5, "urgent": True, "meta": {"a": 1}},
            "status": "succeeded",
            "error": None,
        },
        "search": {
            "output": {"hits": [{"url": "https://a.example"}, {"url": "https://b.example"}]},
            "status": "succeeded",
            "error": None,
        },
        "flaky": {
            "output": None,
            "status": "failed",
            "error": {"class": "retryable", "message": "relay busy"},
        },
        "numbers": {"output": [10, 20, 30], "status": "succeeded", "error": None},
        "keyed": {"output": {"0": "zero", "": "empty"}, "status": "succeeded", "error": None},
    },
    "run": {"id": "run_123", "correlation": {"order": 42}},
    "item": {"sku": "X-1", "qty": 2},
    "index": 4,
    "iter": {"index": 1, "previous": {"draft": "v1"}},
}


def json_values(strings: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    """Arbitrary JSON whose strings come from ``strings``."""
    strings = st.text() if strings is None else strings
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | strings
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )


path_segments = st.sampled_from(sorted(ROOTS)) | st.text(max_size=6) | st.integers(0, 3).map(str)
paths = st.lists(path_segments, max_size=5).map(".".join) | st.text(max_size=20)
template_strings = st.one_of(
    st.text(max_size=20),
    paths.map(lambda p: "${" + p + "}"),
    st.tuples(st.text(max_size=8), paths, st.text(max_size=8)).map(
        lambda t: f"{t[0]}${{{t[1]}}}{t[2]}"
    ),
    st.lists(st.sampled_from(["$", "{", "}", "${", "$${", "{{", "}}", "input", ".", "x"])).map(
        "".join
    ),
)
contexts = st.fixed_dictionaries(
    {},
    optional={root: json_values() for root in sorted(ROOTS)},
)


# --- lookup -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("input", CONTEXT["input"]),
        ("input.ticket", "Q: where is my order?"),
        ("input.tags.1", "b"),
        ("steps.classify.output", CONTEXT["steps"]["classify"]["output"]),
        ("steps.classify.output.kind", "bug"),
        ("steps.classify.status", "succeeded"),
        ("steps.flaky.status", "failed"),
        ("steps.flaky.error", {"class": "retryable", "message": "relay busy"}),
        ("steps.flaky.error.class", "retryable"),
        ("steps.search.output.hits.0.url", "https://a.example"),
        ("steps.search.output.hits.1.url", "https://b.example"),
        ("steps.numbers.output.2", 30),
        ("steps.keyed.output.0", "zero"),
        ("run.id", "run_123"),
        ("run.correlation", {"order": 42}),
        ("run.correlation.order", 42),
        ("item", {"sku": "X-1", "qty": 2}),
        ("item.sku", "X-1"),
        ("index", 4),
        ("iter.index", 1),
        ("iter.previous", {"draft": "v1"}),
        ("iter.previous.draft", "v1"),
    ],
)
def test_lookup_reads_every_root(path: str, expected: Any) -> None:
    assert lookup(CONTEXT, path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "nope",
        "input.missing",
        "input.ticket.length",  # strings are not indexed
        "input.count.0",  # nor are numbers
        "input.none.x",  # nor is null
        "input.tags.2",  # out of range
        "input.tags.-1",  # no negative indexes
        "input.tags.01",  # no leading zeros
        "input.tags.1.0",
        "input.tags.x",
        "input.tags. 1",
        "input.tags.\uff19",  # a fullwidth digit is not an index
        "steps.search.output.hits." + "9" * 5000,
        "steps.nope.output",
        "steps.keyed.output.",  # an empty segment is malformed, even where "" is a key
        "",
        ".",
        "input.",
        ".input",
        "input..ticket",
        "${input.ticket}",
    ],
)
def test_lookup_missing_is_none(path: str) -> None:
    assert lookup(CONTEXT, path) is None
    assert lookup_or_missing(CONTEXT, path) is MISSING


def test_lookup_or_missing_tells_present_null_from_absent() -> None:
    assert lookup_or_missing(CONTEXT, "input.none") is None
    assert lookup_or_missing(CONTEXT, "steps.flaky.output") is None
    assert lookup_or_missing(CONTEXT, "input.absent") is MISSING


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a", ["a"]),
        ("steps.search.output.hits.0.url", ["steps", "search", "output", "hits", "0", "url"]),
        ("", []),
        ("a..b", []),
        (".a", []),
        ("a.", []),
    ],
)
def test_split_path(path: str, expected: list[str]) -> None:
    assert split_path(path) == expected
    assert is_valid_path(path) is bool(expected)


def test_roots() -> None:
    # "error": in on_failure steps only (checked at save, workflows.validation).
    assert frozenset({"input", "steps", "run", "item", "index", "iter", "error"}) == ROOTS


# --- resolve: a whole-string reference keeps its type ------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("${steps.classify.output}", CONTEXT["steps"]["classify"]["output"]),  # object
        ("${input.tags}", ["a", "b"]),  # list
        ("${input.count}", 3),  # int
        ("${steps.classify.output.score}", 0.5),  # float
        ("${steps.classify.output.urgent}", True),  # bool
        ("${input.none}", None),  # null
        ("${input.ticket}", "Q: where is my order?"),  # string
        ("${index}", 4),
        ("${iter.index}", 1),
        ("${ input.count }", 3),  # whitespace inside the braces
        ("${\tinput.count\n}", 3),
        ("${input.absent}", None),  # missing → null
        ("${steps.later.output}", None),
        ("${}", None),
        ("${input..x}", None),
    ],
)
def test_whole_string_reference_keeps_type(template: str, expected: Any) -> None:
    result = resolve(template, CONTEXT)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("ticket: ${input.ticket}", "ticket: Q: where is my order?"),
        ("n=${input.count}", "n=3"),
        ("s=${steps.classify.output.score}", "s=0.5"),
        ("u=${steps.classify.output.urgent}", "u=true"),
        ("f=${steps.flaky.error.class}!", "f=retryable!"),
        ("null=[${input.none}]", "null=[]"),
        ("missing=[${input.absent}]", "missing=[]"),
        ("meta=${steps.classify.output.meta}", 'meta={"a":1}'),
        ("tags=${input.tags}", 'tags=["a","b"]'),
        ("corr=${run.correlation}", 'corr={"order":42}'),
        ("${item.sku} x ${item.qty}", "X-1 x 2"),
        ("#${index}: ${iter.previous.draft}", "#4: v1"),
        ("${input.count}${input.count}", "33"),
        (" ${input.count}", " 3"),  # text around one reference makes it text
        ("no references", "no references"),
        ("unclosed ${input.count", "unclosed ${input.count"),
        ("brace ${a{b}}", "brace ${a{b}}"),
        ("nested ${${input.count}}", "nested ${3}"),
        ("cost: $5", "cost: $5"),
    ],
)
def test_text_interpolation(template: str, expected: str) -> None:
    assert resolve(template, CONTEXT) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("s", "s"),
        (None, ""),
        (True, "true"),
        (False, "false"),
        (3, "3"),
        (2.5, "2.5"),
        ({"a": 1, "b": [1, 2]}, '{"a":1,"b":[1,2]}'),
        ([], "[]"),
        ({"é": "ü"}, '{"é":"ü"}'),
    ],
)
def test_text_form(value: Any, text: str) -> None:
    assert text_form(value) == text


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("$${input.ticket}", "${input.ticket}"),
        ("literal $${ and ${input.count}", "literal ${ and 3"),
        ("${input.count} then $${input.count}", "3 then ${input.count}"),
        ("$$${input.count}", "$${input.count}"),  # a ${ after any $ is the escape
        ("price $${", "price ${"),
    ],
)
def test_escape(template: str, expected: str) -> None:
    assert resolve(template, CONTEXT) == expected


def test_escape_is_not_a_reference() -> None:
    assert references("$${input.x}") == []
    assert is_single_reference("$${input.x}") is None
    assert references("a $${b} ${input.x}") == [("", "input.x")]


def test_resolve_nested_templates() -> None:
    template = {
        "kind": "${steps.classify.output.kind}",
        "${input.ticket}": "keys are not templated",
        "hits": ["${steps.search.output.hits.0}", "url: ${steps.search.output.hits.1.url}"],
        "deep": {"list": [[{"n": "${input.count}"}]], "plain": 7, "flag": False, "nil": None},
    }
    assert resolve(template, CONTEXT) == {
        "kind": "bug",
        "${input.ticket}": "keys are not templated",
        "hits": [{"url": "https://a.example"}, "url: https://b.example"],
        "deep": {"list": [[{"n": 3}]], "plain": 7, "flag": False, "nil": None},
    }


def test_resolve_returns_new_values_and_mutates_nothing() -> None:
    context = copy.deepcopy(CONTEXT)
    template = {"out": "${steps.classify.output}", "list": ["${input.tags}"]}
    before = copy.deepcopy(template)
    result = resolve(template, context)
    result["out"]["kind"] = "changed"
    result["list"][0].append("c")
    assert context == CONTEXT
    assert template == before


def test_resolved_values_are_not_resolved_again() -> None:
    context = {"input": {"evil": "${run.id}", "obj": {"x": "${run.id}"}}, "run": {"id": "r"}}
    assert resolve("${input.evil}", context) == "${run.id}"
    assert resolve("say ${input.evil}", context) == "say ${run.id}"
    assert resolve("${input.obj}", context) == {"x": "${run.id}"}


def test_resolve_handles_very_deep_templates() -> None:
    template: Any = "${input.count}"
    for _ in range(5000):
        template = [template]
    result = resolve(template, CONTEXT)
    for _ in range(5000):
        result = result[0]
    assert result == 3
    assert len(references(template)) == 1


@pytest.mark.parametrize(
    ("s", "path"),
    [
        ("${input.x}", "input.x"),
        ("${ input.x }", "input.x"),
        ("${}", ""),
        (" ${input.x}", None),
        ("${input.x} ", None),
        ("${a}${b}", None),
        ("$${input.x}", None),
        ("x", None),
    ],
)
def test_is_single_reference(s: str, path: str | None) -> None:
    assert is_single_reference(s) == path


def test_reference_regex_captures_the_stripped_path() -> None:
    assert [m.group("path") for m in REFERENCE.finditer("${ a.b } ${c}")] == ["a.b", "c"]


# --- references ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ({"a": ["x ${input.x}"]}, [("a[0]", "input.x")]),
        ("${input}", [("", "input")]),
        (["${item}", "${index}"], [("[0]", "item"), ("[1]", "index")]),
        (
            {"a": {"b": "${steps.s.output} and ${ run.id }"}},
            [("a.b", "steps.s.output"), ("a.b", "run.id")],
        ),
        ({"x": [[{"y": "${iter.previous}"}]]}, [("x[0][0].y", "iter.previous")]),
        ({"${input.k}": 1, "n": 2, "t": True, "z": None}, []),
        ({"a": "${x}", "b": ["${y}"], "c": "${z}"}, [("a", "x"), ("b[0]", "y"), ("c", "z")]),
        ("${ }", [("", "")]),  # reported so the validator can reject it
        ("$${input.x}", []),
        (42, []),
    ],
)
def test_references(template: Any, expected: list[tuple[str, str]]) -> None:
    assert references(template) == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("hello ${input.ticket", [("", "unclosed")]),
        ({"a": ["ok ${input.x}", "bad ${a{b}"]}, [("a[1]", "unclosed")]),
        ("nested ${${input.x}}", [("", "unclosed")]),
        ("${}", [("", "malformed")]),
        ("${input..x} ${input.}", [("", "malformed"), ("", "malformed")]),
        ("$${input.x", []),  # the escape is never a reference
        ("price $5, ${input.x}, {{x}}", []),
        ({"${unclosed": "keys are not templates"}, []),
    ],
)
def test_reference_errors(template: Any, expected: list[tuple[str, str]]) -> None:
    errors = reference_errors(template)
    assert [(location, message.split()[0]) for location, message in errors] == expected


@pytest.mark.parametrize(
    ("base", "child", "joined"),
    [
        ("steps[2].input", "a[0]", "steps[2].input.a[0]"),
        ("steps[2].input", "[1].b", "steps[2].input[1].b"),
        ("steps[2].input", "", "steps[2].input"),
        ("", "a", "a"),
        ("", "", ""),
    ],
)
def test_join_location(base: str, child: str, joined: str) -> None:
    assert join_location(base, child) == joined


# --- legacy translation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("legacy", "translated"),
    [
        ("{{workflow_input.x}}", "${input.x}"),
        ("{{workflow_input.a.b.0}}", "${input.a.b.0}"),
        ("{{workflow_input}}", "${input}"),
        ("{{step.a.b}}", "${steps.a.output.b}"),
        ("{{step.a.b.c}}", "${steps.a.output.b.c}"),
        ("{{step.a}}", "${steps.a.output}"),
        ("{{loop_item.x}}", "${item.x}"),
        ("{{loop_item}}", "${item}"),
        ("{{ step.a.b }}", "${steps.a.output.b}"),
        ("{{\tworkflow_input.x\n}}", "${input.x}"),
        (
            "Hi {{workflow_input.name}}, re {{step.classify.kind}}!",
            "Hi ${input.name}, re ${steps.classify.output.kind}!",
        ),
        # Untouched: anything else in {{ }}.
        ("{{other.x}}", "{{other.x}}"),
        ("{{step}}", "{{step}}"),
        ("{{steps.a}}", "{{steps.a}}"),
        ("{{workflow_inputs.x}}", "{{workflow_inputs.x}}"),
        ("{{step..a}}", "{{step..a}}"),
        ("{{step.a b}}", "{{step.a b}}"),
        ("{{ loop_item | upper }}", "{{ loop_item | upper }}"),
        ("{workflow_input.x}", "{workflow_input.x}"),
        ("${input.x}", "${input.x}"),
        # A $ glued to the reference would turn the translation into the $${ escape.
        ("${{step.a}}", "${{step.a}}"),
    ],
)
def test_translate_legacy(legacy: str, translated: str) -> None:
    assert translate_legacy(legacy) == translated
    assert translate_legacy(translated) == translated


def test_translate_legacy_is_recursive_over_values_not_keys() -> None:
    document = {
        "steps": [
            {"id": "draft", "input": {"kind": "{{step.classify.kind}}", "n": 3, "ok": None}},
            {
                "id": "send",
                "input": ["{{loop_item}}", {"{{workflow_input.k}}": "{{workflow_input.k}}"}],
            },
        ]
    }
    assert translate_legacy(document) == {
        "steps": [
            {"id": "draft", "input": {"kind": "${steps.classify.output.kind}", "n": 3, "ok": None}},
            {"id": "send", "input": ["${item}", {"{{workflow_input.k}}": "${input.k}"}]},
        ]
    }


def test_translated_template_resolves() -> None:
    template = translate_legacy({"kind": "{{step.classify.kind}}", "t": "#{{loop_item.sku}}"})
    assert resolve(template, CONTEXT) == {"kind": "bug", "t": "#X-1"}


# --- properties ---------------------------------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(context=contexts, path=st.text())
def test_lookup_never_raises_on_any_text(context: dict[str, Any], path: str) -> None:
    lookup(context, path)
    lookup_or_missing(context, path)


@PROPERTY
@given(context=contexts, path=paths)
def test_lookup_never_raises_on_path_like_text(context: dict[str, Any], path: str) -> None:
    value = lookup_or_missing(context, path)
    assert lookup(context, path) is (None if value is MISSING else value)


@PROPERTY
@given(template=json_values(template_strings), context=contexts)
def test_resolve_never_raises(template: Any, context: dict[str, Any]) -> None:
    before = copy.deepcopy(template)
    resolve(template, context)
    references(template)
    reference_errors(template)
    assert template == before


@PROPERTY
@given(path=paths, context=contexts)
def test_whole_reference_is_lookup(path: str, context: dict[str, Any]) -> None:
    if "{" in path or "}" in path or path != path.strip():
        return
    assert resolve("${" + path + "}", context) == lookup(context, path)


legacy_strings = st.lists(
    st.sampled_from(
        ["{{", "}}", " ", "$", "{", "}", ".", "step", "workflow_input", "loop_item", "a", "b"]
    )
    | st.text(max_size=3)
).map("".join)


@PROPERTY
@given(template=json_values(legacy_strings | template_strings))
def test_translate_legacy_is_idempotent(template: Any) -> None:
    once = translate_legacy(template)
    assert translate_legacy(once) == once
