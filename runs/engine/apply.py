"""Apply a plan: the only writer of runs and step runs for the engine's decisions.

Called with the run row locked (``SELECT ... FOR UPDATE``) inside one transaction; every
message it causes is sent on commit, and every timer it sets is a row written in the same
transaction. Step-run changes are conditional updates on the source status, so an attempt a
worker completed, a canceller closed or an event delivery resumed meanwhile is left as that
writer left it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from workflows import kinds, secrets
from workflows.inputs import input_errors
from workflows.kinds import Role
from workflows.models import WorkflowVersion
from workflows.queues import version_queue_errors
from workflows.templates import encoded_size

from .. import dispatch, vault
from ..models import Run, StepRun, Timer, TimerPurpose
from ..moves import move_steps
from ..status import (
    STEP_MOVES,
    RunStatus,
    StepStatus,
    check_run_move,
    check_step_move,
    step_sources,
)
from . import budgets, costs, ending, trees
from . import plan as p
from .sql import cursor as prepared_cursor
from .store import (
    Increment,
    LoneAttempt,
    Rider,
    insert_attempts,
    insert_lone_attempts,
    max_run_bytes,
    over_cap_error,
    prep_value,
    request_advance,
    send_riders,
    update_run,
)

IN_FLIGHT = [StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING, StepStatus.IN_DOUBT]
OPEN = [StepStatus.RUNNING, StepStatus.WAITING]
# What a planner's Close ends: an open engine row, or an in_doubt attempt past its deadline
# (each only into the statuses the table lets it take: runs.status.STEP_MOVES).
CLOSABLE = [*OPEN, StepStatus.IN_DOUBT]


@dataclass
class Applied:
    # A lone new attempt left for the caller to run (see ``hold``).
    held: StepRun | None = None
    # wait_event rows opened by this plan: the caller looks for an event already there.
    waits: list[StepRun] = field(default_factory=list)
    # A row this plan opened was ended at once by what opening it found (a hand-off sent,
    # an approval whose approvers do not resolve): the caller plans again.
    replan: bool = False
    # Child runs this plan started: the caller plans their first steps (see _start_child).
    children: list[Run] = field(default_factory=list)


class Deferred:
    """The lone attempts of several runs' plans (a batch of fired runs, ``advance_many``),
    inserted together when ``flush`` is called: one statement for the batch instead of one
    a run (``store.insert_lone_attempts``). A plan is deferred only when nothing after it in
    the transaction reads what it writes before the flush (see ``_defers``)."""

    def __init__(self) -> None:
        self.pending: list[tuple[StepRun, LoneAttempt]] = []

    def add(self, step_run: StepRun, entry: LoneAttempt) -> None:
        self.pending.append((step_run, entry))

    def flush(self) -> None:
        """Insert what was deferred; each attempt gets its id."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        ids = insert_lone_attempts([entry for _, entry in pending])
        for (step_run, _), step_run_id in zip(pending, ids, strict=True):
            step_run.id = step_run_id


