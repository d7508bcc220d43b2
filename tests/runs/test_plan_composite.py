"""plan() for parallel, foreach and loop, without a database."""

from __future__ import annotations

from typing import Any

from runs.engine.plan import AttemptView, Cancel, Close, Finish, Open, Schedule, plan

from .test_plan import NOW, doc, failed, in_flight, ok, only, run, task


def at(view: AttemptView, path: str) -> AttemptView:
    return AttemptView(**{**view.__dict__, "path": path})


def row(step_id: str, kind: str, status: str = "running", **fields: Any) -> AttemptView:
    return in_flight(step_id, status=status, kind=kind, **fields)


def par(**branches: dict) -> dict:
    return {"id": "par", "kind": "parallel", "branches": branches}


def each(items: Any, body: dict | None = None, **fields: Any) -> dict:
    return {"id": "fan", "kind": "foreach", "items": items, "do": body or task("work"), **fields}


def loop(body: dict | None = None, **fields: Any) -> dict:
    return {"id": "lp", "kind": "loop", "do": body or task("work"), **fields}


# --- parallel -------------------------------------------------------------------------------


def test_parallel_opens_its_row_and_schedules_every_branch_in_one_plan() -> None:
    out = plan(doc(par(a=task("one"), b=task("two"))), run(input={"x": 1}), [], NOW)
    opened = only(out.actions, Open)
    assert (opened.kind, opened.status) == ("parallel", "running")
    assert out.actions.index(opened) == 0  # the row is written before the branches
    scheduled = out.of(Schedule)
    assert [(s.step_id, s.path, s.input) for s in scheduled] == [
        ("one", "par[a]/", {"x": 1}),
        ("two", "par[b]/", {"x": 1}),
    ]


def test_parallel_waits_for_every_branch_then_closes_with_outputs_by_name() -> None:
    open_row = row("par", "parallel")
    journal = [open_row, at(ok("one", 1), "par[a]/"), at(in_flight("two"), "par[b]/")]
    document = doc(par(a=task("one"), b=task("two")), task("after", input="${steps.par.output}"))
    assert plan(document, run(), journal, NOW).actions == []
    journal[2] = at(ok("two", 2), "par[b]/")
    out = plan(document, run(), journal, NOW)
    close = only(out.actions, Close)
    assert (close.attempt_id, close.status, close.output) == (
        open_row.id,
        "succeeded",
        {"a": 1, "b": 2},
    )
    assert only(out.actions, Schedule).input == {"a": 1, "b": 2}


def test_a_failing_branch_fails_the_parallel_and_cancels_the_others() -> None:
    running = at(in_flight("two"), "par[b]/")
    journal = [row("par", "parallel"), at(failed("one", "fatal"), "par[a]/"), running]
    out = plan(doc(par(a=task("one"), b=task("two"))), run(), journal, NOW)
    assert only(out.actions, Cancel).attempt_ids == (running.id,)
    assert only(out.actions, Close).status == "failed"
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "fatal",
        "one",
    )


def test_a_branch_with_continue_leaves_a_null_and_the_others_go_on() -> None:
    journal = [
        row("par", "parallel"),
        at(failed("one", "fatal"), "par[a]/"),
        at(ok("two", 2), "par[b]/"),
    ]
    out = plan(doc(par(a=task("one", on_error="continue"), b=task("two"))), run(), journal, NOW)
    assert only(out.actions, Close).output == {"a": None, "b": 2}


def test_a_parallel_with_continue_survives_a_failed_branch() -> None:
    step = {**par(a=task("one"), b=task("two")), "on_error": "continue"}
    journal = [
        row("par", "parallel"),
        at(failed("one", "fatal"), "par[a]/"),
        at(in_flight("two"), "par[b]/"),
    ]
    out = plan(doc(step, task("after", input="${steps.par.status}")), run(), journal, NOW)
    assert only(out.actions, Schedule).input == "failed"
    assert only(out.actions, Cancel)


