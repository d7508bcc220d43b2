"""Apply a plan: the only writer of runs and step runs for the engine's decisions.

Called with the run row locked (``SELECT ... FOR UPDATE``) inside one transaction; every
message it causes is sent on commit, and every timer it sets is a row written in the same
transaction. Step-run changes are conditional updates on the source status, so an attempt a
worker completed, a canceller closed or an event delivery resumed meanwhile is left as that
writer left it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from workflows import secrets

from .. import dispatch, vault
from ..models import Run, StepRun, Timer, TimerPurpose
from ..status import RunStatus, StepStatus, check_run_move
from . import ending
from . import plan as p
from .store import insert_attempt, request_advance, update_run

IN_FLIGHT = [StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING]
OPEN = [StepStatus.RUNNING, StepStatus.WAITING]


@dataclass
class Applied:
    # A lone new attempt left for the caller to run (see ``hold``).
    held: StepRun | None = None
    # wait_event rows opened by this plan: the caller looks for an event already there.
    waits: list[StepRun] = field(default_factory=list)
    # A row this plan opened was ended at once by what opening it found (a hand-off sent,
    # an approval whose approvers do not resolve): the caller plans again.
    replan: bool = False


def apply_plan(
    run: Run, planned: p.Plan, now: datetime, *, hold: bool = False, budget: Any = None
) -> Applied:
    """Write ``planned`` for ``run`` (locked by the caller) and queue its messages. A child run
    it starts is planned in the same transaction while ``budget`` (an ``advance.Budget``)
    lasts, else handed to an advance task.

    With ``hold``, a lone new attempt is not offered but returned: the caller (a worker that
    just finished the previous step) runs it itself. Should that worker die first, the
    attempt stays ``scheduled`` and the reconciler offers it after ``LOST_MESSAGE_SECONDS``.
    """
    applied = Applied()
    fields: set[str] = set()
    timers: list[Timer] = []
    schedules: list[p.Schedule] = []
    for action in planned.actions:
        if isinstance(action, p.StartRun):
            if run.status == RunStatus.PENDING:
                check_run_move(run.status, RunStatus.RUNNING)
                run.status = RunStatus.RUNNING
                fields.add("status")
            run.started_at, run.deadline_at = action.started_at, action.deadline_at
            fields |= {"started_at", "deadline_at"}
            timers.append(
                Timer(
                    run=run,
                    purpose=TimerPurpose.RUN_DEADLINE,
                    key=f"deadline:{run.generation}:{action.deadline_at.isoformat()}",
                    fire_at=action.deadline_at,
                )
            )
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
            opened = _open(run, action, now)
            ended_here = (
                action.kind in (p.APPROVAL, p.HANDOFF)
                and action.status in OPEN
                and _open_people(run, opened, now)
            )
            applied.replan |= ended_here
            if action.timer is not None and action.not_before is not None and not ended_here:
                timers.append(
                    Timer(
                        run=run,
                        step_run=opened,
                        purpose=action.timer,
                        key=f"{action.timer}:{opened.id}",
                        fire_at=action.not_before,
                    )
                )
            if action.kind == "wait_event" and action.status == StepStatus.WAITING:
                applied.waits.append(opened)
            if action.start is not None:
                _start_child(run, opened, action.start, budget)
        elif isinstance(action, p.Close):
            closed = StepRun.objects.filter(id=action.attempt_id, status__in=OPEN).update(
                status=action.status, output=action.output, error=action.error, finished_at=now
            )
            if closed and action.status == StepStatus.TIMED_OUT:
                # An approval past its deadline: the request expires (escalation goes out).
                from approvals import gates

                gates.expire(action.attempt_id, now)
        elif isinstance(action, p.Cancel):
            _cancel(action.attempt_ids, now)
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
            timers.append(Timer(run=run, purpose=action.purpose, key=action.key, fire_at=action.at))
        elif isinstance(action, p.Finish):
            _finish(run, action, now)
            fields |= {"status", "output", "error", "finished_at"}
    if planned.finish is None:
        _show_waiting(run, planned, fields)
    if timers and planned.finish is None:
        # The same journal planned twice asks for the same keys: one row each.
        Timer.objects.bulk_create(timers, ignore_conflicts=True)
    run_changes = {name: getattr(run, name) for name in sorted(fields)}
    if run_changes:
        run.updated_at = now
        run_changes["updated_at"] = now
    inserted = []
    for index, action in enumerate(schedules):
        # The run's own changes ride on the last insert (one statement on Postgres).
        last = index == len(schedules) - 1
        inserted.append(_schedule(run, action, now, run_changes if last else None))
    if hold and len(inserted) == 1:
        applied.held = inserted[0]
    elif len(inserted) == 1:
        dispatch.offer_on_commit(inserted[0], workflow_id=run.workflow_id)
    elif inserted:
        # Branches and items fanned out together go as one chord whose body is an advance:
        # a notification only, since every attempt's completion advances the run itself.
        dispatch.offer_chord_on_commit(inserted, run_id=run.id, workflow_id=run.workflow_id)
    if run_changes and not schedules:
        update_run(run.id, run_changes)
    return applied


def _cancel(attempt_ids: tuple[int, ...], now: datetime) -> None:
    from approvals import gates

    doomed = StepRun.objects.filter(id__in=attempt_ids, status__in=IN_FLIGHT)
    task_ids = list(doomed.exclude(celery_task_id="").values_list("celery_task_id", flat=True))
    _cancel_children(doomed.filter(kind="subworkflow"), "its subworkflow step was cancelled")
    gates.cancel(doomed.filter(kind=p.APPROVAL).values_list("id", flat=True), now)
    doomed.update(status=StepStatus.CANCELLED, finished_at=now, claim=None)
    dispatch.revoke_on_commit(task_ids)


def _open_people(run: Run, opened: StepRun, now: datetime) -> bool:
    """Open an approval's request, or send a hand-off's notifications (``approvals.gates``).
    True when the row ended here and the run must be planned again: a hand-off always
    (it never blocks), an approval when its approvers do not resolve (the step fails)."""
    from approvals import gates

    if opened.kind == p.APPROVAL:
        error = gates.open_request(run, opened, now)
    else:
        error = gates.handoff(run, opened)
    if error is None and opened.kind == p.APPROVAL:
        return False
    ended = (
        {"status": StepStatus.FAILED, "error": error} if error else {"status": StepStatus.SUCCEEDED}
    )
    StepRun.objects.filter(id=opened.id, status__in=OPEN).update(finished_at=now, **ended)
    return True


def _start_child(run: Run, step_run: StepRun, start: Any, budget: Any) -> None:
    """Start a subworkflow's child run, pinned to its version, linked to the step run, and
    plan its first step in this transaction (as ``run_start`` does) while the caller's
    planning budget lasts; past it, an advance task plans the child.

    Planned here, a subworkflow calling itself recursed until Python's stack ran out: every
    start of a self-call was a 500. The chain's depth (at most 8, see plan) and the budget
    bound it now."""
    from workflows.models import WorkflowVersion

    from .advance import Budget, advance_locked

    if "body" in start:
        # An anonymous child: the parent's own version, running one body of it.
        workflow_id, version, body = run.workflow_id, run.version, start["body"]
    else:
        version = WorkflowVersion.objects.resolve(start["workflow"], start.get("version"))
        workflow_id, body = start["workflow"], ""
    if version is None:
        # Validation at save refuses an unknown workflow; one deleted since fails the step.
        message = (
            f"subworkflow '{start['workflow']}' version "
            f"{start.get('version') or 'latest'} does not exist"
        )
        _fail_start(run, step_run, message)
        return
    # The child's input carries the parent's tokens (resolved from its templates): it holds
    # the parent's secrets too, plus what its own input_schema marks.
    schema = version.document.get("input_schema") if not body else None
    try:
        inherited = vault.decrypt(run.secrets, run_id=run.id)
    except vault.SecretsUnreadable as error:
        _fail_start(run, step_run, str(error))
        return
    if not body:
        # The child stands for a start of its workflow: its input meets that workflow's
        # input_schema, as POST /runs requires (else a step could hand the workflow's
        # handlers what its schema refuses). Not retryable: the same input fails again.
        # Checked on the real values; the message shows none of them.
        from ..services import input_errors

        problems = input_errors(version, secrets.reveal(start["input"], inherited))
        if problems:
            mask = secrets.masker(secrets.plaintexts(inherited))
            detail = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
            message = f"subworkflow '{workflow_id}' refuses this input: {mask(detail)}"
            _fail_start(run, step_run, message, error_class=p.INVALID_INPUT)
            return
    child_input, registry = vault.seal_input(schema, start["input"], inherited)
    child = Run.objects.create(
        workflow_id=workflow_id,
        version=version,
        body=body,
        input=child_input,
        secrets=vault.encrypt(registry) if registry != inherited else run.secrets,
        parent_run=run,
        parent_step_run=step_run,
        created_by_id=run.created_by_id,
        correlation=run.correlation,
        root_run_id=run.root_run_id or run.id,
        depth=run.depth if "body" in start else run.depth + 1,
    )
    budget = budget if budget is not None else Budget()
    if budget.actions > 0:
        advance_locked(child, budget=budget)
    elif request_advance(child.id):
        dispatch.advance_on_commit(child.id)


def _fail_start(run: Run, step_run: StepRun, message: str, *, error_class: str = "fatal") -> None:
    StepRun.objects.filter(id=step_run.id, status=StepStatus.WAITING).update(
        status=StepStatus.FAILED,
        finished_at=timezone.now(),
        error={"class": error_class, "message": message},
    )
    if request_advance(run.id):
        dispatch.advance_on_commit(run.id)


def _cancel_children(rows: Any, reason: str) -> None:
    """Cancel, transitively, the child runs of these subworkflow step runs."""
    ending.cancel_children(rows, reason=reason, now=timezone.now())


HELD = (RunStatus.RUNNING, RunStatus.WAITING, RunStatus.PENDING_APPROVAL)


def _show_waiting(run: Run, planned: p.Plan, fields: set[str]) -> None:
    """``waiting`` while only sleeps and waits hold the run (no process is alive for it),
    ``pending_approval`` when an approval is among them, ``running`` again once anything is
    scheduled or due."""
    if run.status not in HELD:
        return  # pending (not started), paused: an operator's status stays
    if not planned.waiting:
        target = RunStatus.RUNNING
    elif planned.approval:
        target = RunStatus.PENDING_APPROVAL
    else:
        target = RunStatus.WAITING
    if target == run.status:
        return
    check_run_move(run.status, target)
    # The parent shows pending_approval while a child waits for people: let it look.
    people = RunStatus.PENDING_APPROVAL in (run.status, target)
    if people and run.parent_run_id is not None and request_advance(run.parent_run_id):
        dispatch.advance_on_commit(run.parent_run_id)
    run.status = target
    fields.add("status")


def _open(run: Run, action: p.Open, now: datetime) -> StepRun:
    done = action.status in (StepStatus.SUCCEEDED, StepStatus.FAILED)
    return StepRun.objects.create(
        run=run,
        step_id=action.step_id,
        path=action.path,
        kind=action.kind,
        attempt=action.attempt,
        generation=action.generation,
        status=action.status,
        branch=action.branch,
        input=action.input,
        output=action.output,
        error=dict(action.error) if action.error else None,
        not_before=action.not_before,
        wait_key=action.wait_key,
        scheduled_at=now,
        started_at=now,
        finished_at=now if done else None,
    )


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
    # Nothing may go on once the run has ended: see ending.end_run.
    ending.end_run(run, action.status, now=now, output=action.output, error=action.error)
