"""One bad run never stalls the others (issue 36): the reconciler, the clock tick and
retention do each run's work on its own (runs.engine.isolation). A poison run is logged with
its id, counted, marked and skipped for a back-off, and every other run's repair still happens.

The poison is one no regex fix cures: a run waiting in a step whose journal row names a kind
this engine no longer has (a plug-in's app removed from INSTALLED_APPS after its runs started;
here the row's kind is rewritten by SQL). Every plan of that run raises; before, each
reconciler tick raised there, and its later parts (concurrency admissions, missed events,
cost releases, the approvals' repairs) ran for nobody.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client import REGISTRY

from runs import services
from runs.engine import isolation
from runs.engine.plan import wait_key
from runs.engine.reconcile import reconcile
from runs.engine.timers import fire_due
from runs.models import Event, Run, RunAction, RunFault, StepRun, Timer
from runs.retention import retention_purge
from workflows.services import definition_save

from .factories import RunFactory, StepRunFactory
from .refusals import refuse

pytestmark = pytest.mark.django_db

NAPPER = {"id": "napper", "steps": [{"id": "nap", "kind": "sleep", "ms": 120_000}]}
WAITER = {
    "id": "waiter",
    "steps": [{"id": "hear", "kind": "wait_event", "event": "go", "key": "k"}],
}
QUEUED = {
    "id": "queued",
    "concurrency": {"limit": 1},
    "steps": [{"id": "hold", "kind": "wait_event", "event": "never", "key": "${input.n}"}],
}
HOUR_AGO = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _documents() -> None:
    for document in (NAPPER, WAITER, QUEUED):
        definition_save(document=document)


def failures(pass_name: str) -> float:
    return REGISTRY.get_sample_value("djflow_pass_failures_total", {"pass": pass_name}) or 0.0


def napping(*, due: bool, poison: bool = False) -> Run:
    """A run asleep in its one step; ``due``: its sleep is over (its timer due, unfired) and
    it has been quiet an hour; ``poison``: its journal row names a kind no longer known."""
    run = services.run_start(workflow="napper", input={}).run
    nap = StepRun.objects.get(run=run, step_id="nap")
    assert nap.status == "waiting"
    if due:
        past = timezone.now() - HOUR_AGO
        StepRun.objects.filter(id=nap.id).update(not_before=past)
        Timer.objects.filter(run=run, purpose="sleep").update(fire_at=past)
        # The poison quietest: the first the reconciler's stuck runs find.
        quiet = past - timedelta(minutes=1 if poison else 0)
        Run.objects.filter(id=run.id).update(updated_at=quiet)
    if poison:
        # Its attempt failed with an error that is a bare JSON string, not an object (a row
        # written by hand, or by another release); the run's advance after it was lost.
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {StepRun._meta.db_table} SET status = 'failed', error = %s::jsonb,"
                " finished_at = now() WHERE id = %s",
                ['"the handler raised"', nap.id],
            )
        Run.objects.filter(id=run.id).update(status="running")
    return run


def marks(run: Run) -> list[dict[str, Any]]:
    return list(
        RunAction.objects.filter(run=run, action=isolation.PASS_FAILED).values_list(
            "detail", flat=True
        )
    )


def status(run: Run) -> str:
    run.refresh_from_db()
    return run.status


# --- the reconciler --------------------------------------------------------------------------


def test_a_poison_run_is_marked_and_skipped_and_every_other_repair_still_happens(caplog) -> None:
    poison = napping(due=True, poison=True)
    stuck = napping(due=True)
    # A concurrency admission: the holder's slot freed without its end's admission.
    holder = services.run_start(workflow="queued", input={"n": "0"}).run
    waiting = services.run_start(workflow="queued", input={"n": "1"}).run
    assert waiting.admitted_at is None
    Run.objects.filter(id=holder.id).update(status="cancelled")
    # A missed event: stored while the delivery that would resume the wait died.
    listener = services.run_start(workflow="waiter", input={}).run
    Event.objects.create(name="go", key="k", wait_key=wait_key("go", "k"), payload={"ok": 1})
    # A cost hold of an attempt whose worker was lost mid-call.
    lost = StepRunFactory(
        run=RunFactory(status="failed"), status="failed", reserved_usd=Decimal("0.25")
    )
    # A lost message: an attempt left scheduled an hour.
    unsent = StepRunFactory(status="scheduled", scheduled_at=timezone.now() - HOUR_AGO)
    before = failures("reconcile.advance")

    with caplog.at_level(logging.ERROR, logger="runs.engine.isolation"):
        counts = reconcile(budget_seconds=30)

    # The others: each repaired, in every part after the one the poison failed in.
    assert status(stuck) == "completed"
    waiting.refresh_from_db()
    assert waiting.admitted_at is not None and counts["admitted"] == 1
    assert status(listener) == "completed" and counts["missed_events"] == 1
    lost.refresh_from_db()
    assert (lost.reserved_usd, lost.cost_usd) == (0, Decimal("0.25"))
    assert counts["reservations_released"] == 1
    unsent.refresh_from_db()
    assert unsent.scheduled_at > timezone.now() - timedelta(minutes=1)
    assert {"mails_reoffered", "reminders_restored"} <= set(counts)
    # The poison: logged with its id, counted, marked with the pass and why, not advanced.
    assert status(poison) == "running"
    assert any(str(poison.id) in record.getMessage() for record in caplog.records)
    assert failures("reconcile.advance") == before + 1
    (mark,) = marks(poison)
    assert mark["pass"] == "reconcile.advance" and mark["failures"] == 1
    assert mark["error"].startswith("ValueError")
    fault = RunFault.objects.get(run=poison)
    assert fault.pass_name == "reconcile.advance" and fault.failures == 1
    assert fault.retry_at > timezone.now() + timedelta(seconds=290)

    # The next tick leaves it alone (its back-off), whatever it looks like.
    Run.objects.filter(id=poison.id).update(updated_at=timezone.now() - HOUR_AGO)
    reconcile(budget_seconds=30)
    assert len(marks(poison)) == 1 and failures("reconcile.advance") == before + 1

    # Past the back-off it is tried again, and fails again: twice as long now.
    RunFault.objects.filter(id=fault.id).update(retry_at=timezone.now() - timedelta(seconds=1))
    reconcile(budget_seconds=30)
    fault.refresh_from_db()
    assert fault.failures == 2 and len(marks(poison)) == 2
    assert fault.retry_at > timezone.now() + timedelta(seconds=590)
    assert failures("reconcile.advance") == before + 2


def test_an_operators_resume_clears_the_marks_and_the_passes_try_the_run_at_once() -> None:
    poison = napping(due=True, poison=True)
    reconcile(budget_seconds=30)
    assert RunFault.objects.filter(run=poison).count() == 1
    services.run_pause(run_id=poison.id)
    services.run_resume(run_id=poison.id)
    # Taken up again: no back-off left, and a failure now counts from one, not two.
    assert not RunFault.objects.filter(run=poison).exists()
    Run.objects.filter(id=poison.id).update(updated_at=timezone.now() - HOUR_AGO)
    reconcile(budget_seconds=30)
    assert RunFault.objects.get(run=poison).failures == 1
    assert len(marks(poison)) == 2


def test_the_marks_are_on_the_runs_resource(api) -> None:
    poison = napping(due=True, poison=True)
    reconcile(budget_seconds=30)
    body = api.get(f"/api/v1/runs/{poison.id}").json()
    (action,) = [a for a in body["actions"] if a["action"] == "pass_failed"]
    assert action["by"] is None and action["detail"]["pass"] == "reconcile.advance"


def test_a_part_that_fails_as_a_whole_is_counted_and_the_parts_after_it_run(monkeypatch) -> None:
    from runs.engine import reconcile as module

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the part's own query")

    monkeypatch.setattr(module.delivery, "match_missed", broken)
    before = failures("reconcile.missed_events")
    lost = StepRunFactory(
        run=RunFactory(status="failed"), status="failed", reserved_usd=Decimal("0.5")
    )
    counts = reconcile(budget_seconds=30)
    assert counts["missed_events"] == 0 and counts["reservations_released"] == 1
    assert failures("reconcile.missed_events") == before + 1
    lost.refresh_from_db()
    assert lost.reserved_usd == 0


def test_a_transient_database_error_is_counted_but_not_marked(caplog) -> None:
    from django.db import OperationalError

    run = RunFactory()
    isolation.record_failure("reconcile.advance", run.id, OperationalError("deadlock detected"))
    assert not RunFault.objects.filter(run=run).exists() and marks(run) == []
    # A run deleted meanwhile: logged, nothing marked, nothing raised.
    gone = RunFactory()
    gone_id = gone.id
    gone.delete()
    isolation.record_failure("retention", gone_id, ValueError("x"))
    assert not RunFault.objects.filter(run_id=gone_id).exists()


# --- the clock -------------------------------------------------------------------------------


def test_the_tick_fires_every_due_timer_and_advances_the_others_past_a_poison_run() -> None:
    poison = napping(due=True, poison=True)
    others = [napping(due=True) for _ in range(3)]
    before = failures("timers.advance")
    fired = fire_due(budget_seconds=5)
    assert fired == 4
    assert [status(run) for run in others] == ["completed"] * 3
    assert status(poison) == "running"
    assert failures("timers.advance") == before + 1
    (mark,) = marks(poison)
    assert mark["pass"] == "timers.advance"
    unfired = Timer.objects.filter(fired_at__isnull=True, run__in=[poison, *others])
    assert not unfired.filter(purpose="sleep").exists()


# --- retention -------------------------------------------------------------------------------


def test_retention_deletes_every_other_tree_and_marks_one_it_cannot_delete() -> None:
    old = timezone.now() - timedelta(days=40)
    ended = [RunFactory(status="completed", created_at=old, finished_at=old) for _ in range(3)]
    poison = ended[1]
    StepRunFactory(run=poison)
    # The database refuses to delete the poison's journal (a rule a DBA left, say).
    refuse(table=StepRun._meta.db_table, event="DELETE", column="run_id", value=poison.id)
    before = failures("retention")
    report = retention_purge(older_than={"completed": timedelta(days=30)})
    assert set(Run.objects.values_list("id", flat=True)) == {poison.id}
    assert report.deleted["runs.Run"] == 2
    assert failures("retention") == before + 1
    (mark,) = marks(poison)
    assert mark["pass"] == "retention" and "refused by a trigger" in mark["error"]
    # The next pass leaves it alone for its back-off.
    retention_purge(older_than={"completed": timedelta(days=30)})
    assert failures("retention") == before + 1 and len(marks(poison)) == 1