def test_a_failure_in_the_same_plan_schedules_nothing_else_inside() -> None:
    # Branch a fails for good at once (a bad sleep_until): branch b's first attempt is not
    # even written.
    bad = {"id": "nap", "kind": "sleep_until", "until": "never"}
    out = plan(doc(par(a=bad, b=task("two"))), run(), [], NOW)
    assert out.of(Schedule) == []
    assert only(out.actions, Finish).error["step"] == "nap"


def test_a_retrying_branch_backs_off_while_the_others_finish() -> None:
    retrying = task("one", retry={"max_attempts": 2, "initial_ms": 60_000})
    journal = [
        row("par", "parallel"),
        at(failed("one", "retryable"), "par[a]/"),
        at(ok("two"), "par[b]/"),
    ]
    out = plan(doc(par(a=retrying, b=task("two"))), run(), journal, NOW)
    assert out.of(Close) == [] and out.of(Finish) == []
    assert out.actions[0].purpose == "retry_backoff"


def settled(**branches: dict) -> dict:
    return {**par(**branches), "mode": "all_settled"}


def test_all_settled_lets_every_branch_run_on_after_one_fails() -> None:
    running = at(in_flight("two"), "par[b]/")
    journal = [row("par", "parallel"), at(failed("one", "fatal"), "par[a]/"), running]
    out = plan(doc(settled(a=task("one"), b=task("two"))), run(), journal, NOW)
    # Nothing cancelled, nothing closed, the run not ended: branch b is still running.
    assert out.actions == []


def test_all_settled_schedules_every_branch_even_when_one_fails_at_once() -> None:
    # Branch a fails for good in the first plan (fail_fast would not even write b's row).
    bad = {"id": "nap", "kind": "sleep_until", "until": "never"}
    out = plan(doc(settled(a=bad, b=task("two"))), run(), [], NOW)
    assert [s.step_id for s in out.of(Schedule)] == ["two"]
    assert out.of(Finish) == []


def test_all_settled_closes_with_each_branch_status_output_and_error() -> None:
    open_row = row("par", "parallel")
    journal = [
        open_row,
        at(failed("one", "fatal"), "par[a]/"),
        at(ok("two", {"n": 2}), "par[b]/"),
        at(failed("three", "fatal"), "par[c]/"),
    ]
    step = settled(
        a=task("one"),
        b=task("two"),
        c=task("three", on_error="continue"),
        d=task("four", when={"path": "input.never", "op": "exists"}),
    )
    document = doc(step, task("after", input="${steps.par.output}"))
    out = plan(document, run(), journal, NOW)
    close = only(out.actions, Close)
    expected = {
        "a": {
            "status": "failed",
            "output": None,
            "error": {"class": "fatal", "message": "fatal failure", "step": "one"},
        },
        "b": {"status": "succeeded", "output": {"n": 2}, "error": None},
        "c": {
            "status": "failed",
            "output": None,
            "error": {"class": "fatal", "message": "fatal failure"},
        },
        "d": {"status": "skipped", "output": None, "error": None},
    }
    assert (close.attempt_id, close.status, close.output) == (open_row.id, "succeeded", expected)
    # The step succeeded: the run goes on with its output.
    assert only(out.actions, Schedule).input == expected
    assert out.of(Finish) == []


def test_all_settled_output_leaves_out_a_branch_errors_traceback() -> None:
    # A task's exception is journaled with its traceback, which only the workflow's
    # operators may see (CONTRACT section 8); the step's output is read by its viewers and
    # starters (the API, the run-end webhook), so the branch's error goes without it.
    open_row = row("par", "parallel")
    crashed = failed("one", error_extra={"traceback": "Traceback: /srv/app/secret_path.py"})
    journal = [open_row, at(crashed, "par[a]/"), at(ok("two", 2), "par[b]/")]
    step = settled(a=task("one", on_error="continue"), b=task("two"))
    close = only(plan(doc(step), run(), journal, NOW).actions, Close)
    assert close.output["a"] == {
        "status": "failed",
        "output": None,
        "error": {"class": "fatal", "message": "fatal failure"},
    }