def apply_plan(
    run: Run,
    planned: p.Plan,
    now: datetime,
    *,
    hold: bool = False,
    claim_as: ClaimAs | None = None,
    defer: Deferred | None = None,
    ends: ending.Ends | None = None,
) -> Applied:
    """Write ``planned`` for ``run`` (locked by the caller) and queue its messages. The child
    runs it starts are returned (``Applied.children``) for the caller to plan in the same
    transaction.

    With ``hold``, a lone new attempt is not offered but returned: the caller (a worker that
    just finished the previous step) runs it itself. Should that worker die first, the
    attempt stays ``scheduled`` and the reconciler offers it after ``LOST_MESSAGE_SECONDS``.

    ``claim_as`` (with ``hold``) is asked about that lone attempt before it is inserted: the
    fields of a claim (status ``running``, the claim, the worker, its deadline and lease)
    when the caller runs it, and it is inserted claimed, or None (inserted ``scheduled``).
    An attempt inserted and claimed in one transaction was a second statement and a second
    version of its row on every step of a sequential run.

    With ``defer`` (and ``hold``), a plan that only schedules one attempt, besides closes,
    timers and the run's own fields, leaves that attempt's insert (with the run's update
    and the riders) to ``defer``: the held attempt has no id until the caller flushes it
    (inserted claimed, too, when ``claim_as`` says so).

    With ``ends`` (a batch's), a plan that ends the run and opens nothing (``_ends_alone``)
    leaves the end's writes to ``ends`` (``ending.end_run``).
    """
    planned, stored = _within_cap(run, planned)
    writer = _Writer(run, now)
    if stored:
        # Added to the row's total, not written over it: fan-out completions add theirs
        # without the run's lock (store.charging).
        run.stored_bytes += stored
        writer.stored += stored
        writer.fields.add("stored_bytes")
    if ends is not None and _ends_alone(planned):
        writer.ends = ends
    for action in planned.actions:
        if type(action) not in _RIDERS_WAIT:
            # What this action writes or reads may depend on rows a rider changes.
            writer.send_riders()
        _WRITE[type(action)](writer, action)
    if hold and defer is not None and _defers(planned):
        return writer.defer(planned, defer, claim_as)
    return writer.done(planned, hold=hold, claim_as=claim_as if hold else None)


def _values_of(action: Any) -> list[tuple[str, Any]]:
    """The values ``action`` stores for its run, each with what it is (for the error)."""
    if isinstance(action, p.Schedule):
        return [("input", action.input)]
    if isinstance(action, p.Open):
        start = action.start or {}
        found = [("input", action.input), ("output", action.output), ("error", action.error)]
        return [*found, ("child run's input", start.get("input"))]
    if isinstance(action, p.Close):
        return [("output", action.output), ("error", action.error)]
    # Not a Finish's output: written once, at most 1 MiB (MAX_VALUE_BYTES), by the end's own
    # statement (ending.end_run), which a charge would cost a statement more on every end.
    return []


# What a plan that would pass DJFLOW_MAX_RUN_BYTES keeps besides its end: the actions that
# store no value (end_run closes whatever the dropped ones left open).
_KEPT_OVER_CAP = (p.StartRun, p.Expire, p.Cancel)


def _within_cap(run: Run, planned: p.Plan) -> tuple[p.Plan, int]:
    """``planned`` and the bytes of values it stores, when they fit in what the run may
    still store (DJFLOW_MAX_RUN_BYTES); else a plan that fails the run (class limit) naming
    the first value that would pass the cap, and stores none of them. The sizes are those
    of compact JSON, as every bound is stated (workflows.templates.encoded_size)."""
    limit = max_run_bytes()
    stored, total = run.stored_bytes, 0
    for action in planned.actions:
        for what, value in _values_of(action):
            if value is None:
                continue
            size = encoded_size(value)
            if stored + total + size > limit:
                step = getattr(action, "step_id", None)
                named = f"the {what} of step '{step}'" if step else f"the run's {what}"
                error = {**over_cap_error(named, size, stored + total), "step": step}
                kept = [a for a in planned.actions if isinstance(a, _KEPT_OVER_CAP)]
                return p.Plan(actions=[*kept, p.Finish("failed", error=error)]), 0
            total += size
    return planned, total


def _defers(planned: p.Plan) -> bool:
    """Whether the plan's writes may wait for a batch's flush: it ends nothing, schedules
    one attempt and otherwise only closes rows, sets timers and changes the run's fields
    (nothing it opens is read again in its transaction: no wait, child or hand-off), and
    plans nothing more for now (the caller would read the journal again)."""
    return (
        planned.finish is None
        and not planned.more
        and sum(type(action) is p.Schedule for action in planned.actions) == 1
        and all(type(action) in _RIDERS_WAIT for action in planned.actions)
    )


