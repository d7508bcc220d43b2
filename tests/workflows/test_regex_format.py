"""``format: "regex"`` values are judged by RE2, never compiled by Python's ``re`` (issue 36,
deliver 1): in ``POST /runs``, in a recipe's ``output_schema`` against a model's reply, and in
every validator of the project. The worker's side (a subworkflow's input, a recipe step) is
tests/workers/test_regex_format_e2e.py.

jsonschema's own checker ran ``re.compile`` on each value: about 6 ms for one case-insensitive
class (a 32 KB body held a web worker 22.8 s) and a RecursionError, a 500, for 10,000 nested
parentheses. Where the two engines disagree, RE2's verdict wins (``workflows.regex``).
"""

from __future__ import annotations

import re
import time
from typing import Any
from unittest import mock

import pytest
from rest_framework.test import APIClient

from runs.models import Run
from workers.kinds import recipe
from workflows import input_schema, regex, schema
from workflows.input_schema import input_validator, write_only_values

from ..runs.factories import WorkflowVersionFactory, support_ticket_document

SCHEMA = {
    "type": "object",
    "properties": {
        "pattern_field": {"type": "string", "format": "regex"},
        "patterns": {"type": "array", "items": {"type": "string", "format": "regex"}},
        "secret": {"type": "string", "writeOnly": True},
    },
}
NESTED = "(" * 10_000 + "a" + ")" * 10_000
# Each was slow for Python's re to compile (case folding a class walks its every character).
CLASSES = ["(?i)[a-zà-ÿ]", "(?i)[k-z\u03b1-\u03c9]", "(?i)[\u0100-\u017f]", "(?i)[^\u0400-\u04ff]"]
HUGE_ALTERNATION = "|".join(f"word{n}" for n in range(6_000))
# 1,000 distinct case-insensitive classes over wide ranges (distinct, so no engine's cache
# helps): Python's re took 7 to 20 ms each, RE2 about 30 us.
WIDE = [f"(?i)[\u0100-\uffff]{n:x}" for n in range(1_000)]
# Python's re takes these; RE2 does not (no backreferences, no lookarounds): refused.
RE_ONLY = ["(a)\\1", "(?=a)b", "(?<!x)y", "(?P<w>a)(?P=w)", "a(?#comment)b"]
# RE2 takes these; Python's re does not (or raises RecursionError): accepted.
RE2_ONLY = ["\\pL+", "\\z", "[[:alpha:]]+", "\\C", NESTED]


def _errors(value: Any) -> list[tuple[list[Any], str]]:
    return [
        (list(error.absolute_path), error.message)
        for error in input_validator(SCHEMA).iter_errors(value)
    ]


def test_re_never_compiles_a_value() -> None:
    """The checker of every validator is RE2's: ``re.compile`` is never called on a value."""
    with mock.patch.object(re, "compile", side_effect=AssertionError("re.compile on a value")):
        assert _errors({"pattern_field": "(?i)[a-z]+"}) == []
        assert _errors({"patterns": CLASSES}) == []
        assert [path for path, _ in _errors({"pattern_field": "(a)\\1"})] == [["pattern_field"]]
        assert write_only_values(SCHEMA, {"pattern_field": "(a)\\1", "secret": "s"}) == [
            (["secret"], "s")
        ]
    assert schema.schema_validator().format_checker is input_schema.FORMAT_CHECKER


@pytest.mark.parametrize("pattern", RE2_ONLY + CLASSES + [HUGE_ALTERNATION])
def test_what_re2_compiles_is_a_regex(pattern: str) -> None:
    started = time.monotonic()
    assert _errors({"pattern_field": pattern}) == []
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("pattern", [*RE_ONLY, "(", "a{2,1}", "[z-a]", "x" * 1000 + "(?<n>"])
def test_what_re2_refuses_is_not_a_regex_and_the_message_is_short(pattern: str) -> None:
    [(path, message)] = _errors({"pattern_field": pattern})
    assert path == ["pattern_field"]
    assert "is not a 'regex'" in message and "RE2" in message
    assert len(message) < 500


def test_a_pattern_past_re2s_memory_bound_is_refused_quickly() -> None:
    """``max_mem`` (``regex.MAX_MEM``, 1.25 MiB) bounds the program RE2 builds: counted
    repetitions that would pass it are refused, not built; so are nested counts past RE2's own
    bound."""
    started = time.monotonic()
    [(_, message)] = _errors({"pattern_field": "a{1000}" * 1000})
    assert "pattern too large" in message
    [(_, message)] = _errors({"pattern_field": "((((a{100}){100}){100}){100})"})
    assert "invalid repetition size" in message
    assert time.monotonic() - started < 1.0