def test_all_settled_waits_for_a_retrying_branch_before_settling() -> None:
    retrying = task("one", retry={"max_attempts": 2, "initial_ms": 60_000})
    journal = [
        row("par", "parallel"),
        at(failed("one", "retryable"), "par[a]/"),
        at(failed("two", "fatal"), "par[b]/"),
    ]
    out = plan(doc(settled(a=retrying, b=task("two"))), run(), journal, NOW)
    assert out.of(Close) == [] and out.of(Finish) == []
    assert out.actions[0].purpose == "retry_backoff"


def test_fail_fast_named_is_the_default_behaviour() -> None:
    running = at(in_flight("two"), "par[b]/")
    journal = [row("par", "parallel"), at(failed("one", "fatal"), "par[a]/"), running]
    step = {**par(a=task("one"), b=task("two")), "mode": "fail_fast"}
    out = plan(doc(step), run(), journal, NOW)
    assert only(out.actions, Cancel).attempt_ids == (running.id,)
    assert only(out.actions, Finish).error["step"] == "one"


def test_all_settled_still_stops_at_a_run_limit() -> None:
    # limits.max_steps ends the run whatever the mode: the limit is the run's, not a branch's.
    journal = [row("par", "parallel"), at(failed("one", "fatal"), "par[a]/")]
    document = doc(settled(a=task("one"), b=task("two")), limits={"max_steps": 1})
    finish = only(plan(document, run(), journal, NOW).actions, Finish)
    assert finish.error["class"] == "limit"


# --- foreach --------------------------------------------------------------------------------


def test_foreach_schedules_every_item_with_item_and_index() -> None:
    body = task("work", input={"it": "${item}", "at": "${index}"})
    out = plan(doc(each("${input.xs}", body)), run(input={"xs": ["a", "b", "c"]}), [], NOW)
    assert [(s.path, s.input) for s in out.of(Schedule)] == [
        ("fan[0]/", {"it": "a", "at": 0}),
        ("fan[1]/", {"it": "b", "at": 1}),
        ("fan[2]/", {"it": "c", "at": 2}),
    ]


def test_a_body_without_input_gets_the_item() -> None:
    out = plan(doc(each("${input.xs}")), run(input={"xs": [{"n": 1}]}), [], NOW)
    assert only(out.actions, Schedule).input == {"n": 1}


def test_foreach_output_is_in_item_order_whatever_the_completion_order() -> None:
    open_row = row("fan", "foreach")
    journal = [
        open_row,
        at(ok("work", "B"), "fan[1]/"),
        at(ok("work", "C"), "fan[2]/"),
        at(ok("work", "A"), "fan[0]/"),
    ]
    out = plan(doc(each("${input.xs}")), run(input={"xs": [1, 2, 3]}), journal, NOW)
    assert only(out.actions, Close).output == ["A", "B", "C"]


def test_concurrency_keeps_at_most_n_in_flight_and_starts_the_next_when_one_ends() -> None:
    xs = list(range(10))
    first = plan(doc(each("${input.xs}", concurrency=3)), run(input={"xs": xs}), [], NOW)
    assert [s.path for s in first.of(Schedule)] == ["fan[0]/", "fan[1]/", "fan[2]/"]
    journal = [
        row("fan", "foreach"),
        at(ok("work", 0), "fan[0]/"),
        at(in_flight("work"), "fan[1]/"),
        at(in_flight("work", status="scheduled"), "fan[2]/"),
    ]
    out = plan(doc(each("${input.xs}", concurrency=3)), run(input={"xs": xs}), journal, NOW)
    assert [s.path for s in out.of(Schedule)] == ["fan[3]/"]


