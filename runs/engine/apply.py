"""Apply a plan: the only writer of runs and step runs for the engine's decisions.

Called with the run row locked (``SELECT ... FOR UPDATE``) inside one transaction; every
message it causes is sent on commit. Step-run changes are conditional updates on the
source status, so an attempt a worker completed or a canceller closed meanwhile is left as
that writer left it.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from .. import dispatch
from ..models import Run, StepRun
from ..status import RunStatus, StepStatus, check_run_move
from . import plan as p
from .store import insert_attempt

IN_FLIGHT = [StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING]


def apply_plan(run: Run, planned: p.Plan, now: datetime) -> None:
    """Write ``planned`` for ``run`` (locked by the caller) and queue its messages."""
    fields: set[str] = set()
    wake: datetime | None = None
    offers: list[StepRun] = []
    for action in planned.actions:
        if isinstance(action, p.StartRun):
            if run.status == RunStatus.PENDING:
                check_run_move(run.status, RunStatus.RUNNING)
                run.status = RunStatus.RUNNING
                fields.add("status")
            run.started_at, run.deadline_at = action.started_at, action.deadline_at
            fields |= {"started_at", "deadline_at"}
        elif isinstance(action, p.Schedule):
            offers.append(_schedule(run, action, now))
            run.attempts += 1
            fields.add("attempts")
        elif isinstance(action, p.Skip):
            StepRun.objects.create(
                run=run,
                step_id=action.step_id,
                path=action.path,
                kind=action.kind,
                attempt=1,
                generation=action.generation,
                status=StepStatus.SKIPPED,
                scheduled_at=now,
                finished_at=now,
            )
        elif isinstance(action, p.Open):
            done = action.status == StepStatus.SUCCEEDED
            StepRun.objects.create(
                run=run,
                step_id=action.step_id,
                path=action.path,
                kind=action.kind,
                attempt=action.attempt,
                generation=action.generation,
                status=action.status,
                branch=action.branch,
                output=action.output,
                scheduled_at=now,
                started_at=now,
                finished_at=now if done else None,
            )
        elif isinstance(action, p.Close):
            StepRun.objects.filter(id=action.attempt_id, status=StepStatus.RUNNING).update(
                status=action.status, output=action.output, error=action.error, finished_at=now
            )
        elif isinstance(action, p.Expire):
            task_ids = list(
                StepRun.objects.filter(id=action.attempt_id).values_list(
                    "celery_task_id", flat=True
                )
            )
            changed = StepRun.objects.filter(
                id=action.attempt_id, status=StepStatus.RUNNING
            ).update(status=action.status, error=action.error, finished_at=now, claim=None)
            if changed:
                dispatch.revoke_on_commit(task_ids)
        elif isinstance(action, p.Wake):
            wake = action.at if wake is None else min(wake, action.at)
        elif isinstance(action, p.Finish):
            _finish(run, action, now)
            fields |= {"status", "output", "error", "finished_at"}
    if run.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.TIMED_OUT):
        wake = None
    elif run.deadline_at is not None:
        # Look at the run again at its deadline even if no message ever comes.
        wake = run.deadline_at if wake is None else min(wake, run.deadline_at)
    if wake != run.wake_at:
        run.wake_at = wake
        fields.add("wake_at")
    if fields:
        run.save(update_fields=[*sorted(fields), "updated_at"])
    for step_run in offers:
        dispatch.offer_on_commit(step_run, workflow_id=run.workflow_id)


def _schedule(run: Run, action: p.Schedule, now: datetime) -> StepRun:
    step_run = StepRun(
        run=run,
        step_id=action.step_id,
        path=action.path,
        kind=action.kind,
        attempt=action.attempt,
        generation=action.generation,
        status=StepStatus.SCHEDULED,
        input=action.input,
        effect=action.effect,
        queue=action.queue,
        timeout_ms=action.timeout_ms,
        # Stable across the retries of one step in one run (contract section 5).
        idempotency_key=f"{run.id}:{action.path}:{action.step_id}",
        celery_task_id=str(uuid.uuid4()),
        scheduled_at=now,
    )
    step_run.id = insert_attempt(
        {
            field.name: getattr(step_run, field.attname)
            for field in StepRun._meta.concrete_fields
            if not field.primary_key
        }
    )
    return step_run


def _finish(run: Run, action: p.Finish, now: datetime) -> None:
    check_run_move(run.status, action.status)
    run.status = action.status
    run.output = action.output
    run.error = dict(action.error) if action.error else None
    run.finished_at = now
    # Nothing may go on once the run has ended: attempts still offered or running are
    # cancelled (a running body's result will be refused), open engine rows closed.
    in_flight = StepRun.objects.filter(run=run, status__in=IN_FLIGHT)
    task_ids = list(in_flight.exclude(celery_task_id="").values_list("celery_task_id", flat=True))
    ended = StepStatus.FAILED if action.status != RunStatus.COMPLETED else StepStatus.CANCELLED
    in_flight.filter(kind="condition").update(status=ended, finished_at=now)
    in_flight.update(status=StepStatus.CANCELLED, finished_at=now, claim=None)
    dispatch.revoke_on_commit(task_ids)
