"""Run and step-run statuses and the moves allowed between them (contract section 5).

A move that is not in these tables raises :class:`IllegalTransition`: every status change in
the engine is written by ``runs.moves``, whose updates are conditional on the sources these
tables allow (narrowed to what the caller asks), or checked here first under the run's lock.
The test suite installs a database trigger generated from these tables (``tests/moves.py``):
a move not listed fails the statement, in the test process and in the worker processes alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django.db import models

from workflows.errors import Conflict, FieldError


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    PENDING_APPROVAL = "pending_approval"
    PAUSED = "paused"
    # A model call did not fit the run's limits.max_cost_usd or its account's budget
    # (limits.on_budget "wait"): its attempt waits with no worker held until a top-up, a
    # raised account budget or a new period (runs.engine.budgets).
    BUDGET_EXCEEDED = "budget_exceeded"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class StepStatus(models.TextChoices):
    SCHEDULED = "scheduled"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    # An at_most_once attempt whose worker was lost after it started: it may or may not have
    # had its effect, so it is neither run again nor failed blindly. The run waits until an
    # operator resolves it (runs.services.step_run_resolve) or its deadline fails it.
    IN_DOUBT = "in_doubt"


RUN_TERMINAL = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT}
)
RUN_ACTIVE = frozenset(
    {
        RunStatus.PENDING,
        RunStatus.RUNNING,
        RunStatus.WAITING,
        RunStatus.PENDING_APPROVAL,
        RunStatus.BUDGET_EXCEEDED,
    }
)
STEP_TERMINAL = frozenset(
    {
        StepStatus.SUCCEEDED,
        StepStatus.FAILED,
        StepStatus.SKIPPED,
        StepStatus.CANCELLED,
        StepStatus.TIMED_OUT,
    }
)
# Not over yet: a run that ends cancels them.
STEP_IN_FLIGHT = frozenset(
    {StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING, StepStatus.IN_DOUBT}
)

_S = RunStatus
RUN_MOVES: dict[str, frozenset[str]] = {
    # A run's first plan starts it and may find it waiting at once (a first step that
    # sleeps, waits or asks for approval): one write takes the row from pending to waiting.
    _S.PENDING: frozenset(
        {
            _S.RUNNING,
            _S.WAITING,
            _S.PENDING_APPROVAL,
            _S.PAUSED,
            _S.CANCELLED,
            _S.FAILED,
            _S.TIMED_OUT,
            _S.COMPLETED,
        }
    ),
    _S.RUNNING: frozenset(
        {
            _S.WAITING,
            _S.BUDGET_EXCEEDED,
            _S.PENDING_APPROVAL,
            _S.PAUSED,
            _S.COMPLETED,
            _S.FAILED,
            _S.CANCELLED,
            _S.TIMED_OUT,
        }
    ),
    _S.WAITING: frozenset(
        {
            _S.RUNNING,
            _S.BUDGET_EXCEEDED,
            _S.PENDING_APPROVAL,
            _S.PAUSED,
            _S.COMPLETED,
            _S.FAILED,
            _S.CANCELLED,
            _S.TIMED_OUT,
        }
    ),
    _S.PENDING_APPROVAL: frozenset(
        {
            _S.RUNNING,
            _S.WAITING,
            _S.BUDGET_EXCEEDED,
            _S.PAUSED,
            _S.COMPLETED,
            _S.FAILED,
            _S.CANCELLED,
            _S.TIMED_OUT,
        }
    ),
    # Waiting for budget: a top-up or a new period lets the attempt go on (running); other
    # branches of the run may still end it meanwhile, and an operator may pause or cancel it.
    _S.BUDGET_EXCEEDED: frozenset(
        {
            _S.RUNNING,
            _S.WAITING,
            _S.PENDING_APPROVAL,
            _S.PAUSED,
            _S.COMPLETED,
            _S.FAILED,
            _S.CANCELLED,
            _S.TIMED_OUT,
        }
    ),
    _S.PAUSED: frozenset({_S.RUNNING, _S.CANCELLED, _S.TIMED_OUT}),
    # A failed run may be retried from its failed step, and any ended run from a step of
    # the operator's choice (runs.services.run_retry): an operator's explicit move, made
    # under the run's lock; nothing else moves an ended run.
    _S.FAILED: frozenset({_S.RUNNING}),
    _S.COMPLETED: frozenset({_S.RUNNING}),
    _S.CANCELLED: frozenset({_S.RUNNING}),
    _S.TIMED_OUT: frozenset({_S.RUNNING}),
}

_T = StepStatus
STEP_MOVES: dict[str, frozenset[str]] = {
    _T.SCHEDULED: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT}),
    # running -> scheduled: the worker that claimed the attempt hands it back (class
    # unservable: it lacks the handler, or the handler said so), and the same attempt is
    # requeued for another worker with its budget untouched (contract section 5). A new
    # attempt instead would spend the budget and change what the journal shows.
    # running -> in_doubt: an at_most_once attempt whose worker's lease lapsed (the planner's
    # Expire); never run again, never failed without an operator or a deadline.
    _T.RUNNING: frozenset(
        {
            _T.SUCCEEDED,
            _T.FAILED,
            _T.CANCELLED,
            _T.TIMED_OUT,
            _T.WAITING,
            _T.SCHEDULED,
            _T.IN_DOUBT,
        }
    ),
    _T.WAITING: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT}),
    # An operator resolves it (succeeded with an output, or failed), its deadline fails it,
    # or the run ends around it (cancelled).
    _T.IN_DOUBT: frozenset({_T.SUCCEEDED, _T.FAILED, _T.CANCELLED}),
    _T.SUCCEEDED: frozenset(),
    _T.FAILED: frozenset(),
    _T.SKIPPED: frozenset(),
    _T.CANCELLED: frozenset(),
    _T.TIMED_OUT: frozenset(),
}


# What a row may be written with when it is inserted: a run starts pending; an attempt is
# scheduled for a worker, opened running or waiting (an engine row), or written already
# ended (a step failed before it could start, a wait over at once, a skipped step).
RUN_INITIAL = frozenset({_S.PENDING})
STEP_INITIAL = frozenset(
    {_T.SCHEDULED, _T.RUNNING, _T.WAITING, _T.SUCCEEDED, _T.FAILED, _T.SKIPPED}
)


class IllegalTransition(Conflict):
    code = "illegal_transition"


def check_run_move(source: str, target: str) -> None:
    run_sources(target, [source])


def check_step_move(source: str, target: str) -> None:
    step_sources(target, [source])


def run_sources(target: str, asked: Iterable[str] | None = None) -> list[str]:
    """The statuses a run may move to ``target`` from: the condition of the UPDATE that
    moves it. ``asked`` narrows them; a status in it that may not move to ``target`` raises
    (the caller's mistake, not a race), and so does a target no status may move to."""
    return _sources(RUN_MOVES, "run", target, asked)


def step_sources(target: str, asked: Iterable[str] | None = None) -> list[str]:
    """As :func:`run_sources`, for a step run."""
    return _sources(STEP_MOVES, "step run", target, asked)


def _sources(
    moves: Mapping[str, frozenset[str]], noun: str, target: str, asked: Iterable[str] | None
) -> list[str]:
    allowed = [source for source, targets in moves.items() if target in targets]
    if asked is None:
        if not allowed:
            raise IllegalTransition(errors=[FieldError("status", f"no {noun} can become {target}")])
        return allowed
    wanted = list(dict.fromkeys(asked))
    refused = [source for source in wanted if source not in allowed]
    if refused:
        raise IllegalTransition(
            errors=[
                FieldError("status", f"a {source} {noun} cannot become {target}")
                for source in refused
            ]
        )
    return wanted


class DeliveryStatus(models.TextChoices):
    """A run-end webhook's delivery (``runs.models.NotifyDelivery``): pending until the
    receiver answers 2xx (delivered) or the attempts run out or its address is refused
    (failed). Moves: pending → delivered | failed, each a conditional update on pending."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"
