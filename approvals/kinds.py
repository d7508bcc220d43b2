"""The ``approval`` and ``handoff`` step kinds, and the timers and repairs they need, plugged
into the engine from ``ApprovalsConfig.ready()``: the engine asks the kind registry and its
hooks, and never imports this app.

An approval's row input (opened by the planner, through :func:`open_approval`) is what its
request shows: ``{"message", "details", "approvers", "quorum", "timeout_ms",
"remind_after_ms", "escalate_to"}``; a hand-off's is ``{"group", "message"}``. The hooks that
write (:mod:`approvals.gates`) run in the transaction that writes the row, under the run's
lock.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import DatabaseError

from runs import inspection
from runs.engine import hooks
from runs.models import Run, StepRun, TimerPurpose
from workflows.kinds import Ending, Kind, Opening, Role, Scope, register

from . import gates, outbox, selectors
from .models import Decision

logger = logging.getLogger(__name__)


# --- planner side (pure) ------------------------------------------------------------------


def open_approval(step: Mapping[str, Any], scope: Scope) -> Opening:
    """A ``waiting`` row whose input is what the request shows (the resolved message, the
    step's input as the details) and a timer at its deadline."""
    timeout = step.get("timeout_ms")
    due = scope.after(timeout)
    request = {
        "message": scope.resolve(step.get("message"), "message"),
        "details": scope.input(step),
        "approvers": copy.deepcopy(step["approvers"]),
        "quorum": step.get("quorum", 1),
        "timeout_ms": timeout,
        "remind_after_ms": step.get("remind_after_ms"),
        "escalate_to": copy.deepcopy(step.get("escalate_to")),
    }
    timer = "approval_timeout" if due is not None else None
    return Opening("waiting", input=request, not_before=due, timer=timer)


def undecided(step: Mapping[str, Any], row: Any) -> Ending:
    message = f"no decision within timeout_ms ({step.get('timeout_ms')} ms)"
    return Ending("timed_out", {"class": "timeout", "message": message})


def open_handoff(step: Mapping[str, Any], scope: Scope) -> Opening:
    """A hand-off notifies people and never blocks: its row opens ``running`` and is ended
    by :func:`send_handoff` in the same transaction, then the run is planned again."""
    message = scope.resolve(step.get("message"), "message")
    return Opening("running", input={"group": step["group"], "message": message})


# --- applier side -------------------------------------------------------------------------


def request_opened(run: Run, step_run: StepRun, now: datetime) -> Ending | None:
    """Open the request and mail its approvers; the step fails at once when its approvers
    do not resolve (see gates.open_request)."""
    error = gates.open_request(run, step_run, now)
    return None if error is None else Ending("failed", error)


def send_handoff(run: Run, step_run: StepRun, now: datetime) -> Ending:
    error = gates.handoff(run, step_run)
    return Ending("succeeded") if error is None else Ending("failed", error)


def requests_expired(step_run_ids: list[int], now: datetime) -> None:
    for step_run_id in step_run_ids:
        gates.expire(step_run_id, now)


def remind(step_run_id: int) -> None:
    """Reminders are sent by the timer tick itself: one short transaction each, mails after."""
    try:
        gates.remind(step_run_id=step_run_id)
    except DatabaseError:
        # The timer is fired; the reconciler sends a reminder left uncovered.
        logger.exception("timers: reminding approvers of step run %s failed", step_run_id)


APPROVAL = Kind(
    "approval",
    Role.PEOPLE,
    open=open_approval,
    due=undecided,
    opened=request_opened,
    timed_out=requests_expired,
    cancelled=gates.cancel,
)
HANDOFF = Kind("handoff", Role.PEOPLE, open=open_handoff, opened=send_handoff)


def plug_in() -> None:
    register(APPROVAL)
    register(HANDOFF)
    hooks.on_timer(TimerPurpose.APPROVAL_REMINDER, remind)
    # Approval and hand-off e-mails whose message was lost (approvals.outbox).
    hooks.repair("mails_reoffered", outbox.reoffer_unsent)
    # Approval reminders whose timer fired but whose mails were never queued.
    hooks.repair("reminders_restored", gates.restore_reminders)
    # The run inspector links a run waiting for approval to its request's page.
    inspection.on_page_links(selectors.run_page_links)
    # Its audit shows who decided (a run approved said "No one has acted on this run").
    inspection.on_page_audit(selectors.run_page_audit)
    # Runs deleted by retention take their approvals' decisions with them.
    hooks.on_purge("approval_decisions", purge_decisions)
    # A run waiting for budget tells the workflow's operators (CONTRACT section 17).
    hooks.on_budget_exceeded("operators_notified", gates.budget_exceeded)


def purge_decisions(run_ids: list[Any]) -> dict[str, int]:
    """Delete the decisions of the approval requests of these runs, which retention is
    deleting (``runs.retention``). A decision is append-only and protected from a cascade,
    so that nothing deletes one by accident: a run's end of retention is the one deliberate
    exception, and it takes the whole run's record, the decisions with the rest. One
    statement; the requests, their approvers and mails follow the runs by cascade."""
    deleted, _ = Decision.objects.filter(request__run_id__in=run_ids).delete()
    return {Decision._meta.label: deleted} if deleted else {}