def test_an_item_backing_off_still_holds_its_slot() -> None:
    body = task("work", retry={"max_attempts": 3, "initial_ms": 60_000})
    journal = [row("fan", "foreach"), at(failed("work", "retryable"), "fan[0]/")]
    out = plan(
        doc(each("${input.xs}", body, concurrency=1)), run(input={"xs": [1, 2]}), journal, NOW
    )
    assert out.of(Schedule) == []


def test_more_items_than_max_items_fails_the_step_naming_the_limit_and_the_length() -> None:
    out = plan(doc(each("${input.xs}", max_items=2)), run(input={"xs": [1, 2, 3]}), [], NOW)
    opened = only(out.actions, Open)
    assert opened.status == "failed"
    assert "3 items exceed max_items (2)" in opened.error["message"]
    finish = only(out.actions, Finish)
    assert (finish.error["class"], finish.error["step"]) == ("invalid_input", "fan")


def test_items_that_are_not_an_array_fail_the_step() -> None:
    out = plan(doc(each("${input.xs}")), run(input={"xs": "abc"}), [], NOW)
    assert "expected an array, got str" in only(out.actions, Finish).error["message"]


def test_an_empty_foreach_is_done_at_once_with_an_empty_list() -> None:
    out = plan(
        doc(each("${input.xs}"), task("after", input="${steps.fan.output}")),
        run(input={"xs": []}),
        [],
        NOW,
    )
    assert only(out.actions, Open).status == "succeeded"
    assert only(out.actions, Schedule).input == []


def test_a_static_array_and_nested_foreach_reading_the_outer_item() -> None:
    inner = {
        "id": "inner",
        "kind": "foreach",
        "items": "${item.parts}",
        "do": task("work", input="${item}"),
    }
    outer = {
        "id": "fan",
        "kind": "foreach",
        "items": [{"parts": ["a", "b"]}, {"parts": ["c"]}],
        "do": inner,
    }
    out = plan(doc(outer), run(), [], NOW)
    assert [(s.path, s.input) for s in out.of(Schedule)] == [
        ("fan[0]/inner[0]/", "a"),
        ("fan[0]/inner[1]/", "b"),
        ("fan[1]/inner[0]/", "c"),
    ]
    assert [o.path for o in out.of(Open)] == ["", "fan[0]/", "fan[1]/"]


def test_a_condition_inside_an_item() -> None:
    body = {
        "id": "check",
        "kind": "condition",
        "if": {"path": "item", "op": "gt", "value": 1},
        "then": [task("big")],
        "else": [task("small")],
    }
    out = plan(doc(each("${input.xs}", body)), run(input={"xs": [1, 2]}), [], NOW)
    assert [(s.step_id, s.path) for s in out.of(Schedule)] == [
        ("small", "fan[0]/"),
        ("big", "fan[1]/"),
    ]


# --- loop -----------------------------------------------------------------------------------


def test_a_loop_runs_its_first_iteration_with_iter_index_zero() -> None:
    body = task("work", input={"i": "${iter.index}", "prev": "${iter.previous}"})
    out = plan(doc(loop(body, max_iterations=5)), run(), [], NOW)
    assert only(out.actions, Schedule).input == {"i": 0, "prev": None}
    assert only(out.actions, Schedule).path == "lp[0]/"


def test_the_next_iteration_sees_the_previous_output() -> None:
    body = task("work", input={"i": "${iter.index}", "prev": "${iter.previous}"})
    journal = [row("lp", "loop"), at(ok("work", {"n": 1}), "lp[0]/")]
    out = plan(doc(loop(body, max_iterations=5)), run(), journal, NOW)
    assert only(out.actions, Schedule).input == {"i": 1, "prev": {"n": 1}}


