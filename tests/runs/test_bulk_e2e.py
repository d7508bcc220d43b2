"""Bulk cancel and retention on real worker and beat processes, over real HTTP.

One test walks both (the processes start once): 1,000 waiting runs cancelled by one
``POST /api/v1/runs/cancel``, batch by batch by a worker (after a starter's bulk cancel has
touched only their own runs), each audited as the caller's; then the retention beat entry
deletes the ended runs past their age, with every row of theirs, and nothing of a run still
going."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.db import transaction
from django.utils import timezone
from rest_framework.authtoken.models import Token

from runs import services
from runs.models import BulkAction, Run, RunAction, StepRun
from runs.status import RunStatus
from tests.processes import wait_for
from workflows import access
from workflows.services import definition_save

from ..moves import unchecked
from ..test_access import person

pytestmark = [pytest.mark.slow]

WAITS = {
    "id": "bulk_wait",
    "steps": [{"id": "gate", "kind": "wait_event", "event": "go", "key": "${input.n}"}],
}
RUNS = 1000


class Api:
    """A user's API client over real HTTP, against the live server."""

    def __init__(self, live_server: Any, user: Any) -> None:
        token, _ = Token.objects.get_or_create(user=user)
        self.base = live_server.url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Token {token.key}"

    def get(self, path: str) -> requests.Response:
        return self.session.get(f"{self.base}{path}", timeout=30)

    def post(self, path: str, body: Any) -> requests.Response:
        return self.session.post(f"{self.base}{path}", json=body, timeout=30)


def _finished(action_id: str, logs: Any, timeout: float = 120) -> BulkAction:
    def done() -> BulkAction | None:
        action = BulkAction.objects.get(id=action_id)
        return action if action.finished_at is not None else None

    return wait_for(done, timeout=timeout, interval=0.2, message=logs)


def test_a_bulk_cancel_of_1000_runs_by_a_worker_then_retention_by_beat(
    user, live_server, celery_worker, celery_beat, celery_processes
) -> None:
    definition_save(document=WAITS)
    definition_save(document={**WAITS, "id": "other_wait"})
    bob = person("bob")
    access.grant("starter", "bulk_wait", user=bob)
    began = time.monotonic()
    with transaction.atomic():  # one commit, not a thousand: the set-up, not the test
        ours = [
            services.run_start(workflow="bulk_wait", input={"n": str(n)}, user=user).run.id
            for n in range(RUNS)
        ]
    started_in = time.monotonic() - began
    bobs = [
        services.run_start(workflow="bulk_wait", input={"n": f"b{n}"}, user=bob).run.id
        for n in range(3)
    ]
    others = [
        services.run_start(workflow="other_wait", input={"n": str(n)}, user=user).run.id
        for n in range(5)
    ]
    assert set(Run.objects.values_list("status", flat=True)) == {RunStatus.WAITING}
    worker = celery_worker(
        env={"DJFLOW_BULK_BATCH": "100", "DJFLOW_RETENTION_DAYS": "cancelled=30,completed=30"}
    )
    logs = celery_processes.logs

    # A starter's bulk cancel: only the runs they started (they operate no one else's).
    answer = Api(live_server, bob).post("/api/v1/runs/cancel", {"workflow": "bulk_wait"})
    assert answer.status_code == 202, answer.text
    assert answer.json()["affected"] == 3
    _finished(answer.json()["id"], logs)
    assert set(Run.objects.filter(id__in=bobs).values_list("status", flat=True)) == {"cancelled"}
    assert Run.objects.filter(id__in=ours, status=RunStatus.WAITING).count() == RUNS

    # The operator's: every waiting run of the workflow, a batch of 100 per transaction.
    asked = time.monotonic()
    answer = Api(live_server, user).post("/api/v1/runs/cancel", {"workflow": "bulk_wait"})
    answered_in = time.monotonic() - asked
    assert answer.status_code == 202, answer.text
    assert answer.json()["affected"] == RUNS
    action = _finished(answer.json()["id"], logs)
    cancelled_in = time.monotonic() - asked
    assert (action.affected, action.done, action.skipped) == (RUNS, RUNS, 0)
    assert action.batches == RUNS // 100 + 1  # the last finds none left
    assert Run.objects.filter(id__in=ours, status=RunStatus.CANCELLED).count() == RUNS
    assert not StepRun.objects.filter(run_id__in=ours).exclude(status="cancelled").exists()
    audit = RunAction.objects.filter(run_id__in=ours)
    assert audit.count() == RUNS
    assert set(audit.values_list("action", "actor", "actor_name")) == {("cancel", user.id, "ada")}
    assert {row["bulk"] for row in audit.values_list("detail", flat=True)} == {str(action.id)}
    assert audit.filter(created_at__lt=action.requested_at).count() == 0
    assert set(Run.objects.filter(id__in=others).values_list("status", flat=True)) == {"waiting"}
    shown = Api(live_server, user).get(f"/api/v1/runs/bulk/{action.id}").json()
    assert (shown["affected"], shown["done"], shown["skipped"]) == (RUNS, RUNS, 0)
    print(
        f"\n{RUNS} runs started in {started_in:.1f} s; the bulk cancel answered in"
        f" {answered_in * 1000:.0f} ms and a worker cancelled them in {cancelled_in:.1f} s"
        f" ({action.batches} batches)"
    )

    # Retention: half of them and Bob's ended 40 days ago, and so did the start of an
    # other_wait run still waiting; the beat entry (every second here) deletes the ended
    # ones past 30 days, with their steps and actions, and nothing else.
    old = ours[: RUNS // 2] + bobs
    when = timezone.now() - timedelta(days=40)
    with unchecked():
        Run.objects.filter(id__in=[*old, others[0]]).update(created_at=when)
        Run.objects.filter(id__in=old).update(finished_at=when)
    celery_beat(env={"DJFLOW_RETENTION_EVERY_SECONDS": "1"})
    began = time.monotonic()
    wait_for(
        lambda: not Run.objects.filter(id__in=old).exists(), timeout=60, interval=0.2, message=logs
    )
    purged_in = time.monotonic() - began
    assert not StepRun.objects.filter(run_id__in=old).exists()
    assert not RunAction.objects.filter(run_id__in=old).exists()
    kept = ours[RUNS // 2 :]
    assert Run.objects.filter(id__in=kept).count() == len(kept)
    assert StepRun.objects.filter(run_id__in=kept).count() == len(kept)
    assert RunAction.objects.filter(run_id__in=kept).count() == len(kept)
    assert set(Run.objects.filter(id__in=others).values_list("status", flat=True)) == {"waiting"}
    assert "retention: deleted" in worker.logs()
    print(f"retention deleted {len(old)} ended runs past their age in {purged_in:.1f} s")
