"""a worker that goes on with the run's next step claims it in the transaction that
records the step before (f500e45). When that transaction's commit went through but its
acknowledgment was lost (the connection dropped during COMMIT), ``_record`` tries again,
finds the attempt recorded ("dropped") and forgets the next attempt it had claimed: the
attempt stays ``running`` with no body running, until its lease lapses and it is failed as
lost. An ``at_most_once`` step so fails its run without ever having run. Before f500e45 the
held attempt stayed ``scheduled`` and the reconciler offered it again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone

from runs import services
from runs.engine import journal
from runs.engine.advance import run_advance
from runs.models import StepRun
from workers import execution
from workflows.sdk import handler, workflow
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)

RAN: list[str] = []


@handler("review_chain.note")
def note(ctx: Any, input: Any, prior: Any) -> str:
    RAN.append(ctx.step_id)
    return ctx.step_id


def test_a_lost_commit_acknowledgment_does_not_strand_the_claimed_next_step(settings, monkeypatch):
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_MAX_STEPS": 50, "CHECK_PREFIX": False}
    journal.forget_prefixes()
    RAN.clear()
    flow = workflow("review_chain", limits={"run_timeout_ms": 3_600_000})
    flow.task("first", handler="review_chain.note")
    flow.task("charge", handler="review_chain.note", effect="at_most_once")
    definition_save(document=flow.document())
    run = services.run_start(workflow="review_chain", input={}).run
    first = StepRun.objects.get(run=run, step_id="first")

    real = execution._record_once
    calls = []

    def commit_acknowledgment_lost(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)  # committed, 'charge' claimed for this task
        calls.append(result)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return result

    monkeypatch.setattr(execution, "_record_once", commit_acknowledgment_lost)
    execution.execute(first.id, worker="in-process")

    # The retry found 'first' recorded and nothing to run; 'charge', claimed by the commit
    # it could not be sure of, is handed back (its body never ran), not left running until
    # its lease lapses and the at_most_once step fails as lost.
    charge = StepRun.objects.get(run=run, step_id="charge")
    assert (charge.status, charge.claim, RAN) == ("scheduled", None, ["first"])
    StepRun.objects.filter(id=charge.id).update(scheduled_at=timezone.now() - timedelta(hours=1))
    run_advance(run_id=run.id)
    run.refresh_from_db()
    assert run.status == "running", run.error
    monkeypatch.setattr(execution, "_record_once", real)
    execution.execute(charge.id, worker="in-process")
    run.refresh_from_db()
    assert (run.status, RAN) == ("completed", ["first", "charge"])