def test_one_validation_judges_a_bounded_number_of_patterns() -> None:
    """At most MAX_REGEX_VALUES values of MAX_REGEX_CHARS characters in all are compiled;
    each value past that is refused unjudged, naming its place."""
    limit = input_schema.MAX_REGEX_VALUES
    assert _errors({"patterns": ["a+"] * limit}) == []
    found = _errors({"patterns": ["a+"] * (limit + 2)})
    assert [path for path, _ in found] == [["patterns", limit], ["patterns", limit + 1]]
    assert "at most 1000 regular expressions" in found[0][1]
    chars = input_schema.MAX_REGEX_CHARS
    assert _errors({"pattern_field": "a" * chars}) == []
    [(path, message)] = _errors({"pattern_field": "a" * (chars + 1)})
    assert path == ["pattern_field"] and "65536 characters in all" in message
    # Across fields: what the first used is not the second's.
    found = _errors({"pattern_field": "a" * (chars - 10), "patterns": ["b" * 10, "c"]})
    assert [path for path, _ in found] == [["patterns", 1]]
    # Each validation has its own budget.
    assert _errors({"patterns": ["a+"] * limit}) == []


# Under RE2's default 8 MiB max_mem this compiled to 536,804 instructions in about 180 ms, and
# 1,000 of them (a 21.7 KB body) held a web worker 186 s.
WIDE_COUNT = "[\\pL\\pN]{400}"
# Near the largest such count MAX_MEM admits (63): about 80,000 instructions, accepted.
WIDE_COUNT_OK = "[\\pL\\pN]{60}"


def _spied_costs() -> tuple[list[int], Any]:
    costs: list[int] = []

    def spy(pattern: str) -> tuple[str | None, int]:
        reason, cost = regex.linear_pattern_cost(pattern)
        costs.append(cost)
        return reason, cost

    return costs, mock.patch.object(input_schema, "linear_pattern_cost", side_effect=spy)


def test_a_pattern_past_the_small_max_mem_is_refused_and_costs_a_bounded_amount() -> None:
    """RE2 judges values with ``regex.MAX_MEM``, not its 8 MiB default: what needs more is
    refused as too large (charged ``TOO_LARGE_COST``); what fits is charged its size."""
    assert regex.MAX_MEM <= 2 * 1024 * 1024
    reason, cost = regex.linear_pattern_cost(WIDE_COUNT)
    assert reason is not None and "pattern too large" in reason and "RE2" in reason
    assert cost == regex.TOO_LARGE_COST
    reason, cost = regex.linear_pattern_cost(WIDE_COUNT_OK)
    assert reason is None and 0 < cost < regex.TOO_LARGE_COST
    assert regex.linear_pattern_cost("a+") == (None, regex.linear_pattern_cost("b+")[1])
    assert regex.linear_pattern_cost("(a)\\1")[1] == 0
    [(path, message)] = _errors({"pattern_field": WIDE_COUNT})
    assert path == ["pattern_field"] and "pattern too large" in message


@pytest.mark.parametrize("base", [WIDE_COUNT, WIDE_COUNT_OK], ids=["refused", "accepted"])
def test_one_validation_bounds_the_compile_work_of_its_patterns(base: str) -> None:
    """1,000 distinct wide counts (within the value and character counts) compile at most
    about MAX_REGEX_PROGRAM instructions in all; every value past that is refused unjudged,
    naming its place."""
    values = [f"{base}{n:x}" for n in range(1_000)]
    assert sum(map(len, values)) < input_schema.MAX_REGEX_CHARS
    costs, spy = _spied_costs()
    with spy:
        found = _errors({"patterns": values})
    budget = input_schema.MAX_REGEX_PROGRAM
    assert sum(costs) <= budget + regex.TOO_LARGE_COST
    assert len(costs) <= budget // min(costs) + 1 < 100
    assert sum(costs) >= budget  # the budget, not the count, stopped it
    assert [path for path, _ in found][-1] == ["patterns", 999]
    past = [path for path, message in found if "compiled instructions" in message]
    assert past == [["patterns", n] for n in range(len(costs), 1_000)]
    if base == WIDE_COUNT:
        assert len(found) == 1_000
    else:
        assert len(found) == 1_000 - len(costs)
    # Each validation has its own budget.
    again = _errors({"patterns": values[:3]})
    assert all("compiled instructions" not in message for _, message in again)


def test_cached_author_patterns_are_bounded_too() -> None:
    """``compile_linear`` keeps at most 64 programs, each built under ``MAX_MEM`` (was 256 of
    up to 8 MiB each), outside ``re2.compile``'s own cache."""
    regex.compile_linear.cache_clear()
    assert regex.compile_linear(WIDE_COUNT) is None
    compiled = regex.compile_linear(WIDE_COUNT_OK)
    assert compiled is not None and compiled.search("é" * 60) is not None
    assert compiled.options.max_mem == regex.MAX_MEM
    assert regex.compile_linear.cache_info().maxsize == 64


