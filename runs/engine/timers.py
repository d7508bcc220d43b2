"""The timer tick: fire due timers (beat, every second).

Each tick claims due timers in batches: ``SELECT ... FOR UPDATE SKIP LOCKED`` picks rows no
other tick holds, and the claim itself is a conditional update of ``fired_at``, so two beats
(or two ticks overlapping) never fire one timer twice. A fired timer's run is then advanced,
which plans from the journal: a sleep over, a wait timed out, a retry due, an attempt or the
run past its deadline. Each tick also advances the runs of attempts whose lease just lapsed
(``lapsed_leases``): a body past its deadline, a worker lost. A step-deadline timer (a row left by
the claims of earlier releases; a claim makes none now) whose attempt already ended is fired
without advancing anything.

A handful of runs is advanced by the tick itself; more are handed to workers in batches
(``workers.advance_runs``, ``TIMER_ADVANCE_BATCH`` runs a message), and a worker runs each
advanced run's next step itself when it serves it. Should such a message be lost, the
reconciler finds its runs (see reconcile.py).

Between two ticks the clock wakes at the next due timer (``wake_before``): the tick, and each
wake-up, ask for a wake-up (an ETA message, ``runs.wake_timers``) at the earliest unfired
timer due before the next tick, no sooner than ``TIMER_RESOLUTION_MS`` from now; a timer armed
due before the next tick asks for one as its transaction commits
(``dispatch.wake_timers_on_commit``). Timers then fire within about the resolution of their
instant instead of up to a second late. A wake-up is only ever early help: lost, late or
doubled, the tick still fires every timer, and the claim fires each once.

The tick has a time budget (``TIMER_TICK_SECONDS``): it stops claiming once it is spent, and
what it advances itself is one bounded round per run (``advance.ADVANCE_ACTIONS``), only while
the budget lasts; the rest goes to workers. One huge run cannot hold everyone's timers.

Each run on its own (``isolation.py``): a fired run whose advance raises, a timer whose app
hook raises, an attempt whose wait cannot be ended, is logged with its run's id, counted and
marked, and the tick goes on with the others. The tick needs no back-off of its own: a timer
fires once (the reconciler, which backs off, finds a run left behind), and a lapsed lease is
looked at for ``LEASE_LAPSE_WINDOW`` only.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from .. import dispatch
from ..models import StepRun, Timer, TimerPurpose
from ..status import StepStatus
from . import hooks
from .advance import run_advance
from .isolation import guarded
from .unservable import unservable_expire

logger = logging.getLogger(__name__)

# The tick's passes, as their failures are counted and marked (isolation.py).
ADVANCE = "timers.advance"
HOOK = "timers.hook"

# The due ids as an array the update matches (= ANY), not a CTE it joins: a timers table
# mostly empty between bursts leaves statistics that estimate one due row, and Postgres then
# joined the CTE in a nested loop, comparing every due row with every claimed one. Measured
# (EXPLAIN ANALYZE, 3,110 due, a batch of 1,000): 1,087 ms that way, 31 ms this way; in a
# burst of 3,000 the claims held a pool process for about 4.5 s (bench/README.md).
_CLAIM_POSTGRES = """
UPDATE {timer} AS t
   SET fired_at = %(now)s, fires = t.fires + 1
 WHERE t.id = ANY(ARRAY(
    SELECT id FROM {timer}
     WHERE fired_at IS NULL AND fire_at <= %(now)s
     ORDER BY fire_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
 )) AND t.fired_at IS NULL