def test_a_loop_ends_when_until_holds() -> None:
    until = {"path": "iter.previous.done", "op": "eq", "value": True}
    journal = [
        row("lp", "loop"),
        at(ok("work", {"done": False}), "lp[0]/"),
        at(ok("work", {"done": True}), "lp[1]/"),
    ]
    out = plan(doc(loop(until=until, max_iterations=5)), run(), journal, NOW)
    assert only(out.actions, Close).output == {"done": True}
    assert out.of(Schedule) == []


def test_a_loop_ends_after_max_iterations() -> None:
    journal = [row("lp", "loop"), at(ok("work", 1), "lp[0]/"), at(ok("work", 2), "lp[1]/")]
    out = plan(doc(loop(max_iterations=2)), run(), journal, NOW)
    assert only(out.actions, Close).output == 2


def test_a_failed_iteration_fails_the_loop() -> None:
    journal = [row("lp", "loop"), at(failed("work", "fatal"), "lp[0]/")]
    out = plan(doc(loop(max_iterations=3)), run(), journal, NOW)
    assert only(out.actions, Finish).error["step"] == "work"


def test_composite_rows_do_not_count_towards_max_steps() -> None:
    journal = [row("lp", "loop"), at(ok("work", 1), "lp[0]/")]
    out = plan(doc(loop(max_iterations=3), limits={"max_steps": 2}), run(), journal, NOW)
    assert only(out.actions, Schedule).path == "lp[1]/"


def test_a_body_of_one_step_in_a_list_is_that_step() -> None:
    out = plan(doc(each("${input.xs}", [task("work")])), run(input={"xs": [1]}), [], NOW)
    assert only(out.actions, Schedule).path == "fan[0]/"


def test_a_body_of_several_steps_runs_as_an_anonymous_child_with_its_scope() -> None:
    body = [task("a", input="${item}"), task("b")]
    out = plan(
        doc(task("pre"), each("${input.xs}", body)),
        run(input={"xs": [7, 8]}),
        [ok("pre", "P")],
        NOW,
    )
    children = [o for o in out.of(Open) if o.kind == "subworkflow"]
    assert [(o.step_id, o.path, o.status) for o in children] == [
        ("_body", "fan[0]/", "waiting"),
        ("_body", "fan[1]/", "waiting"),
    ]
    start = children[1].start
    assert start["body"] == "fan.do"
    scope = start["input"]
    assert (scope["item"], scope["index"], scope["default"]) == (8, 1, 8)
    assert scope["steps"]["pre"]["output"] == "P" and scope["input"] == {"xs": [7, 8]}


def test_a_body_run_plans_its_steps_in_its_parents_scope() -> None:
    scope = {
        "input": {"t": 1},
        "steps": {"pre": {"output": "P", "status": "succeeded", "error": None}},
        "item": {"n": 5},
        "index": 3,
        "default": {"n": 5},
    }
    body = doc(
        task("a", input={"i": "${item.n}", "at": "${index}", "pre": "${steps.pre.output}"}),
        task("b"),
    )
    out = plan(body, run(scope=scope, input=scope), [], NOW)
    assert only(out.actions, Schedule).input == {"i": 5, "at": 3, "pre": "P"}
    out = plan(body, run(scope=scope, input=scope), [ok("a", "A")], NOW)
    assert only(out.actions, Schedule).input == "A"
    out = plan(body, run(scope=scope, input=scope), [ok("a", "A"), ok("b", "B")], NOW)
    assert only(out.actions, Finish).output == "B"


def test_a_failed_body_run_fails_its_container_naming_the_inner_step() -> None:
    child = {
        "id": "c",
        "status": "failed",
        "error": {"class": "fatal", "message": "x", "step": "b"},
    }
    journal = [
        row("lp", "loop"),
        at(in_flight("_body", status="waiting", kind="subworkflow", child=child), "lp[0]/"),
    ]
    out = plan(doc(loop([task("a"), task("b")], max_iterations=2)), run(), journal, NOW)
    finish = only(out.actions, Finish)
    assert (finish.error["class"], finish.error["step"]) == ("fatal", "b")
