"""The forecast's walk (workflows.forecast, pure: no database) and the save-time check of the
worst-case step count it gives (workflows.validation.step_count_errors, contract section 17)."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import pytest

from workflows.errors import InvalidDocument
from workflows.forecast import DEFAULT_MAX_STEPS, MAX_DEPTH, Sources, forecast
from workflows.validation import prepare_document, step_count_errors

MODEL = "openai:gpt-4o-mini"


def price(model: str, input_tokens: int, output_tokens: int) -> Decimal | None:
    # One micro-dollar an input token, two an output token; "x:unpriced" has none.
    if model == "x:unpriced":
        return None
    return Decimal(input_tokens) / 10**6 + Decimal(2 * output_tokens) / 10**6


def recipe_of(step: Any) -> dict[str, Any]:
    return {
        "prompt": step.get("prompt", "p"),
        "model": step.get("model", MODEL),
        "max_tokens": step.get("max_tokens", 100),
        "output": step.get("output", "text"),
    }


PRICED = Sources(price=price, recipe_of=recipe_of)


def task(step_id: str, **more: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "task", "handler": "h", **more}


def recipe(step_id: str, **more: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "recipe", "prompt": "Say hi", "model": MODEL, **more}


def doc(*steps: Any, **more: Any) -> dict[str, Any]:
    return {"id": "wf", "steps": list(steps), **more}


def by_id(result: Any) -> dict[str, Any]:
    return {step.step_id: step for step in result.per_step}


def test_the_engine_constants_it_copies_are_the_engines() -> None:
    from runs.engine.plan import DEFAULT_MAX_STEPS as planned
    from runs.kinds.subworkflow import MAX_SUBWORKFLOW_DEPTH
    from workflows.forecast import DEFAULT_RECIPE_MAX_TOKENS
    from workflows.recipes import DEFAULT_MAX_TOKENS

    assert (
        planned,
        MAX_SUBWORKFLOW_DEPTH,
        DEFAULT_MAX_TOKENS,
    ) == (DEFAULT_MAX_STEPS, MAX_DEPTH, DEFAULT_RECIPE_MAX_TOKENS)


def test_a_sequence_counts_one_attempt_each_and_a_recipe_its_default_retries() -> None:
    result = forecast(doc(task("a"), recipe("r")), PRICED)
    assert (result.steps_min, result.steps_max) == (2, 4)  # recipe: 3 attempts by default
    r = by_id(result)["r"]
    assert (r.calls_min, r.calls_max) == (1, 3)
    assert r.cost_max == 3 * price(MODEL, len("Say hi") + 32, 100)
    assert 0 < r.cost_min < r.cost_max
    assert result.cost_expected == (result.cost_min + result.cost_max) / 2


def test_retry_max_attempts_multiplies_the_max_and_min_stays_one() -> None:
    result = forecast(doc(task("a", retry={"max_attempts": 5})))
    assert (result.steps_min, result.steps_max) == (1, 5)
    assert by_id(result)["a"].how == "5 attempts (steps[0]: retry.max_attempts)"


def test_a_foreach_without_a_known_list_is_zero_to_max_items() -> None:
    step = {
        "id": "each",
        "kind": "foreach",
        "items": "${input.xs}",
        "max_items": 20,
        "do": task("t"),
    }
    result = forecast(doc(step))
    assert (result.steps_min, result.steps_max) == (0, 20)
    assert by_id(result)["t"].bound_field == "steps[0].max_items"


def test_a_foreach_over_a_known_input_list_runs_once_per_item() -> None:
    step = {"id": "each", "kind": "foreach", "items": "${input.order.xs}", "do": task("t")}
    sources = Sources(input={"order": {"xs": [1, 2, 3]}}, input_given=True)
    result = forecast(doc(step), sources)
    assert (result.steps_min, result.steps_max) == (3, 3)
    literal = {"id": "each", "kind": "foreach", "items": [1, 2], "do": task("t")}
    assert forecast(doc(literal)).steps_max == 2


def test_a_foreach_body_of_several_steps_counts_its_body_run_too() -> None:
    step = {"id": "each", "kind": "foreach", "items": [1, 2], "do": [task("a"), task("b")]}
    assert forecast(doc(step)).steps_max == 2 * 3


def test_a_loop_is_one_to_max_iterations_with_until_and_exactly_max_without() -> None:
    until = {
        "id": "l",
        "kind": "loop",
        "max_iterations": 4,
        "do": task("t"),
        "until": {"path": "iter.index", "equals": 1},
    }
    assert (forecast(doc(until)).steps_min, forecast(doc(until)).steps_max) == (1, 4)
    fixed = {"id": "l", "kind": "loop", "max_iterations": 4, "do": task("t")}
    assert (forecast(doc(fixed)).steps_min, forecast(doc(fixed)).steps_max) == (4, 4)


def test_a_condition_takes_the_cheaper_branch_for_min_and_the_dearer_for_max() -> None:
    step = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.x", "equals": 1},
        "then": [task("a"), task("b"), task("d")],
        "else": [task("e")],
    }
    result = forecast(doc(step))
    assert (result.steps_min, result.steps_max) == (1, 3)
    assert by_id(result)["a"].attempts_min == 0  # a branch may not be taken


def test_a_when_guard_makes_the_min_zero_and_on_failure_adds_to_the_max() -> None:
    result = forecast(
        doc(task("a", when={"path": "input.go", "equals": True}), on_failure=[task("h1")])
    )
    assert (result.steps_min, result.steps_max) == (0, 2)


def test_a_subworkflow_counts_its_row_and_its_childs_steps() -> None:
    child = doc(task("c1"), recipe("c2"))
    child["id"] = "child"
    sources = Sources(price=price, recipe_of=recipe_of, child_of=lambda w, v: child)
    result = forecast(doc({"id": "sub", "kind": "subworkflow", "workflow": "child"}), sources)
    assert (result.steps_min, result.steps_max) == (1 + 2, 1 + 4)
    assert by_id(result)["sub"].cost_max == 3 * price(MODEL, len("Say hi") + 32, 100)
    assert set(by_id(result)) == {"sub"}


def test_a_workflow_that_starts_itself_or_an_unknown_one_is_unbounded_saying_why() -> None:
    result = forecast(
        doc({"id": "sub", "kind": "subworkflow", "workflow": "wf"}),
        Sources(child_of=lambda w, v: None),
    )
    assert result.steps_max is None and "starts itself" in result.unbounded[0]
    result = forecast(
        doc({"id": "sub", "kind": "subworkflow", "workflow": "x"}),
        Sources(child_of=lambda w, v: None),
    )
    assert result.steps_max is None and "'x' is not known" in result.unbounded[0]


def test_an_agent_step_and_an_unpriced_model_have_no_max_cost() -> None:
    result = forecast(
        doc({"id": "ag", "kind": "agent", "handler": "h"}, recipe("r", model="x:unpriced")), PRICED
    )
    assert result.cost_max is None and result.cost_expected is None
    assert result.steps_max == 4
    assert any("agent" in reason for reason in result.unbounded)
    assert any("has no price" in reason for reason in result.unbounded)


def test_a_json_recipe_may_ask_twice() -> None:
    r = by_id(forecast(doc(recipe("r", output="json", retry={"max_attempts": 1})), PRICED))["r"]
    assert (r.calls_min, r.calls_max) == (1, 2)
    assert r.cost_max > 2 * price(MODEL, len("Say hi") + 32, 100)


def test_expected_is_the_median_of_history_a_run_without_a_step_counting_zero() -> None:
    sources = Sources(
        price=price,
        recipe_of=recipe_of,
        history={"r": [Decimal("0.1"), Decimal("0.3")]},
        history_totals=[Decimal("0.1"), Decimal("0.3"), Decimal("0.2")],
    )
    result = forecast(doc(recipe("r")), sources)
    assert by_id(result)["r"].cost_expected == Decimal("0.1")  # median of 0.1, 0.3, 0
    assert result.cost_expected == Decimal("0.2")


def test_min_is_at_most_max_everywhere() -> None:
    step = {
        "id": "each",
        "kind": "foreach",
        "items": "${input.xs}",
        "max_items": 3,
        "do": [
            recipe("r"),
            {
                "id": "c",
                "kind": "condition",
                "if": {"path": "item", "equals": 1},
                "then": [recipe("r2")],
            },
        ],
    }
    result = forecast(doc(step), PRICED)
    assert result.cost_min <= result.cost_max and result.steps_min <= result.steps_max
    for one in result.per_step:
        assert one.cost_min <= one.cost_max and one.attempts_min <= one.attempts_max


def test_five_hundred_steps_forecast_in_well_under_50_ms() -> None:
    steps = [recipe(f"r{i}") if i % 2 else task(f"t{i}") for i in range(500)]
    document = doc(*steps)
    started = time.perf_counter()
    forecast(document, PRICED)
    assert time.perf_counter() - started < 0.05


# --- the save-time check ------------------------------------------------------------------


def test_a_worst_case_over_max_steps_is_refused_naming_the_bound() -> None:
    step = {
        "id": "each",
        "kind": "foreach",
        "items": "${input.xs}",
        "max_items": 600,
        "do": [task("t"), task("u")],
    }
    errors = step_count_errors(doc(step))
    assert [error.field for error in errors] == ["steps[0].max_items"]
    assert "1800 step attempts" in errors[0].message  # a body run and two steps an item
    assert "600 items (steps[0].max_items)" in errors[0].message
    assert step_count_errors(doc(step, limits={"max_steps": 1800})) == []


def test_retries_are_not_counted_at_save_a_failure_storm_is_max_steps_job_at_run_time() -> None:
    # The forecast's max counts them (a run may make 2,000 attempts); the document is saved.
    step = {
        "id": "each",
        "kind": "foreach",
        "items": "${input.xs}",
        "max_items": 1000,
        "do": task("t", retry={"max_attempts": 2}),
    }
    assert forecast(doc(step)).steps_max == 2000
    assert step_count_errors(doc(step)) == []


def test_a_foreach_without_max_items_is_not_refused_though_its_forecast_counts_1000() -> None:
    step = {"id": "each", "kind": "foreach", "items": "${input.xs}", "do": recipe("r")}
    assert step_count_errors(doc(step)) == []
    result = forecast(doc(step))
    assert result.steps_max == 3000
    assert "not given: 1000 by default" in by_id(result)["r"].how


def test_a_document_over_the_limit_is_refused_at_save_and_an_unbounded_one_is_not() -> None:
    loop = {
        "id": "l",
        "kind": "loop",
        "max_iterations": 20,
        "do": {"id": "inner", "kind": "loop", "max_iterations": 60, "do": task("t")},
    }
    with pytest.raises(InvalidDocument) as refused:
        prepare_document(doc(loop))
    assert refused.value.errors[0].field == "steps[0].do.max_iterations"
    itself = doc({"id": "sub", "kind": "subworkflow", "workflow": "wf"})
    assert step_count_errors(itself, lambda w, v: None) == []


def test_a_subworkflows_steps_count_against_the_parents_limit() -> None:
    child = doc({"id": "l", "kind": "loop", "max_iterations": 900, "do": task("t")})
    parent = doc(
        {"id": "sub", "kind": "subworkflow", "workflow": "child"},
        {"id": "again", "kind": "subworkflow", "workflow": "child"},
    )
    errors = step_count_errors(parent, lambda w, v: child)
    assert errors and errors[0].field == "limits.max_steps"
    assert "1802 step attempts" in errors[0].message