RETURNING t.run_id, t.purpose, t.step_run_id
"""


def fire_due(*, budget_seconds: float | None = None, tick: bool = True) -> int:
    """Fire every due timer, batch after batch, for at most ``budget_seconds``; returns how
    many were fired by this call.

    ``tick`` false, a wake-up between ticks: the runs of lapsed leases are left to the tick,
    which looks for them once a second, and every fired run goes to workers in batches, none
    is advanced here. A wake-up fires a few runs at a time; advanced here, each would cost an
    ``execute_step`` message of its own. Measured with 100 timers a second due 10 ms apart
    (bench.timers precision, a 50 ms resolution): the worker took 1.2 cores that way, 0.7 in
    batches."""
    tunables = settings.DJFLOW
    budget = tunables["TIMER_TICK_SECONDS"] if budget_seconds is None else budget_seconds
    batch = tunables["TIMER_BATCH"]
    until = time.monotonic() + budget
    fired = 0
    if tick:
        _advance(lapsed_leases(timezone.now(), batch), until)
    while True:
        claimed = claim_due(timezone.now(), batch)
        fired += len(claimed)
        _fire_hooks(claimed)
        _end_waits([step for _, purpose, step in claimed if purpose == TimerPurpose.UNSERVABLE])
        fired_runs = _runs_to_advance(claimed)
        if tick:
            _advance(fired_runs, until)
        elif fired_runs:
            _to_workers(fired_runs)
        if len(claimed) < batch or time.monotonic() >= until:
            return fired


def wake_before(until: datetime) -> datetime | None:
    """Ask for a wake-up at the earliest unfired timer due before ``until`` (the next tick),
    no sooner than ``TIMER_RESOLUTION_MS`` from now; returns its instant, or None when the
    tick comes first (or the resolution is 0). One probe of ``timer_due``."""
    resolution = settings.DJFLOW["TIMER_RESOLUTION_MS"]
    if resolution <= 0:
        return None
    due = (
        Timer.objects.filter(fired_at__isnull=True, fire_at__lt=until)
        .order_by("fire_at")
        .values_list("fire_at", flat=True)
        .first()
    )
    if due is None:
        return None
    eta = max(due, timezone.now() + timedelta(milliseconds=resolution))
    if eta >= until:
        return None
    dispatch.wake_timers_at(eta, until=until)
    return eta


def lapsed_leases(now: datetime, batch: int) -> list[Any]:
    """The runs of running attempts whose lease lapsed within ``LEASE_LAPSE_WINDOW``: a body
    past its deadline plus grace (a lease never outlives that), or a worker lost. Their
    advance times the attempt out or gives it up. One probe of the lease index.

    In place of a deadline timer row per attempt, which its claim inserted and its record
    deleted on every step. The window keeps a lapse the planner does not act on (a paused
    run's attempt) from being advanced at every tick; the reconciler finds every lapsed
    lease, however old (reconcile.advance_lost_workers), as it finds anything the tick missed
    while beat was down.
    """
    window = timedelta(seconds=LEASE_LAPSE_WINDOW)
    run_ids = (
        StepRun.objects.filter(
            status=StepStatus.RUNNING, lease_expires_at__lte=now, lease_expires_at__gt=now - window
        )
        .order_by("lease_expires_at")
        .values_list("run_id", flat=True)[:batch]
    )
    return list(dict.fromkeys(run_ids))


# Seconds after a lease lapsed during which each tick advances its run (see lapsed_leases).
LEASE_LAPSE_WINDOW = 10.0


def claim_due(now: datetime, batch: int) -> list[tuple[Any, str, int | None]]:
    """Mark up to ``batch`` due timers fired; returns (run id, purpose, step run id) of each
    timer this call claimed, committed."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            sql = _CLAIM_POSTGRES.format(timer=Timer._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(sql, {"now": now, "batch": batch})
                return [(run_id, purpose, step_run) for run_id, purpose, step_run in cursor]
        # The embedded SQLite default: one writer at a time, the conditional update decides.
        due = list(
            Timer.objects.filter(fired_at__isnull=True, fire_at__lte=now)
            .order_by("fire_at")
            .values_list("id", "run_id", "purpose", "step_run_id")[:batch]
        )
        claimed: list[tuple[Any, str, int | None]] = []
        for timer_id, run_id, purpose, step_run in due:
            if Timer.objects.filter(id=timer_id, fired_at__isnull=True).update(
                fired_at=now, fires=1
            ):
                claimed.append((run_id, purpose, step_run))
        return claimed


def _runs_to_advance(claimed: list[tuple[Any, str, int | None]]) -> list[Any]:
    deadlines = {
        step
        for _, purpose, step in claimed
        if purpose == TimerPurpose.STEP_DEADLINE and step is not None
    }
    still_running = set(
        StepRun.objects.filter(id__in=deadlines, status=StepStatus.RUNNING).values_list(
            "id", flat=True
        )
    )
    runs: dict[Any, None] = {}
    # Timers of an app's own purpose (an approval's reminder) only send something.
    quiet = {TimerPurpose.UNSERVABLE, *hooks.timer_purposes()}
    for run_id, purpose, step in claimed:
        if purpose in quiet:
            continue  # mails only, or an attempt's wait that advances its run if it fails
        if purpose != TimerPurpose.STEP_DEADLINE or step in still_running:
            runs[run_id] = None
    return list(runs)


def _fire_hooks(claimed: list[tuple[Any, str, int | None]]) -> None:
    """Timers of an app's own purpose (an approval's reminder) do what it registered."""
    for run_id, purpose, step_run_id in claimed:
        fire = hooks.timer_handler(purpose)
        if fire is not None and step_run_id is not None:
            guarded(HOOK, run_id, partial(fire, step_run_id), failed=None)


def _end_waits(step_run_ids: list[int | None]) -> None:
    """Attempts whose wait for a worker is over fail (and advance their run) or are offered
    again (see unservable.py)."""
    waits = [step for step in step_run_ids if step is not None]
    if waits:
        unservable_expire(step_run_ids=waits)


def _advance(run_ids: list[Any], until: float) -> None:
    if len(run_ids) > settings.DJFLOW["TIMER_INLINE_RUNS"]:
        _to_workers(run_ids)
        return
    for index, run_id in enumerate(run_ids):
        if time.monotonic() >= until:
            # The tick's time is spent: workers advance the rest.
            _to_workers(run_ids[index:])
            return
        # One bounded round; a run with more to plan asks a worker for the rest. Should it
        # fail, the timer is fired all the same: logged, counted and marked (isolation.py),
        # the reconciler advances the run once its back-off is over.
        guarded(ADVANCE, run_id, partial(run_advance, run_id=run_id, seconds=0), failed=None)


def _to_workers(run_ids: list[Any]) -> None:
    # Several runs a message, a worker running each one's next step itself: a fired run then
    # costs a share of one message, not an advance and an execute_step message. Small
    # batches, so that a burst's messages keep every pool process busy.
    dispatch.advance_in_batches(run_ids, size=settings.DJFLOW["TIMER_ADVANCE_BATCH"])