def _ends_alone(planned: p.Plan) -> bool:
    """Whether the plan's end may wait for a batch's flush: it is the plan's last action, and
    the others only close, cancel, expire or skip rows, written before it (nothing opened,
    scheduled or started that the caller would go on with after the end)."""
    if not planned.actions:
        return False
    *before, last = planned.actions
    return type(last) is p.Finish and all(type(action) in _BEFORE_AN_END for action in before)


# See apply_plan: a held attempt (not yet inserted) -> the fields of its claim, or None.
ClaimAs = Callable[[StepRun], dict[str, Any] | None]


class _Writer:
    """One plan's writes: each action's own (rows, hooks), then the run row, the timers and
    the new attempts together (see ``done``)."""

    def __init__(self, run: Run, now: datetime) -> None:
        self.run, self.now = run, now
        self.applied = Applied()
        # The run row's fields this plan changed, written once at the end.
        self.fields: set[str] = set()
        self.timers: list[Timer] = []
        self.schedules: list[p.Schedule] = []
        # Writes whose answer is not read (a sleep's close), sent with the next statement
        # (store.Rider): a fired sleep's close and its next attempt's insert are one.
        self.riders: list[Rider] = []
        # A batch's ends, when the run's end may be written with the batch's (apply_plan).
        self.ends: ending.Ends | None = None
        # Bytes of values this plan stores, added to the run's stored_bytes (_within_cap).
        self.stored = 0

    def send_riders(self) -> None:
        if self.riders:
            send_riders(self.riders)
            self.riders = []

    def start_run(self, action: p.StartRun) -> None:
        run = self.run
        if run.status == RunStatus.PENDING:
            check_run_move(run.status, RunStatus.RUNNING)
            run.status = RunStatus.RUNNING
            self.fields.add("status")
        run.started_at, run.deadline_at = action.started_at, action.deadline_at
        self.fields |= {"started_at", "deadline_at"}
        self.timers.append(
            Timer(
                run=run,
                purpose=TimerPurpose.RUN_DEADLINE,
                key=f"deadline:{run.generation}:{action.deadline_at.isoformat()}",
                fire_at=action.deadline_at,
            )
        )

    def schedule(self, action: p.Schedule) -> None:
        # Inserted in done(): the run's own changes ride on the last insert.
        self.schedules.append(action)
        self.run.attempts += 1
        self.fields.add("attempts")

    def skip(self, action: p.Skip) -> None:
        StepRun.objects.create(
            run=self.run,
            step_id=action.step_id,
            path=action.path,
            kind=action.kind,
            attempt=action.attempt,
            generation=action.generation,
            status=StepStatus.SKIPPED,
            scheduled_at=self.now,
            finished_at=self.now,
        )

    def open(self, action: p.Open) -> None:
        run, now = self.run, self.now
        opened = _open(run, action, now)
        ended_here = action.status in OPEN and _ended_on_open(run, opened, now)
        self.applied.replan |= ended_here
        if action.timer is not None and action.not_before is not None and not ended_here:
            self.timers.append(
                Timer(
                    run=run,
                    step_run=opened,
                    purpose=action.timer,
                    key=f"{action.timer}:{opened.id}",
                    fire_at=action.not_before,
                )
            )
        if action.wait_key and action.status == StepStatus.WAITING:
            self.applied.waits.append(opened)
        if action.start is not None:
            child = _start_child(run, opened, action.start, now)
            if child is not None:
                self.applied.children.append(child)

    def close(self, action: p.Close) -> None:
        kind = kinds.get(action.kind)
        hooked = action.status == StepStatus.TIMED_OUT and kind and kind.timed_out
        if connection.vendor == "postgresql" and not hooked:
            # Nothing reads whether it closed the row: it rides on the next statement.
            self.riders.append(_close_sql(action, self.now))
            return
        self.send_riders()
        closed = _close(action, self.now)
        if closed and hooked and kind and kind.timed_out:
            # An approval past its deadline: the request expires (escalation goes out).
            kind.timed_out([action.attempt_id], self.now)

    def cancel(self, action: p.Cancel) -> None:
        _cancel(action.attempt_ids, self.now)

    def expire(self, action: p.Expire) -> None:
        attempt = StepRun.objects.filter(id=action.attempt_id)
        task_ids = list(attempt.values_list("celery_task_id", flat=True))
        doubt = action.status == StepStatus.IN_DOUBT
        changed = move_steps(
            attempt,
            action.status,
            sources=[StepStatus.RUNNING],
            error=action.error,
            # An in_doubt attempt is not over: it ends when resolved or at its deadline.
            finished_at=None if doubt else self.now,
            not_before=action.not_before if doubt else None,
            claim=None,
        )
        if changed and doubt and action.not_before is not None:
            # Its deadline: a durable timer row, whose advance fails the attempt then.
            self.timers.append(
                Timer(
                    run=self.run,
                    step_run_id=action.attempt_id,
                    purpose=TimerPurpose.IN_DOUBT,
                    key=f"in_doubt:{action.attempt_id}",
                    fire_at=action.not_before,
                )
            )
        if changed:
            dispatch.revoke_on_commit(task_ids)
            # What a lost model call held is charged now, before a retry reserves.
            costs.release_expired([action.attempt_id])

    def wake(self, action: p.Wake) -> None:
        self.timers.append(
            Timer(run=self.run, purpose=action.purpose, key=action.key, fire_at=action.at)
        )

    def unblock(self, action: p.Unblock) -> None:
        # The run is planned already: the plan shows it running again.
        budgets.release_ids([action.attempt_id], advance=False)

    def finish(self, action: p.Finish) -> None:
        # The run's end is written by ending.end_run, not with the other fields.
        _finish(self.run, action, self.now, self.ends)

    def defer(self, planned: p.Plan, defer: Deferred, claim_as: ClaimAs | None = None) -> Applied:
        """``done`` for a plan that schedules one attempt (see ``_defers``), its insert left
        to ``defer``."""
        _show_waiting(self.run, planned, self.fields)
        self.write_timers()
        (action,) = self.schedules
        step_run = _attempt(self.run, action, self.now)
        _claimed_as(step_run, claim_as)
        riders, self.riders = self.riders, []
        defer.add(step_run, LoneAttempt(self.run.id, _row(step_run), self.run_changes(), riders))
        self.applied.held = step_run
        return self.applied

    def write_timers(self) -> None:
        if self.timers:
            # The same journal planned twice asks for the same keys: one row each.
            Timer.objects.bulk_create(self.timers, ignore_conflicts=True)
            # One due before the next tick: the clock wakes for it (runs.engine.timers).
            dispatch.wake_timers_on_commit(min(timer.fire_at for timer in self.timers))

    def run_changes(self) -> dict[str, Any]:
        """The run's fields this plan changed, ``updated_at`` among them when more than the
        count of attempts changed."""
        run = self.run
        changes: dict[str, Any] = {name: getattr(run, name) for name in sorted(self.fields)}
        if self.stored:
            changes["stored_bytes"] = Increment(self.stored)
        if self.fields - {"attempts", "stored_bytes"}:
            # Not for a count of attempts alone, as most steps write: updated_at is in an
            # index (the reconciler's look for idle runs), and writing it made every step's
            # run update a new version in each of the run's 17 indexes; without it the update
            # is a heap-only tuple (HOT). A run going from step to step always has an attempt
            # in flight, which the reconciler's look leaves alone however old updated_at is.
            run.updated_at = self.now
            changes["updated_at"] = self.now
        return changes

    def done(self, planned: p.Plan, *, hold: bool, claim_as: ClaimAs | None = None) -> Applied:
        run, now, applied = self.run, self.now, self.applied
        if planned.finish is None:
            _show_waiting(run, planned, self.fields)
            self.write_timers()
        elif self.schedules:
            # The plan ended the run beside what it began (a parallel step's first branch
            # scheduled, a later one past limits.max_steps): an attempt inserted now, after
            # the end closed what was in flight, would be offered and run on an ended run.
            run.attempts -= len(self.schedules)
            self.schedules = []
        run_changes = self.run_changes()
        # The run's own changes ride on the inserts (one statement for a lone attempt, one
        # per batch of a fan-out, on Postgres).
        # The riders go with the inserts, else with the run's update, else alone.
        lone = hold and len(self.schedules) == 1
        riders, self.riders = self.riders, []
        inserted: list[StepRun] = []
        if self.schedules:
            inserted = _schedule_all(
                run,
                self.schedules,
                now,
                run_changes,
                claim_as=claim_as if lone else None,
                riders=riders,
            )
        elif run_changes:
            update_run(run.id, run_changes, riders=riders)
        elif riders:
            send_riders(riders)
        if hold and len(inserted) == 1:
            applied.held = inserted[0]
        elif len(inserted) == 1:
            dispatch.offer_on_commit(inserted[0], workflow_id=run.workflow_id)
        elif inserted:
            # Branches and items fanned out together: one Celery chord, its body an advance
            # of the run (a nudge: the completions themselves ask for the fan-in's advance).
            dispatch.offer_fan_out_on_commit(inserted, run_id=run.id, workflow_id=run.workflow_id)
        return applied