def test_a_huge_value_is_not_echoed_whole() -> None:
    [(_, message)] = _errors({"pattern_field": "(" * 500_000})
    assert len(message) < 500


# --- POST /runs ------------------------------------------------------------------------------


@pytest.fixture
def version(db):
    return WorkflowVersionFactory(document=support_ticket_document(input_schema=SCHEMA))


def _start(api: APIClient, input: Any) -> Any:
    return api.post("/api/v1/runs", {"workflow": "support_ticket", "input": input}, format="json")


def _fields(response: Any) -> list[str]:
    return [error.get("field") for error in response.json()["errors"]]


@pytest.mark.parametrize(
    "pattern",
    ["(a)\\1", "(?=x)", "(", "a**" + "(" * 10_000],
    ids=["backref", "look", "open", "deep"],
)
def test_a_pattern_re2_refuses_is_a_400_naming_the_field(
    api: APIClient, version, pattern: str
) -> None:
    response = _start(api, {"pattern_field": pattern})
    assert response.status_code == 400, response.content
    assert _fields(response) == ["input.pattern_field"]
    assert "RE2" in response.json()["errors"][0]["message"]
    assert not Run.objects.exists()


def test_an_array_of_bad_patterns_names_each_item(api: APIClient, version) -> None:
    response = _start(api, {"patterns": ["ok", "(a)\\1", "[", "fine+"]})
    assert response.status_code == 400, response.content
    assert _fields(response) == ["input.patterns[1]", "input.patterns[2]"]


def test_a_pattern_past_max_mem_is_a_400_naming_the_field(api: APIClient, version) -> None:
    response = _start(api, {"pattern_field": WIDE_COUNT})
    assert response.status_code == 400, response.content
    assert _fields(response) == ["input.pattern_field"]
    assert "pattern too large" in response.json()["errors"][0]["message"]
    assert not Run.objects.exists()


def test_a_body_of_wide_counts_is_refused_after_a_bounded_compile_work(
    api: APIClient, version
) -> None:
    """The 21.7 KB body of 1,000 ``[\\pL\\pN]{400}`` held a web worker 186 s: now at most
    MAX_REGEX_PROGRAM instructions are compiled, the rest refused unjudged."""
    costs, spy = _spied_costs()
    with spy:
        response = _start(api, {"patterns": [f"{WIDE_COUNT}{n:x}" for n in range(1_000)]})
    assert response.status_code == 400, response.content
    assert _fields(response)[:2] == ["input.patterns[0]", "input.patterns[1]"]
    # Two validations, each with its budget: the input's, and (it has problems) the one that
    # finds its writeOnly values to mask them.
    assert sum(costs) <= 2 * (input_schema.MAX_REGEX_PROGRAM + regex.TOO_LARGE_COST)
    assert len(costs) < 100
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    "input",
    [
        {"pattern_field": NESTED},
        {"patterns": WIDE},
        {"pattern_field": "".join(CLASSES) * 1_000},
        {"pattern_field": HUGE_ALTERNATION},
    ],
    ids=["nested-10000", "1000-wide-classes", "one-long-class-run", "huge-alternation"],
)
def test_patterns_python_chokes_on_start_at_once(api: APIClient, version, input: Any) -> None:
    """Before: 10,000 nested parentheses were a 500 (RecursionError); case-insensitive classes
    cost Python's re up to 20 ms each."""
    started = time.monotonic()
    response = _start(api, input)
    elapsed = time.monotonic() - started
    assert response.status_code == 201, response.content
    assert elapsed < 5.0, elapsed


# --- a recipe's output_schema against a model's reply ---------------------------------------

OUTPUT_SCHEMA = {
    "type": "object",
    "required": ["rule"],
    "properties": {"rule": {"type": "string", "format": "regex"}},
}


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ("^[a-z]+$", None),
        (NESTED, None),
        ("(?i)" + "".join(CLASSES) * 1_000, None),
        ("(a)\\1", "it does not match output_schema at rule"),
        ("(?<=a)b", "it does not match output_schema at rule"),
    ],
    ids=["plain", "nested", "classes", "backref", "lookbehind"],
)
def test_a_replys_regex_fields_are_judged_by_re2(rule: str, problem: str | None) -> None:
    import json

    started = time.monotonic()
    with mock.patch.object(re, "compile", side_effect=AssertionError("re.compile on a reply")):
        value, error = recipe._parse(json.dumps({"rule": rule}), OUTPUT_SCHEMA)
    assert time.monotonic() - started < 2.0
    if problem is None:
        assert error is None and value == {"rule": rule}
    else:
        assert value is None and error is not None and error.startswith(problem)
        assert "RE2" in error and len(error) < 600
