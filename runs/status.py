"""Run and step-run statuses and the moves allowed between them (contract section 5).

A move that is not in these tables raises :class:`IllegalTransition`: every status change in
the engine goes through :func:`check_run_move` or :func:`check_step_move`, and the database
update that makes it is conditional on the source status.
"""

from __future__ import annotations

from django.db import models

from workflows.errors import Conflict, FieldError


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    PENDING_APPROVAL = "pending_approval"
    PAUSED = "paused"
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


RUN_TERMINAL = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT}
)
RUN_ACTIVE = frozenset(
    {RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.PENDING_APPROVAL}
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
STEP_IN_FLIGHT = frozenset({StepStatus.SCHEDULED, StepStatus.RUNNING, StepStatus.WAITING})

_S = RunStatus
RUN_MOVES: dict[str, frozenset[str]] = {
    _S.PENDING: frozenset(
        {_S.RUNNING, _S.PAUSED, _S.CANCELLED, _S.FAILED, _S.TIMED_OUT, _S.COMPLETED}
    ),
    _S.RUNNING: frozenset(
        {
            _S.WAITING,
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
            _S.PENDING_APPROVAL,
            _S.PAUSED,
            _S.COMPLETED,
            _S.FAILED,
            _S.CANCELLED,
            _S.TIMED_OUT,
        }
    ),
    _S.PENDING_APPROVAL: frozenset(
        {_S.RUNNING, _S.WAITING, _S.PAUSED, _S.COMPLETED, _S.FAILED, _S.CANCELLED, _S.TIMED_OUT}
    ),
    _S.PAUSED: frozenset({_S.RUNNING, _S.CANCELLED, _S.TIMED_OUT}),
    # A failed run may be retried from its failed step (an operator's explicit move).
    _S.FAILED: frozenset({_S.RUNNING}),
    _S.COMPLETED: frozenset(),
    _S.CANCELLED: frozenset(),
    _S.TIMED_OUT: frozenset(),
}

_T = StepStatus
STEP_MOVES: dict[str, frozenset[str]] = {
    _T.SCHEDULED: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT}),
    _T.RUNNING: frozenset({_T.SUCCEEDED, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT, _T.WAITING}),
    _T.WAITING: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.CANCELLED, _T.TIMED_OUT}),
    _T.SUCCEEDED: frozenset(),
    _T.FAILED: frozenset(),
    _T.SKIPPED: frozenset(),
    _T.CANCELLED: frozenset(),
    _T.TIMED_OUT: frozenset(),
}


class IllegalTransition(Conflict):
    code = "illegal_transition"


def check_run_move(source: str, target: str) -> None:
    if target not in RUN_MOVES.get(source, frozenset()):
        raise IllegalTransition(
            errors=[FieldError("status", f"a {source} run cannot become {target}")]
        )


def check_step_move(source: str, target: str) -> None:
    if target not in STEP_MOVES.get(source, frozenset()):
        raise IllegalTransition(
            errors=[FieldError("status", f"a {source} step run cannot become {target}")]
        )


def run_sources(target: str) -> list[str]:
    """Every status a run may move to ``target`` from: the condition of the UPDATE."""
    return [source for source, targets in RUN_MOVES.items() if target in targets]


def step_sources(target: str) -> list[str]:
    return [source for source, targets in STEP_MOVES.items() if target in targets]