# Actions that write nothing before done() (the run's fields, timers, attempts to insert,
# riders themselves): the riders wait for them. Any other sends the riders first.
_RIDERS_WAIT = frozenset({p.StartRun, p.Schedule, p.Wake, p.Close})

# What a plan whose end a batch takes (_ends_alone) may hold besides it.
_BEFORE_AN_END = frozenset({p.Close, p.Cancel, p.Expire, p.Skip, p.Wake})

# Each kind of action the planner decides, and how it is written.
_WRITE: dict[type, Callable[[_Writer, Any], None]] = {
    p.StartRun: _Writer.start_run,
    p.Schedule: _Writer.schedule,
    p.Skip: _Writer.skip,
    p.Open: _Writer.open,
    p.Close: _Writer.close,
    p.Cancel: _Writer.cancel,
    p.Expire: _Writer.expire,
    p.Wake: _Writer.wake,
    p.Unblock: _Writer.unblock,
    p.Finish: _Writer.finish,
}


def _close(action: p.Close, now: datetime) -> int:
    """Close an open row (a sleep over, a wait timed out): ``move_steps`` from OPEN, as a
    prepared statement on Postgres (every fired sleep sends it; the ORM's was planned each
    time, 0.14 ms of Postgres's time a fired run); returns whether it closed it."""
    if connection.vendor != "postgresql":
        return move_steps(
            StepRun.objects.filter(id=action.attempt_id),
            action.status,
            sources=_closable(action),
            output=action.output,
            error=action.error,
            finished_at=now,
        )
    with prepared_cursor() as cursor:
        cursor.execute(*_close_sql(action, now))
        return int(cursor.rowcount)


