"""Subworkflows in the database: engine-only children (waits), so no worker is needed."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from runs import services
from runs.engine.advance import run_advance
from runs.engine.plan import Close, Open, plan
from runs.models import AdvanceRequest, Run
from workflows.services import definition_save

from .test_plan import NOW, doc, in_flight, only, run, task

pytestmark = pytest.mark.django_db


def save(workflow: str, *steps: dict[str, Any], **top: Any) -> int:
    return definition_save(document={"id": workflow, "steps": list(steps), **top}).version.number


def wait(step_id: str = "gate", key: str = "${input.key}") -> dict:
    return {"id": step_id, "kind": "wait_event", "event": "go", "key": key}


def sub(step_id: str = "child", workflow: str = "inner", **more: Any) -> dict:
    return {"id": step_id, "kind": "subworkflow", "workflow": workflow, **more}


def fresh(run_obj: Run) -> Run:
    return Run.objects.get(id=run_obj.id)


def notify_parents() -> None:
    """What the advance messages sent on commit do: advance every run that asked."""
    for run_id in list(AdvanceRequest.objects.values_list("run_id", flat=True)):
        run_advance(run_id=run_id)


# --- the planner ------------------------------------------------------------------------------


def test_a_subworkflow_opens_a_waiting_row_that_starts_its_child_with_the_input() -> None:
    out = plan(doc(sub(input={"key": "${input.k}"}, version=2)), run(input={"k": "a"}), [], NOW)
    opened = only(out.actions, Open)
    assert (opened.kind, opened.status) == ("subworkflow", "waiting")
    assert opened.start == {"workflow": "inner", "version": 2, "input": {"key": "a"}}
    assert out.waiting


@pytest.mark.parametrize(
    ("child", "closed", "error_class"),
    [
        ({"id": "c", "status": "running"}, None, None),
        ({"id": "c", "status": "completed", "output": 7}, "succeeded", None),
        (
            {"id": "c", "status": "failed", "error": {"class": "fatal", "message": "x"}},
            "failed",
            "fatal",
        ),
        (
            {"id": "c", "status": "timed_out", "error": {"class": "timeout", "message": "late"}},
            "timed_out",
            "timeout",
        ),
        (
            {
                "id": "c",
                "status": "cancelled",
                "error": {"class": "cancelled", "message": "by ann"},
            },
            "failed",
            "cancelled",
        ),
    ],
)
def test_the_childs_end_is_the_steps_end(
    child: dict, closed: str | None, error_class: str | None
) -> None:
    journal = [in_flight("child", status="waiting", kind="subworkflow", child=child)]
    out = plan(doc(sub(), task("after")), run(), journal, NOW)
    if closed is None:
        assert out.actions == [] and out.waiting
        return
    close = only(out.actions, Close)
    assert close.status == closed
    if error_class:
        assert close.error["class"] == error_class and "child run c" in close.error["message"]
    else:
        assert close.output == 7


# --- with the database ------------------------------------------------------------------------


def test_a_child_runs_pinned_and_linked_and_its_output_is_the_steps() -> None:
    save("inner", wait(), output={"got": "${steps.gate.output}"})
    save("inner", wait(), {"id": "nap", "kind": "sleep", "ms": 1})  # a later version
    save("outer", sub(version=1, input={"key": "${input.key}"}), output="${steps.child.output}")
    parent = services.run_start(workflow="outer", input={"key": "k1"}).run
    assert fresh(parent).status == "waiting"
    child = Run.objects.get(parent_run=parent)
    assert (child.version.number, child.status, child.input) == (1, "waiting", {"key": "k1"})
    assert child.parent_step_run == parent.steps.get(step_id="child")
    assert services.event_send(name="go", key="k1", payload=5)[1] == 1
    assert fresh(child).status == "completed"
    notify_parents()
    parent = fresh(parent)
    assert (parent.status, parent.output) == ("completed", {"got": 5})


def test_a_failed_child_fails_the_step_with_the_childs_class() -> None:
    save("inner", {"id": "bad", "kind": "sleep_until", "until": "no time"})
    save("outer", sub(), task("never"))
    parent = services.run_start(workflow="outer", input={}).run
    assert Run.objects.get(parent_run=parent).status == "failed"
    notify_parents()
    parent = fresh(parent)
    assert (parent.status, parent.error["class"], parent.error["step"]) == (
        "failed",
        "invalid_input",
        "child",
    )


def test_a_failed_child_with_continue_lets_the_parent_go_on() -> None:
    save("inner", {"id": "bad", "kind": "sleep_until", "until": "no time"})
    save("outer", sub(on_error="continue"), output="${steps.child.status}")
    parent = services.run_start(workflow="outer", input={}).run
    notify_parents()
    assert (fresh(parent).status, fresh(parent).output) == ("completed", "failed")


def test_cancelling_the_parent_cancels_children_and_grandchildren() -> None:
    save("leaf", wait())
    save("middle", sub(workflow="leaf", input={"key": "x"}))
    save("outer", sub(workflow="middle"))
    parent = services.run_start(workflow="outer", input={}).run
    middle = Run.objects.get(parent_run=parent)
    leaf = Run.objects.get(parent_run=middle)
    assert leaf.status == "waiting"
    services.run_cancel(run_id=parent.id)
    assert {fresh(r).status for r in (parent, middle, leaf)} == {"cancelled"}
    assert services.event_send(name="go", key="x")[1] == 0  # nothing waits any more


def test_a_child_cancelled_on_its_own_fails_the_parents_step() -> None:
    save("inner", wait())
    save("outer", sub(input={"key": "x"}))
    parent = services.run_start(workflow="outer", input={}).run
    services.run_cancel(run_id=Run.objects.get(parent_run=parent).id)
    notify_parents()
    parent = fresh(parent)
    assert (parent.status, parent.error["class"]) == ("failed", "cancelled")


def test_a_parent_that_fails_cancels_its_running_children() -> None:
    from datetime import timedelta

    from django.utils import timezone

    from runs.engine import timers
    from runs.models import StepRun, Timer

    save("inner", wait())
    timeout = {"id": "late", "kind": "wait_event", "event": "never", "timeout_ms": 60_000}
    save(
        "outer",
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"slow": sub(input={"key": "x"}), "t": timeout},
        },
    )
    parent = services.run_start(workflow="outer", input={}).run
    child = Run.objects.get(parent_run=parent)
    assert child.status == "waiting"
    past = timezone.now() - timedelta(seconds=1)
    StepRun.objects.filter(run=parent, step_id="late").update(not_before=past)
    Timer.objects.filter(run=parent, purpose="wait_timeout").update(fire_at=past)
    timers.fire_due()
    assert (fresh(parent).status, fresh(parent).error["step"]) == ("failed", "late")
    assert fresh(child).status == "cancelled"
    assert StepRun.objects.get(run=parent, step_id="child").status == "cancelled"


def test_a_child_not_yet_started_when_its_sibling_fails_at_once_is_never_started() -> None:
    save("inner", wait())
    bad = {"id": "bad", "kind": "sleep_until", "until": "nope"}
    save("outer", {"id": "par", "kind": "parallel", "branches": {"slow": sub(), "bad": bad}})
    parent = services.run_start(workflow="outer", input={}).run
    assert fresh(parent).status == "failed"
    assert not Run.objects.filter(parent_run=parent).exists()


def test_the_api_shows_children_and_the_parent(api: APIClient) -> None:
    save("inner", wait())
    save("outer", sub(input={"key": "x"}))
    parent = services.run_start(workflow="outer", input={}).run
    child = Run.objects.get(parent_run=parent)
    body = api.get(f"/api/v1/runs/{parent.id}").json()
    assert [c["id"] for c in body["children"]] == [str(child.id)]
    child_body = api.get(f"/api/v1/runs/{child.id}").json()
    assert child_body["parent"] == {"run": str(parent.id), "step": "child"}


# --- bodies of several steps: anonymous child runs --------------------------------------------


def test_a_foreach_body_of_several_steps_runs_each_item_as_a_child_run() -> None:
    body = [
        {"id": "gate_item", "kind": "wait_event", "event": "go", "key": "${item}"},
        {"id": "nap", "kind": "sleep", "ms": 0, "input": "${steps.gate_item.output}"},
    ]
    save("bulk", {"id": "fan", "kind": "foreach", "items": "${input.keys}", "do": body})
    parent = services.run_start(workflow="bulk", input={"keys": ["a", "b"]}).run
    children = list(Run.objects.filter(parent_run=parent).order_by("created_at"))
    assert [(c.body, c.status) for c in children] == [("fan.do", "waiting"), ("fan.do", "waiting")]
    assert children[0].input["item"] == "a" and children[1].input["index"] == 1
    assert services.event_send(name="go", key="b", payload="B")[1] == 1
    assert services.event_send(name="go", key="a", payload="A")[1] == 1
    notify_parents()
    parent = fresh(parent)
    # The body's output is its last step's (a sleep: null); order is the items'.
    assert (parent.status, parent.output) == ("completed", [None, None])
    assert {c.steps.count() for c in children} == {2}
    assert parent.steps.filter(path__startswith="fan[").count() == 2  # the parent stays flat


def test_three_levels_foreach_subworkflow_parallel_with_a_wait_at_the_bottom() -> None:
    deepest = {
        "id": "both",
        "kind": "parallel",
        "branches": {
            "wait": {"id": "deep_wait", "kind": "wait_event", "event": "go", "key": "${input.key}"},
            "nap": {"id": "deep_nap", "kind": "sleep", "ms": 0},
        },
    }
    save("bottom", deepest, output="${steps.both.output.wait}")
    save(
        "top",
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.keys}",
            "do": sub("mid", workflow="bottom", input={"key": "${item}"}),
        },
    )
    parent = services.run_start(workflow="top", input={"keys": ["k1", "k2"]}).run
    mids = Run.objects.filter(parent_run=parent)
    assert mids.count() == 2 and {m.status for m in mids} == {"waiting"}
    assert services.event_send(name="go", key="k2", payload=2)[1] == 1
    assert services.event_send(name="go", key="k1", payload=1)[1] == 1
    notify_parents()
    parent = fresh(parent)
    assert (parent.status, parent.output) == ("completed", [1, 2])


def test_a_loop_body_of_several_steps_sees_iter_and_ends_by_until() -> None:
    body = [
        {"id": "one", "kind": "sleep", "ms": 0},
        {"id": "two", "kind": "sleep_until", "until": 0, "input": "${iter.index}"},
    ]
    until = {"path": "iter.index", "op": "gte", "value": 2}
    save("looping", {"id": "lp", "kind": "loop", "max_iterations": 5, "until": until, "do": body})
    parent = services.run_start(workflow="looping", input={}).run
    for _ in range(5):
        notify_parents()
    parent = fresh(parent)
    assert parent.status == "completed"
    assert Run.objects.filter(parent_run=parent, body="lp.do").count() == 3


def test_a_child_version_gone_since_the_save_fails_the_step_clearly() -> None:
    from workflows.models import WorkflowVersion

    save("inner", wait())
    save("outer", sub(version=1))
    WorkflowVersion.objects.filter(workflow_id="inner").delete()
    parent = services.run_start(workflow="outer", input={}).run
    row = parent.steps.get(step_id="child")
    assert row.status == "failed" and "version 1 does not exist" in row.error["message"]
    notify_parents()
    parent = fresh(parent)
    assert (parent.status, parent.error["step"]) == ("failed", "child")
