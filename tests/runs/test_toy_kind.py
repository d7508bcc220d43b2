"""A worker kind registered from one test module (``tests.runs.flows_toy_kind``), nothing
else edited: documents with it validate, the planner schedules it with the kind's own
defaults, and a real worker runs it end to end.

The module is imported by the fixture, never at collection: the kind is registered in this
process only while a test of this file runs."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from runs import services
from runs.engine.plan import AttemptView, RunView, plan
from runs.models import Run, StepRun
from tests.processes import wait_for
from workflows import kinds
from workflows.errors import InvalidDocument
from workflows.services import definition_save
from workflows.validation import prepare_document

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
TOY = "tests.runs.flows_toy_kind"


@pytest.fixture(autouse=True)
def shout() -> Iterator[kinds.Kind]:
    """Registered for the test only: other tests see the built-in kinds alone."""
    kind = importlib.import_module(TOY).SHOUT
    kinds.register(kind)
    yield kind
    kinds.unregister("shout")


def _document(**step: object) -> dict:
    return {"id": "toy_doc", "steps": [{"id": "loud", "kind": "shout", **step}]}


def test_a_registered_kind_validates_with_its_own_fields() -> None:
    prepare_document(_document(times=3))
    with pytest.raises(InvalidDocument) as refused:
        prepare_document(_document(times=9))
    assert [e.field for e in refused.value.errors] == ["steps[0].times"]
    with pytest.raises(InvalidDocument) as refused:
        prepare_document(_document(times=1, loudness=3))
    assert "loudness" in str([e.message for e in refused.value.errors])


def test_an_unregistered_kind_is_refused_at_save() -> None:
    kinds.unregister("shout")
    with pytest.raises(InvalidDocument) as refused:
        prepare_document(_document(times=1))
    assert [e.field for e in refused.value.errors] == ["steps[0].kind"]


@pytest.mark.django_db
def test_the_planner_schedules_it_on_a_worker_with_the_kinds_defaults() -> None:
    definition_save(document=_document(times=1))
    run = services.run_start(workflow="toy_doc", input={"text": "hi"}).run
    [row] = StepRun.objects.filter(run=run)
    assert (row.kind, row.status, row.input) == ("shout", "scheduled", {"text": "hi"})


def test_a_real_worker_runs_the_kind_end_to_end_and_retries_by_its_default(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=[TOY])
    celery_beat()  # the retry's back-off is a timer
    definition_save(
        document={
            "id": "toy_kind",
            "limits": {"run_timeout_ms": 60_000},
            "steps": [{"id": "loud", "kind": "shout", "times": 2, "input": "${input}"}],
        }
    )
    runs = [
        services.run_start(workflow="toy_kind", input={"text": "hey"}).run,
        services.run_start(workflow="toy_kind", input={"text": "oh", "stumble": True}).run,
    ]

    def ended() -> list[Run] | None:
        found = [Run.objects.get(id=run.id) for run in runs]
        return found if all(run.status in TERMINAL for run in found) else None

    plain, stumbled = wait_for(ended, timeout=30, interval=0.1, message=celery_processes.logs)
    assert plain.status == "completed", plain.error
    assert plain.output == {"text": "HEY HEY", "attempt": 1}
    # No retry policy in the document: the kind's default of two attempts applies.
    assert stumbled.status == "completed", stumbled.error
    assert stumbled.output == {"text": "OH OH", "attempt": 2}
    attempts = StepRun.objects.filter(run=stumbled).order_by("attempt")
    assert [(r.attempt, r.status) for r in attempts] == [(1, "failed"), (2, "succeeded")]


def test_the_readmes_kind_works_pasted_as_written(shout: kinds.Kind) -> None:
    """The docs' "Add a step kind" block, run as written, registers a kind that documents
    may use and whose body does what the page says."""
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "add-a-step-kind.md"
    [block] = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    kinds.unregister("shout")
    exec(compile(block, str(page), "exec"), {})
    kind = kinds.get("shout")
    assert kind is not None and kind is not shout
    prepare_document(_document(times=2))
    body = kind.body({"id": "loud", "kind": "shout", "times": 2}, "toy_doc")
    assert body(None, {"text": "hi"}, None) == {"text": "HI HI"}


@pytest.mark.parametrize(
    ("role", "hooks", "missing"),
    [
        (kinds.Role.WORKER, {}, "needs a body"),
        (kinds.Role.WAIT, {"due": lambda step, row: None}, "needs open"),
        (kinds.Role.WAIT, {"open": lambda step, scope: None}, "needs due"),
        (kinds.Role.PEOPLE, {}, "needs open"),
        (kinds.Role.CHILD, {}, "needs open"),
    ],
)
def test_a_kind_without_the_hooks_its_role_needs_is_refused_when_declared(
    role: kinds.Role, hooks: dict, missing: str
) -> None:
    with pytest.raises(ValueError, match=missing):
        kinds.Kind("half", role, **hooks)
    assert kinds.get("half") is None


def test_a_wait_of_a_kind_no_longer_registered_fails_the_run_naming_it() -> None:
    """A waiting row whose kind's module is gone from this process would wait until the run's
    deadline with nothing to end it: the run fails at once as unsupported, naming the kind."""
    kinds.register(
        kinds.Kind(
            "nap",
            kinds.Role.WAIT,
            open=lambda step, scope: kinds.Opening("waiting", not_before=scope.after(60_000)),
            due=lambda step, row: kinds.Ending("succeeded"),
        )
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)
    view = RunView(
        id="r", status="running", input=None, correlation=None, generation=1,
        started_at=now, deadline_at=now + timedelta(minutes=5),
    )  # fmt: skip
    document = {"id": "naps", "steps": [{"id": "rest", "kind": "nap"}]}
    try:
        [opened] = plan(document, view, [], now).actions
        assert (opened.kind, opened.status) == ("nap", "waiting")
    finally:
        kinds.unregister("nap")
    row = AttemptView(id=1, step_id="rest", attempt=1, status="waiting", kind="nap")
    finish = plan(document, view, [row], now + timedelta(seconds=1)).finish
    assert finish is not None and finish.status == "failed"
    assert finish.error == {
        "class": "unsupported",
        "message": "step kind 'nap' is not registered",
        "step": "rest",
    }