def _closable(action: p.Close) -> list[str]:
    return [source for source in CLOSABLE if action.status in STEP_MOVES[source]]


def _close_sql(action: p.Close, now: datetime) -> Rider:
    """The close as one conditional UPDATE (Postgres's text, bound on the server)."""
    sources = ", ".join(
        f"'{source}'" for source in sorted(step_sources(action.status, _closable(action)))
    )
    return (
        f"UPDATE {StepRun._meta.db_table} SET status = '{action.status!s}', output = %s,"
        f" error = %s, finished_at = %s WHERE id = %s AND status IN ({sources})",
        [
            prep_value("output", action.output),
            prep_value("error", action.error),
            prep_value("finished_at", now),
            action.attempt_id,
        ],
    )


def _cancel(attempt_ids: tuple[int, ...], now: datetime) -> None:
    doomed = StepRun.objects.filter(id__in=attempt_ids, status__in=IN_FLIGHT)
    left = list(doomed.values_list("id", "kind", "celery_task_id"))
    ending.let_kinds_close([(row_id, kind) for row_id, kind, _ in left], now)
    _cancel_children(
        [row_id for row_id, kind, _ in left if kinds.role_of(kind) is Role.CHILD],
        "its subworkflow step was cancelled",
    )
    move_steps(doomed, StepStatus.CANCELLED, finished_at=now, claim=None)
    dispatch.revoke_on_commit([task_id for _, _, task_id in left if task_id])


