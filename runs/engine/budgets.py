"""Attempts waiting for budget (CONTRACT section 17): how they wait and how they go on.

A model call whose worst case does not fit the run's ``limits.max_cost_usd`` (plus what
operators added) or its account's remaining budget is not made (``runs.engine.costs``).
Under ``limits.on_budget: "wait"`` (the default) the worker hands the attempt back to
``scheduled`` with ``StepRun.budget_wait`` set and does not offer it (:func:`budget_wait`):
no worker is held, the attempt's retry budget is untouched, and the planner shows the run
``budget_exceeded`` (``plan._budget_wait``).

It goes on when:

- an operator tops the run up (``runs.services.run_budget_add``): the waits on that run's
  limit, in its tree, are released;
- an operator raises the account's budget (``runs.services.account_save``): the waits on
  that account are released;
- the account's period ends: the planner asked for a ``budget_period`` timer at the wait's
  ``until``, and plans an ``Unblock`` when it fires (apply calls :func:`release`).

Invariants:

- A release is a conditional update from ``scheduled`` with ``budget_wait`` set: two
  releases (a top-up racing the period's timer) offer an attempt once each at most, and a
  duplicate offer is harmless (the claim decides).
- Releasing does not check the budget: the worker's reservation does, and an attempt that
  still does not fit waits again (with a fresh ``budget_wait``). So a release never lets a
  call overshoot, and a raise that is too small costs one claim per waiting attempt.
- The reconciler never offers an attempt with ``budget_wait`` set (``reoffer_lost``): it
  would be handed back at once, over and over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q

from .. import dispatch
from ..models import Run, StepRun
from ..moves import hand_back
from ..status import StepStatus

logger = logging.getLogger(__name__)

# The most waiting attempts one raise releases in its transaction; the rest are released by
# the next raise or the next period's timer (an account with thousands of waiting runs is
# released in turns, each offered again by its own run's timer or advance).
RELEASE_BATCH = 1000


def budget_wait(*, step_run_id: int, claim: Any, wait: dict[str, Any], now: datetime) -> bool:
    """The claimed attempt back to ``scheduled``, waiting for budget (``wait`` as
    ``BudgetWait.wait``), if the claim still holds; True when it did. The run is advanced
    on commit so that it shows ``budget_exceeded``."""
    with transaction.atomic():
        return hand_back(step_run_id, claim, now, budget_wait=wait)


def waiting_on_run(run: Run) -> Any:
    """The attempts of ``run``'s tree waiting for ``run``'s own limit."""
    root = run.root_run_id or run.id
    tree = Q(run_id=root) | Q(run__root_run_id=root)
    return StepRun.objects.filter(
        tree, status=StepStatus.SCHEDULED, budget_wait__limit="run", budget_wait__run=str(run.id)
    )


def waiting_on_account(name: str) -> Any:
    """The attempts waiting for account ``name``'s budget."""
    return StepRun.objects.filter(
        status=StepStatus.SCHEDULED, budget_wait__limit="account", budget_wait__account=name
    )


def release(found: Any, *, advance: bool = True) -> int:
    """Offer again, on commit, the waiting attempts in ``found`` (a StepRun queryset), at
    most RELEASE_BATCH; returns how many. With ``advance``, their runs are advanced on
    commit too, to show ``running`` again (an advance that releases needs none)."""
    rows = list(
        found.filter(status=StepStatus.SCHEDULED, budget_wait__isnull=False)
        .select_related("run")
        .order_by("id")[:RELEASE_BATCH]
    )
    released = 0
    for row in rows:
        if _release_one(row, advance=advance):
            released += 1
    return released


def release_ids(step_run_ids: Iterable[int], *, advance: bool = True) -> int:
    return release(StepRun.objects.filter(id__in=list(step_run_ids)), advance=advance)


def _release_one(row: StepRun, *, advance: bool) -> bool:
    moved = StepRun.objects.filter(
        id=row.id, status=StepStatus.SCHEDULED, budget_wait__isnull=False
    ).update(budget_wait=None)
    if not moved:
        return False
    logger.info("attempt %s of run %s no longer waits for budget", row.id, row.run_id)
    dispatch.offer_on_commit(row, workflow_id=row.run.workflow_id)
    if advance:
        dispatch.advance_on_commit(row.run_id)
    return True
