"""Status writes: every change of a run's or a step run's status is one of these updates.

Each is an ``UPDATE ... SET status = <target> WHERE status IN (<sources>)``, the sources drawn
from the tables in ``runs.status`` and narrowed to the ones the caller names. Naming a source
the table forbids raises :class:`~runs.status.IllegalTransition` before any SQL runs: it is a
mistake in the code, not a race. A row found in any other status is left as it is and not
counted, so the count says which writer won, as every conditional update in the engine does.

Raw SQL that moves a status (the worker's claim, recording a result) takes its source and
target from :func:`runs.status.step_sources` likewise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from .engine.store import update_run
from .models import Run, StepRun
from .status import StepStatus, check_run_move, run_sources, step_sources


def move_steps(
    rows: QuerySet[StepRun], target: str, *, sources: Iterable[str] | None = None, **fields: Any
) -> int:
    """Move the step runs of ``rows`` that are in one of ``sources`` (by default every
    status the table lets move to ``target``) to ``target``, writing ``fields`` too; returns
    how many moved."""
    allowed = step_sources(target, sources)
    return rows.filter(status__in=allowed).update(status=target, **fields)


def hand_back(step_run_id: int, claim: Any, now: Any, **more: Any) -> bool:
    """The claimed attempt back to ``scheduled`` (running -> scheduled, the one move back in
    runs.status.STEP_MOVES), its claim, worker and times cleared, if the claim still holds;
    True when it did. ``more``: fields set with it (a refusal counted, a budget wait)."""
    moved = move_steps(
        StepRun.objects.filter(id=step_run_id, claim=claim),
        StepStatus.SCHEDULED,
        sources=[StepStatus.RUNNING],
        claim=None,
        worker="",
        started_at=None,
        deadline_at=None,
        lease_expires_at=None,
        scheduled_at=now,
        **more,
    )
    return moved == 1


def move_runs(
    rows: QuerySet[Run], target: str, *, sources: Iterable[str] | None = None, **fields: Any
) -> int:
    """As :func:`move_steps`, for runs."""
    allowed = run_sources(target, sources)
    return rows.filter(status__in=allowed).update(status=target, **fields)


def move_run(run: Run, target: str, **fields: Any) -> None:
    """Move ``run``, locked by the caller, to ``target`` and write ``fields`` with it
    (``updated_at`` too); the instance is updated to match.

    The move from the instance's status is checked against the table: a forbidden one raises
    :class:`~runs.status.IllegalTransition` (a 409 for an operator's request) before any
    write. The row itself moves from any source the table allows for ``target``: on the
    applier's path the instance may be ahead of its row (a run started by the same plan that
    fails it is still ``pending`` there). Under the lock the update always matches; should it
    not, the row is in a status nothing may leave for ``target``, and ``update_run`` raises."""
    changes = run_move(run, target, **fields)
    # Plain SQL, conditional on the table like every run write of the applier's: the ORM's
    # query building cost more than the statement on every run's end.
    update_run(run.id, changes)
    moved(run, changes)


def run_move(run: Run, target: str, **fields: Any) -> dict[str, Any]:
    """The columns :func:`move_run` writes (the move checked against the table first), for a
    caller that writes them in a statement of its own, then calls :func:`moved`."""
    check_run_move(run.status, target)
    fields.setdefault("updated_at", timezone.now())
    return {"status": target, **fields}


def moved(run: Run, changes: dict[str, Any]) -> None:
    """The instance updated to match the row ``changes`` were written to."""
    for name, value in changes.items():
        setattr(run, name, value)
