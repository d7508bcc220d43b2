"""Apply a plan: the only writer of runs and step runs for the engine's decisions.

Called with the run row locked (``SELECT ... FOR UPDATE``) inside one transaction; every
message it causes is sent on commit. Step-run changes are conditional updates on the
source status, so an attempt a worker completed or a canceller closed meanwhile is left as
that writer left it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from .. import dispatch
from ..models import Run, StepRun
from ..status import RunStatus, StepStatus, check_run_move
from . import plan as p
from .store import insert_attempt, update_run

IN_FLIGHT = [StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING]


def apply_plan(run: Run, planned: p.Plan, now: datetime, *, hold: bool = False) -> StepRun | None:
    """Write ``planned`` for ``run`` (locked by the caller) and queue its messages.

    With ``hold``, a lone new attempt is not offered but returned: the caller (a worker that
    just finished the previous step) runs it itself. Should that worker die first, the
    attempt stays ``scheduled`` and the sweep offers it after ``LOST_MESSAGE_SECONDS``.
    """
    held: StepRun | None = None
    fields: set[str] = set()
    wake: datetime | None = None
    schedules: list[p.Schedule] = []
    for action in planned.actions:
        if isinstance(action, p.StartRun):
            if run.status == RunStatus.PENDING:
                check_run_move(run.status, RunStatus.RUNNING)
                run.status = RunStatus.RUNNING
                fields.add("status")
            run.started_at, run.deadline_at = action.started_at, action.deadline_at
            fields |= {"started_at", "deadline_at"}
        elif isinstance(action, p.Schedule):
            schedules.append(action)
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
    run_changes = {name: getattr(run, name) for name in sorted(fields)}
    if run_changes:
        run.updated_at = now
        run_changes["updated_at"] = now
    for index, action in enumerate(schedules):
        # The run's own changes ride on the last insert (one statement on Postgres).
        last = index == len(schedules) - 1
        step_run = _schedule(run, action, now, run_changes if last else None)
        if hold and len(schedules) == 1:
            held = step_run
        else:
            dispatch.offer_on_commit(step_run, workflow_id=run.workflow_id)
    if run_changes and not schedules:
        update_run(run.id, run_changes)
    return held


def _schedule(
    run: Run, action: p.Schedule, now: datetime, run_changes: dict[str, Any] | None
) -> StepRun:
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
        },
        run_id=run.id,
        run_changes=run_changes,
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