def _ended_on_open(run: Run, opened: StepRun, now: datetime) -> bool:
    """Run the ``opened`` hook of the row's kind (an approval's request opened and mailed, a
    hand-off's notices sent) in this transaction. True when the row ended here and the run
    must be planned again: a hand-off always (it never blocks), an approval when its
    approvers do not resolve (the step fails)."""
    kind = kinds.get(opened.kind)
    if kind is None or kind.opened is None:
        return False
    outcome = kind.opened(run, opened, now)
    if outcome is None:
        return False
    move_steps(
        StepRun.objects.filter(id=opened.id),
        outcome.status,
        sources=OPEN,
        output=outcome.output,
        error=outcome.error,
        finished_at=now,
    )
    return True


def _start_child(run: Run, step_run: StepRun, start: Any, now: datetime) -> Run | None:
    """Start a subworkflow's child run, pinned to its version, linked to the step run; the
    caller plans its first steps (``advance.advance_locked``, within its budget). None when
    the start failed the step instead, when the tree's root has ended (the row waits for
    the tree's sweep to end the run), or when the child waits for its tree's pace (its
    ``tree_pace`` timer plans it: ``trees``)."""
    version: WorkflowVersion | None
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
        return None
    # The child's input carries the parent's tokens (resolved from its templates): it holds
    # the parent's secrets too, plus what its own input_schema marks.
    schema = version.document.get("input_schema") if not body else None
    try:
        inherited = vault.decrypt(run.secrets, run_id=run.id)
    except vault.SecretsUnreadable as error:
        _fail_start(run, step_run, str(error))
        return None
    if not body:
        # A start of its workflow, held as POST /runs holds one: a version a person saved
        # before DJFLOW_STEP_QUEUES (or an engine queue, whoever saved it) starts nothing.
        refused = version_queue_errors(version)
        if refused:
            detail = "; ".join(f"{problem.field}: {problem.message}" for problem in refused)
            message = f"subworkflow '{workflow_id}' cannot start: {detail}"
            _fail_start(run, step_run, message, error_class=p.INVALID_INPUT)
            return None
        # The child stands for a start of its workflow: its input meets that workflow's
        # input_schema, as POST /runs requires (else a step could hand the workflow's
        # handlers what its schema refuses). Not retryable: the same input fails again.
        # Checked on the real values; the message shows none of them.
        problems = input_errors(version, secrets.reveal(start["input"], inherited))
        if problems:
            mask = secrets.masker(secrets.plaintexts(inherited))
            detail = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
            message = f"subworkflow '{workflow_id}' refuses this input: {mask(detail)}"
            _fail_start(run, step_run, message, error_class=p.INVALID_INPUT)
            return None
    # Last, so that only a start that is made counts against the tree's cap and pace.
    admission = trees.admit(run, now)
    if admission.refused is not None:
        _fail_start(run, step_run, admission.refused, error_class=p.LIMIT)
        return None
    if admission.ended:
        return None
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
        account=run.account,
        priority=run.priority,
        root_run_id=run.root_run_id or run.id,
        depth=run.depth if "body" in start else run.depth + 1,
    )
    if admission.wait_until is not None:
        Timer.objects.create(
            run=child,
            purpose=TimerPurpose.TREE_PACE,
            key=TimerPurpose.TREE_PACE,
            fire_at=admission.wait_until,
        )
        return None
    return child


