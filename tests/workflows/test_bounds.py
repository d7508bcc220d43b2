"""Bounded work at save (contract section 9): how many steps, how deep, how many repeats.

For each bound a document just under it saves and one just over it is refused, naming the
field and the limit.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from rest_framework.test import APIClient

from workflows.validation import validate_document

Doc = dict[str, Any]


def sleep(step_id: str) -> Doc:
    return {"id": step_id, "kind": "sleep", "ms": 0}


def doc(*steps: Doc) -> Doc:
    return {"id": "bounded", "steps": list(steps)}


def roomy(*steps: Doc) -> Doc:
    """A document whose limits.max_steps lets the bounds below be checked on their own (its
    worst case, up to 100,000 attempts, is over the default 1,000: test_forecast checks that)."""
    return {**doc(*steps), "limits": {"max_steps": 10_000_000}}


def loop(step_id: str, times: int, do: Any) -> Doc:
    return {"id": step_id, "kind": "loop", "max_iterations": times, "do": do}


def foreach(step_id: str, do: Any, **more: Any) -> Doc:
    return {"id": step_id, "kind": "foreach", "items": "${input.xs}", "do": do, **more}


def nested(levels: int) -> Doc:
    """A loop in a loop ... ``levels`` levels of steps in all (the innermost a sleep)."""
    step = sleep(f"s{levels}")
    for level in range(levels - 1, 0, -1):
        step = loop(f"l{level}", 1, step)
    return step


def errors(document: Doc, **options: Any) -> dict[str, str]:
    return {e.field: e.message for e in validate_document(document, **options)}


# --- how many steps ---------------------------------------------------------------------------


def test_a_document_of_500_steps_saves_and_one_of_501_does_not() -> None:
    assert errors(doc(*(sleep(f"s{i}") for i in range(500)))) == {}
    found = errors(doc(*(sleep(f"s{i}") for i in range(501))))
    assert list(found) == ["steps"]
    assert "501 steps" in found["steps"] and "at most 500" in found["steps"]


def test_nested_steps_count_too() -> None:
    body = [sleep(f"b{i}") for i in range(499)]
    assert errors(doc(loop("outer", 2, body))) == {}  # 1 + 499
    found = errors(doc(loop("outer", 2, [*body, sleep("one_more")])))
    assert "501 steps" in found["steps"]
    branches = {f"p{i}": sleep(f"p{i}") for i in range(249)}
    cond = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.x", "op": "exists"},
        "then": [sleep(f"t{i}") for i in range(125)],
        "else": [sleep(f"e{i}") for i in range(125)],
    }
    assert (
        "501 steps"
        in errors(doc({"id": "par", "kind": "parallel", "branches": branches}, cond))["steps"]
    )


def test_the_step_bound_is_a_setting() -> None:
    steps = doc(*(sleep(f"s{i}") for i in range(11)))
    assert errors(steps, max_steps=11) == {}
    assert "at most 10 " in errors(steps, max_steps=10)["steps"]


def test_a_huge_document_is_refused_fast_with_that_error_alone() -> None:
    # 15,000 steps (with a shape error in each) took 7 s to check in full; the count comes
    # first and is the only answer.
    huge = doc(*({"id": f"s{i}", "kind": "sleep", "ms": -1} for i in range(15_000)))
    # This process's CPU, not the wall clock: on a loaded machine the wall clock measured
    # the neighbours (1.04 s once in a full run, where the check alone takes about 0.1 s).
    started = time.process_time()
    found = errors(huge)
    assert time.process_time() - started < 1.0
    assert list(found) == ["steps"]


# --- how deep ---------------------------------------------------------------------------------


def test_steps_nest_8_levels_deep_and_not_9() -> None:
    assert errors(doc(nested(8))) == {}
    found = errors(doc(nested(9)))
    deepest = "steps[0]" + ".do" * 8
    assert list(found) == [deepest]
    assert "9 levels deep" in found[deepest] and "at most 8" in found[deepest]


def test_every_kind_of_nesting_counts_a_level() -> None:
    inner: Any = nested(6)  # levels 3 to 8 below
    cond = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.x", "op": "exists"},
        "then": [sleep("t")],
        "else": [inner],
    }
    par = {"id": "par", "kind": "parallel", "branches": {"a": [cond, sleep("after")]}}
    assert errors(doc(par)) == {}
    cond["else"] = [loop("extra", 1, inner)]
    found = errors(doc(par))
    assert list(found) == ["steps[0].branches.a[0].else[0]" + ".do" * 6]


# --- how many repeats -------------------------------------------------------------------------


def test_max_iterations_and_max_items_are_at_most_10000() -> None:
    assert errors(roomy(loop("l", 10_000, sleep("s")))) == {}
    found = errors(roomy(loop("l", 10_001, sleep("s"))))
    assert found == {"steps[0].max_iterations": "must be at most 10000; got 10001"}
    assert errors(roomy(foreach("f", sleep("s"), max_items=10_000))) == {}
    found = errors(roomy(foreach("f", sleep("s"), max_items=10_001)))
    assert found == {"steps[0].max_items": "must be at most 10000; got 10001"}


def test_nested_loops_repeat_their_body_at_most_100000_times() -> None:
    assert errors(roomy(loop("outer", 10, loop("inner", 10_000, sleep("s"))))) == {}
    found = errors(roomy(loop("outer", 11, loop("inner", 10_000, sleep("s")))))
    assert list(found) == ["steps[0].do.max_iterations"]
    assert "110000 runs" in found["steps[0].do.max_iterations"]
    assert "at most 100000" in found["steps[0].do.max_iterations"]


def test_a_foreach_without_max_items_counts_its_default_of_1000() -> None:
    assert errors(roomy(foreach("f", loop("l", 100, sleep("s"))))) == {}
    found = errors(roomy(foreach("f", loop("l", 101, sleep("s")))))
    assert list(found) == ["steps[0].do.max_iterations"]
    found = errors(roomy(loop("l", 101, foreach("f", sleep("s")))))
    assert list(found) == ["steps[0].do.max_items"]
    assert "not given: 1000 by default" in found["steps[0].do.max_items"]
    # A literal array counts its length.
    literal = {**foreach("f", loop("l", 10_000, sleep("s"))), "items": list(range(10))}
    assert errors(roomy(literal)) == {}
    literal["items"] = list(range(11))
    assert list(errors(roomy(literal))) == ["steps[0].do.max_iterations"]
    over = {**foreach("f", sleep("s")), "items": list(range(1001))}
    assert list(errors(roomy(loop("l", 100, over)))) == ["steps[0].do.items"]


def test_the_product_is_reported_once_where_it_first_goes_over() -> None:
    three = loop("a", 1000, loop("b", 1000, loop("c", 1000, sleep("s"))))
    assert list(errors(doc(three))) == ["steps[0].do.max_iterations"]
    # Bodies of several steps, parallel branches and conditions pass the product on.
    par = {
        "id": "p",
        "kind": "parallel",
        "branches": {"x": [sleep("x0"), foreach("f", sleep("s"), max_items=101)]},
    }
    assert list(errors(doc(loop("l", 1000, par)))) == ["steps[0].do.branches.x[1].max_items"]


# --- through the API --------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("document", "field"),
    [
        (doc(*(sleep(f"s{i}") for i in range(501))), "steps"),
        (doc(nested(9)), "steps[0]" + ".do" * 8),
        (doc(loop("outer", 100, loop("inner", 1001, sleep("s")))), "steps[0].do.max_iterations"),
        (doc(foreach("f", sleep("s"), max_items=20_000)), "steps[0].max_items"),
    ],
)
def test_the_api_answers_400_naming_the_field(api: APIClient, document: Doc, field: str) -> None:
    answer = api.post("/api/v1/definitions", json.dumps(document), content_type="application/json")
    assert answer.status_code == 400, answer.content
    assert field in [error["field"] for error in answer.json()["errors"]]


@pytest.mark.django_db
def test_the_api_reads_the_step_bound_from_the_settings(api: APIClient, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "MAX_DOCUMENT_STEPS": 3}
    three = json.dumps(doc(sleep("a"), sleep("b"), sleep("c")))
    assert (
        api.post("/api/v1/definitions", three, content_type="application/json").status_code == 201
    )
    four = json.dumps(doc(sleep("a"), sleep("b"), sleep("c"), sleep("d")))
    answer = api.post("/api/v1/definitions", four, content_type="application/json")
    assert answer.status_code == 400
    assert answer.json()["errors"][0]["field"] == "steps"
