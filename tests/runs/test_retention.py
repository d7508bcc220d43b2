"""Retention (runs.retention, ``manage.py purge``, the ``runs.purge_expired`` beat entry,
``DJFLOW_RETENTION_DAYS``): only ended run trees past their age are deleted, whole, with
every row that refers to them; nothing of a run still going; a dry run deletes nothing and
counts what the deletion would. The beat entry on real processes is in
tests/runs/test_bulk_e2e.py."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import models
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from approvals.models import ApprovalRequest, Approver, Decision, Mail, Notification
from approvals.services import Origin, approval_decide
from config.settings import _ENDED, _retention_days
from runs import beat, retention, services, tasks
from runs.models import (
    AdvanceRequest,
    Content,
    Event,
    ModelCall,
    Run,
    RunAction,
    StepRun,
    Timer,
    ToolCall,
)
from runs.status import RUN_TERMINAL, RunStatus, StepStatus
from workflows import access

from ..approvals.builders import approver, make_user, start_approval
from ..moves import unchecked
from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory

DAY = timedelta(days=1)


def _age(run_ids: list[Any], days: float) -> None:
    """Make these runs as old as ``days`` days: created then, ended a second later."""
    when = timezone.now() - timedelta(days=days)
    with unchecked():
        Run.objects.filter(id__in=run_ids).update(
            created_at=when, started_at=when, finished_at=when + timedelta(seconds=1)
        )


def _content(text: str) -> Content:
    return Content.objects.create(digest=text.ljust(64, "0"), body={"text": text}, size=len(text))


def _calls(step: StepRun, prompt: Content, reply: Content) -> None:
    ModelCall.objects.create(
        step_run=step, run=step.run, provider="openai", model="m", prompt=prompt, reply=reply,
        status="ok",
    )  # fmt: skip
    ToolCall.objects.create(
        step_run=step, run=step.run, server="s", tool="t", arguments=prompt, result=reply,
        status="ok",
    )  # fmt: skip


@pytest.fixture
def version(db):
    return WorkflowVersionFactory()


@pytest.fixture
def world(version) -> dict[str, Any]:
    """An old cancelled approval run (steps, request, approvers, a decision, mails, actions,
    a model and a tool call, a fired timer, an advance request, a notification, a taken event)
    with a subworkflow child and grandchild, one of them known only by its parent; and the
    runs retention must keep: an old tree whose child is still running, an old run still
    going, a child that ended long ago under a root still going, a recent completed run."""
    ann, ben = make_user("ann"), make_user("ben")
    old, request = start_approval(users=["ann", "ben"], quorum=2)
    approval_decide(request_id=request.id, decision="approved", origin=Origin("api"), user=ann)
    access.grant("operator", "expense", user=ben)
    services.run_cancel(run_id=old.id, user=ben)
    step = StepRun.objects.filter(run=old).first()
    assert step is not None
    shared, own = _content("shared"), _content("own")
    _calls(step, shared, own)
    Timer.objects.create(run=old, step_run=step, purpose="sleep", key="k", fire_at=timezone.now(),
                         fired_at=timezone.now(), fires=1)  # fmt: skip
    AdvanceRequest.objects.create(run=old)
    notice = Notification.objects.create(user=ann, kind="handoff", title="t", run=old,
                                         step_run=step)  # fmt: skip
    event = Event.objects.create(name="e", key="k", wait_key="w",
                                 created_at=timezone.now() - 60 * DAY)  # fmt: skip
    with unchecked():
        StepRun.objects.filter(id=step.id).update(event=event)
    sub = StepRunFactory(run=old, step_id="sub", kind="subworkflow", status=StepStatus.CANCELLED)
    child = RunFactory(version=version, status=RunStatus.CANCELLED, parent_run=old,
                       parent_step_run=sub, root_run=old)  # fmt: skip
    StepRunFactory(run=child)
    # Written before root_run existed: only its parent says whose tree it is.
    grandchild = RunFactory(version=version, status=RunStatus.COMPLETED, parent_run=child)
    StepRunFactory(run=grandchild)

    live_tree = RunFactory(version=version, status=RunStatus.COMPLETED)
    live_child = RunFactory(version=version, status=RunStatus.RUNNING, parent_run=live_tree,
                            root_run=live_tree)  # fmt: skip
    still_going = RunFactory(version=version, status=RunStatus.WAITING)
    StepRunFactory(run=still_going, status=StepStatus.WAITING)
    ended_under_live = RunFactory(version=version, status=RunStatus.COMPLETED,
                                  parent_run=still_going, root_run=still_going)  # fmt: skip
    StepRunFactory(run=ended_under_live)
    kept_calls = StepRunFactory(run=still_going, step_id="draft")
    _calls(kept_calls, shared, _content("kept"))
    recent = RunFactory(version=version, status=RunStatus.COMPLETED)
    StepRunFactory(run=recent)
    _age([old.id, child.id, grandchild.id], 40)
    _age([live_tree.id, live_child.id, still_going.id, ended_under_live.id], 40)
    _age([recent.id], 5)
    return {
        "deleted": [old, child, grandchild],
        "kept": [live_tree, live_child, still_going, ended_under_live, recent],
        "request": request,
        "approver": approver(request, "ann"),
        "notice": notice,
        "event": event,
        "shared": shared,
        "own": own,
    }


def _purge(**kwargs: Any) -> retention.PurgeReport:
    return retention.retention_purge(
        older_than=dict.fromkeys(RUN_TERMINAL, 30 * DAY), batch=kwargs.pop("batch", 2), **kwargs
    )


def _rows_of(run_ids: list[Any]) -> Counter[str]:
    """Every row that refers to these runs (or to their steps, requests, approvers)."""
    found: Counter[str] = Counter()
    for model, lookup in [
        (Run, "id__in"),
        (StepRun, "run_id__in"),
        (Timer, "run_id__in"),
        (RunAction, "run_id__in"),
        (AdvanceRequest, "run_id__in"),
        (ModelCall, "run_id__in"),
        (ToolCall, "run_id__in"),
        (ApprovalRequest, "run_id__in"),
        (Approver, "request__run_id__in"),
        (Decision, "request__run_id__in"),
        (Mail, "approver__request__run_id__in"),
        (Notification, "run_id__in"),
        (Notification, "step_run__run_id__in"),
    ]:
        found[model._meta.label] += model.objects.filter(**{lookup: run_ids}).count()
    return +found


def test_only_ended_trees_past_their_age_go_with_every_row_of_theirs(world) -> None:
    deleted = [run.id for run in world["deleted"]]
    kept = [run.id for run in world["kept"]]
    before = _rows_of(deleted)
    assert {"approvals.Decision", "approvals.Mail", "runs.ModelCall", "runs.Timer"} <= set(before)
    kept_before = _rows_of(kept)

    report = _purge()

    assert report.runs == 3
    assert report.kept_live == 1  # the old tree with a running child
    assert _rows_of(deleted) == Counter()
    # Nothing of a run still going, nor of a tree with one: the same rows as before.
    assert _rows_of(kept) == kept_before
    assert Run.objects.filter(id__in=kept).count() == len(kept)
    # The report names every model it deleted rows of.
    assert report.deleted["runs.StepRun"] == before["runs.StepRun"]
    assert report.deleted["approvals.Decision"] == 1
    assert report.deleted["approvals.Approver"] == 2
    # A notification is its recipient's: kept, its run link cleared (on_delete=SET_NULL).
    world["notice"].refresh_from_db()
    assert (world["notice"].run_id, world["notice"].step_run_id) == (None, None)
    # A stored prompt another run's call refers to stays; the deleted run's own goes.
    assert Content.objects.filter(digest=world["shared"].digest).exists()
    assert not Content.objects.filter(digest=world["own"].digest).exists()
    assert report.deleted["runs.Content"] == 1
    # The taken event arrived before every live run started: nothing can take it again.
    assert not Event.objects.filter(id=world["event"].id).exists()
    # Again: nothing left to delete.
    assert _purge().runs == 0


def test_a_dry_run_deletes_nothing_and_counts_what_the_purge_deletes(world) -> None:
    everything = {m._meta.label: m.objects.count() for m in apps.get_models()}
    dry = _purge(dry_run=True)
    assert {m._meta.label: m.objects.count() for m in apps.get_models()} == everything
    world["notice"].refresh_from_db()
    assert world["notice"].run_id is not None
    assert dry.runs == 3
    assert _purge().deleted == dry.deleted


def test_statuses_have_ages_of_their_own(version) -> None:
    completed = RunFactory(version=version, status=RunStatus.COMPLETED)
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    _age([completed.id, failed.id], 40)
    report = retention.retention_purge(
        older_than={RunStatus.COMPLETED: 30 * DAY, RunStatus.FAILED: 90 * DAY}
    )
    assert report.runs == 1
    assert list(Run.objects.all()) == [failed]


def test_age_counts_from_the_end_not_the_start(version) -> None:
    """A run that waited 60 days for a person and ended yesterday is one day old."""
    run = RunFactory(version=version, status=RunStatus.COMPLETED)
    with unchecked():
        Run.objects.filter(id=run.id).update(
            created_at=timezone.now() - 60 * DAY, finished_at=timezone.now() - DAY
        )
    assert _purge().runs == 0


def test_a_run_revived_before_its_batch_is_kept(version) -> None:
    run = RunFactory(version=version, status=RunStatus.FAILED)
    _age([run.id], 40)
    with unchecked():  # a retry, between the choice of candidates and their lock
        Run.objects.filter(id=run.id).update(status=RunStatus.RUNNING)
    report = retention.PurgeReport()
    retention._purge_batch([run.id], RunStatus.FAILED, timezone.now() - 30 * DAY, report,
                           dry_run=False)  # fmt: skip
    assert report.runs == 0
    assert Run.objects.filter(id=run.id).exists()


def test_a_batch_holds_whole_trees_up_to_its_runs_and_the_next_goes_on_from_there(
    version, monkeypatch
) -> None:
    monkeypatch.setattr(retention, "MAX_RUNS_PER_BATCH", 4)
    roots = []
    for _ in range(4):
        root = RunFactory(version=version, status=RunStatus.COMPLETED)
        for _ in range(2):
            RunFactory(version=version, status=RunStatus.COMPLETED, parent_run=root,
                       root_run=root)  # fmt: skip
        roots.append(root.id)
    _age(list(Run.objects.values_list("id", flat=True)), 40)
    batches = []
    real = retention._delete_runs
    monkeypatch.setattr(
        retention, "_delete_runs", lambda ids: batches.append(len(ids)) or real(ids)
    )
    report = _purge(batch=10)
    # Four trees of three runs: one tree per transaction (two would be six runs), none missed.
    assert (report.runs, batches) == (12, [3, 3, 3, 3])
    assert not Run.objects.exists()


def test_an_event_a_live_run_could_still_take_is_kept(version) -> None:
    event = Event.objects.create(name="e", key="k", wait_key="w")
    old = RunFactory(version=version, status=RunStatus.COMPLETED)
    StepRunFactory(run=old, kind="wait_event", event=event)
    _age([old.id], 40)
    waiting = RunFactory(version=version, status=RunStatus.WAITING)
    with unchecked():
        Run.objects.filter(id=waiting.id).update(created_at=event.created_at - DAY)
    assert _purge().runs == 1
    assert Event.objects.filter(id=event.id).exists()


def test_only_ended_statuses_may_be_given(version) -> None:
    with pytest.raises(ValueError, match="running is not an ended status"):
        retention.retention_purge(older_than={RunStatus.RUNNING: DAY})


def test_every_foreign_key_to_a_run_is_one_retention_handles() -> None:
    """Each relation that points at a run, a step run, or a row the purge deletes by
    cascade must let the purge through: CASCADE or SET_NULL, or a PROTECT the purge clears
    on purpose (a run tree's own links; an approval's decisions, by its hook). A new model
    that protects one of them must be handled in runs.retention, or this fails."""
    handled = {
        ("runs.Run", "parent_run"),
        ("runs.Run", "root_run"),
        ("approvals.Decision", "request"),
        ("approvals.Decision", "approver"),
    }
    deleted = {"runs.Run"}
    seen: set[str] = set()
    protected: list[tuple[str, str, str]] = []
    while deleted - seen:
        label = sorted(deleted - seen)[0]
        seen.add(label)
        for relation in apps.get_model(label)._meta.related_objects:
            if not relation.one_to_many and not relation.one_to_one:
                continue
            source = relation.related_model._meta.label
            on_delete = relation.on_delete
            if on_delete is models.CASCADE:
                deleted.add(source)
            elif on_delete is not models.SET_NULL and (
                (source, relation.field.name) not in handled
            ):
                protected.append((source, relation.field.name, on_delete.__name__))
    assert protected == []
    assert {"runs.StepRun", "approvals.ApprovalRequest", "approvals.Mail"} <= deleted


# --- the setting, the beat entry, the task, the command ------------------------------------


@pytest.mark.parametrize(
    ("value", "days"),
    [
        ("", {}),
        ("  ", {}),
        ("30", dict.fromkeys(_ENDED, 30)),
        ("completed=30,failed=90", {"completed": 30, "failed": 90}),
        (" completed = 30 , cancelled=7 ", {"completed": 30, "cancelled": 7}),
    ],
)
def test_retention_days_setting(value: str, days: dict[str, int]) -> None:
    assert _retention_days(value) == days


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("0", "the age"),
        ("-3", "the age"),
        ("thirty", "the age"),
        ("running=3", "'running' is not an ended status"),
        ("completed=30,failed", "failed must be a whole number"),
        ("completed=1.5", "completed must be a whole number"),
    ],
)
def test_a_bad_retention_days_setting_refuses_to_start(value: str, named: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=named):
        _retention_days(value)


def test_the_settings_ended_statuses_are_the_engines() -> None:
    assert set(_ENDED) == set(RUN_TERMINAL)


def test_the_beat_entry_is_installed(db) -> None:
    entry = PeriodicTask.objects.get(name=beat.RETENTION)
    assert (entry.task, entry.queue, entry.enabled) == ("runs.purge_expired", "default", True)
    assert (entry.interval.every, entry.interval.period) == (3600, "seconds")


def test_the_task_purges_by_the_setting_and_does_nothing_without_it(version, settings) -> None:
    run = RunFactory(version=version, status=RunStatus.COMPLETED)
    _age([run.id], 40)
    settings.DJFLOW = {**settings.DJFLOW, "RETENTION_DAYS": {}}
    assert tasks.purge_expired() == {}
    settings.DJFLOW = {**settings.DJFLOW, "RETENTION_DAYS": {"failed": 30}}
    assert tasks.purge_expired() == {}
    settings.DJFLOW = {**settings.DJFLOW, "RETENTION_DAYS": {"completed": 30}}
    assert tasks.purge_expired()["runs.Run"] == 1
    assert not Run.objects.exists()


def _purge_command(*args: str) -> list[str]:
    out = StringIO()
    call_command("purge", *args, stdout=out)
    return out.getvalue().splitlines()


def test_the_purge_command_prints_what_it_would_delete_then_deletes_it(version) -> None:
    completed = RunFactory(version=version, status=RunStatus.COMPLETED)
    StepRunFactory(run=completed)
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    running = RunFactory(version=version, status=RunStatus.RUNNING)
    _age([completed.id, failed.id, running.id], 10)

    dry = _purge_command("--older-than", "7", "--status", "completed", "--dry-run")
    assert dry == [
        "would delete 1 run(s) (completed) older than 7 day(s)",
        "  runs.Run: 1",
        "  runs.StepRun: 1",
    ]
    assert Run.objects.count() == 3
    assert _purge_command("--older-than", "30")[0].startswith("deleted 0 run(s)")
    done = _purge_command("--older-than", "7")
    assert (
        done[0] == "deleted 2 run(s) (cancelled, completed, failed, timed_out) older than 7 day(s)"
    )
    assert list(Run.objects.all()) == [running]


def test_the_purge_command_refuses_bad_arguments(db) -> None:
    with pytest.raises(CommandError, match="--older-than"):
        _purge_command("--older-than", "-1")
    with pytest.raises(CommandError, match="invalid choice: 'running'"):
        _purge_command("--older-than", "1", "--status", "running")
    with pytest.raises(CommandError, match="--batch"):
        _purge_command("--older-than", "1", "--batch", "0")