def _fail_start(run: Run, step_run: StepRun, message: str, *, error_class: str = "fatal") -> None:
    move_steps(
        StepRun.objects.filter(id=step_run.id),
        StepStatus.FAILED,
        sources=[StepStatus.WAITING],
        finished_at=timezone.now(),
        error={"class": error_class, "message": message},
    )
    if request_advance(run.id):
        dispatch.advance_on_commit(run.id)


def _cancel_children(rows: Any, reason: str) -> None:
    """Cancel, transitively, the child runs of these subworkflow step runs."""
    ending.cancel_children(rows, reason=reason, now=timezone.now())


HELD = (
    RunStatus.RUNNING,
    RunStatus.WAITING,
    RunStatus.PENDING_APPROVAL,
    RunStatus.BUDGET_EXCEEDED,
)


def _show_waiting(run: Run, planned: p.Plan, fields: set[str]) -> None:
    """``waiting`` while only sleeps and waits hold the run (no process is alive for it),
    ``pending_approval`` when an approval is among them, else ``budget_exceeded`` when an
    attempt waiting for budget is, ``running`` again once anything is scheduled or due."""
    if run.status not in HELD:
        return  # pending (not started), paused: an operator's status stays
    if not planned.waiting:
        target = RunStatus.RUNNING
    elif planned.approval:
        target = RunStatus.PENDING_APPROVAL
    elif planned.budget:
        target = RunStatus.BUDGET_EXCEEDED
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


def _schedule_all(
    run: Run,
    actions: list[p.Schedule],
    now: datetime,
    run_changes: dict[str, Any],
    *,
    claim_as: ClaimAs | None = None,
    riders: Sequence[Rider] = (),
) -> list[StepRun]:
    """Insert the new attempts a plan schedules, with the run's ``run_changes`` and the
    plan's ``riders``: a fan-out's items in multi-row statements (``store.insert_attempts``),
    not one statement each; a lone attempt claimed as it is inserted when ``claim_as`` says
    so (see apply_plan)."""
    step_runs = [_attempt(run, action, now) for action in actions]
    if len(step_runs) == 1:
        _claimed_as(step_runs[0], claim_as)
    rows = [_row(step_run) for step_run in step_runs]
    ids = insert_attempts(rows, run_id=run.id, run_changes=run_changes or None, riders=riders)
    for step_run, step_run_id in zip(step_runs, ids, strict=True):
        step_run.id = step_run_id
    return step_runs


def _claimed_as(step_run: StepRun, claim_as: ClaimAs | None) -> None:
    """The fields of the claim ``claim_as`` gives a lone attempt about to be inserted."""
    claim = claim_as(step_run) if claim_as is not None else None
    if claim is not None:
        check_step_move(StepStatus.SCHEDULED, claim["status"])
        for name, value in claim.items():
            setattr(step_run, name, value)


# (name, attribute) of each column an attempt's insert writes.
_ATTEMPT_FIELDS = [
    (field.name, field.attname) for field in StepRun._meta.concrete_fields if not field.primary_key
]


def _row(step_run: StepRun) -> dict[str, Any]:
    """The values an attempt's insert writes, by field name."""
    return {name: getattr(step_run, attname) for name, attname in _ATTEMPT_FIELDS}


def _attempt(run: Run, action: p.Schedule, now: datetime) -> StepRun:
    return StepRun(
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


def _finish(run: Run, action: p.Finish, now: datetime, ends: ending.Ends | None = None) -> None:
    # Nothing may go on once the run has ended: see ending.end_run.
    ending.end_run(
        run, action.status, now=now, output=action.output, error=action.error, together=ends
    )
