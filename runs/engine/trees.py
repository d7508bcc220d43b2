"""Trees of runs: the operator's cap on what one root may start, and ending a large tree in
the background (CONTRACT section 9: no request and no task does unbounded work).

A run's tree is its root and every run below it: subworkflow children and the body runs of
composite steps, at every depth. ``limits.max_steps`` bounds attempts, not runs, and a
document may raise it; a parallel of self-calling subworkflows made about 3,870 runs in 75 s
and kept growing (issue 36). So, whatever the document says:

- **The total.** At most ``DJFLOW_MAX_TREE_RUNS`` runs are started under one root. The start
  past it is refused (:func:`admit`): the subworkflow step fails with class ``limit``
  naming the cap, which fails its run whatever ``on_error`` says (as every run limit does),
  its parent's step, and so on up to the root, whose end cancels the rest: the tree stops.
- **The pace.** Starts in one tree go at most ``DJFLOW_MAX_TREE_RUNS_PER_MINUTE`` a minute,
  after a first minute's worth at once (GCRA on ``RunTree.paced_until``). A start past the
  pace is not refused, since it will succeed: its child run is created ``pending`` with a
  ``tree_pace`` timer at its turn, when its first steps are planned (the reconciler leaves
  a run so waiting alone). Refusing it would fail a legitimate burst that a minute fixes.

Both are decided by one conditional statement on the tree's ``RunTree`` row (an upsert that
adds the start only while ``runs`` is under the cap), so concurrent starts in one tree never
pass the cap together, and no start counts the tree's runs. The row's lock is held to the
end of the starting transaction; nothing that holds it waits for a run lock (ends take none
they would wait for: ``ending``), so it adds no deadlock. A start in a tree whose root has
ended is not made: the run starting it is being ended by the tree's sweep.

Ending: see ``ending``. :func:`end_tree` (the ``runs.end_tree`` task) ends in batches what
the ends of a tree left behind, for a time budget, then sends itself again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from .. import dispatch
from ..models import Run, RunTree
from ..status import RUN_ACTIVE, RUN_TERMINAL, RunStatus
from .ending import end_orphans, orphaned

logger = logging.getLogger(__name__)

# How far ahead of now the pace may run before a start waits: a minute's worth of starts
# go at once.
BURST = timedelta(minutes=1)
# One runs.end_tree task ends runs for this long, then sends itself again (the back of the
# queue), so a huge tree holds no worker long.
END_TREE_SECONDS = 5.0
# How long the sweep waits before looking again when every run left is held by another
# transaction (an advance, a worker recording a step), which takes milliseconds.
HELD_PAUSE_SECONDS = 0.05


@dataclass(frozen=True)
class Admission:
    """A child start's answer: ``refused`` (the cap's message: the step fails, class
    ``limit``), ``ended`` (the root has ended: start nothing, the sweep ends the starter),
    or go, at once or, with ``wait_until``, at the pace's turn."""

    refused: str | None = None
    ended: bool = False
    wait_until: datetime | None = None


def interval() -> timedelta:
    """The pace's interval between two starts of one tree."""
    return timedelta(seconds=60 / int(settings.DJFLOW["MAX_TREE_RUNS_PER_MINUTE"]))


def admit(run: Run, now: datetime) -> Admission:
    """Count a child start of ``run`` (locked by the caller) against its tree's cap and
    pace: see the module's docstring. Must be called in the transaction that creates the
    child, so a start that rolls back is not counted."""
    root_id = run.root_run_id or run.id
    cap = settings.DJFLOW["MAX_TREE_RUNS"]
    step = interval()
    if connection.vendor == "postgresql":
        paced_until = _count_postgres(root_id, cap, step, now)
    else:
        paced_until = _count_elsewhere(root_id, cap, step, now)
    if paced_until is None:
        if run.root_run_id is not None and _root_ended(run.root_run_id):
            return Admission(ended=True)
        return Admission(
            refused=(
                f"the tree of run {root_id} has started {cap} runs, the most "
                f"DJFLOW_MAX_TREE_RUNS allows under one root run"
            )
        )
    # This start's turn: the pace's arrival before this start, less the burst allowed.
    turn = paced_until - step - BURST
    return Admission(wait_until=turn if turn > now else None)


# The upsert that decides a start. The tree row is made by the first child's start; each
# later start adds itself while the tree is under the cap and its root has not ended, and
# pushes the pace one interval on from its last arrival or now, whichever is later. No row
# back: refused.
_COUNT_SQL = f"""
INSERT INTO {RunTree._meta.db_table} AS t (root_run_id, runs, paced_until)
VALUES (%(root)s, 1, %(now)s + %(step)s)
ON CONFLICT (root_run_id) DO UPDATE
   SET runs = t.runs + 1, paced_until = GREATEST(t.paced_until, %(now)s) + %(step)s
 WHERE t.runs < %(cap)s
   AND NOT EXISTS (SELECT 1 FROM {Run._meta.db_table} AS r
                    WHERE r.id = %(root)s AND r.status IN ({
    ", ".join(f"'{status}'" for status in sorted(map(str, RUN_TERMINAL)))
}))
RETURNING t.paced_until
"""


def _count_postgres(root_id: Any, cap: int, step: timedelta, now: datetime) -> datetime | None:
    key = Run._meta.pk.get_db_prep_value(root_id, connection)
    with connection.cursor() as cursor:
        params: dict[str, Any] = {"root": key, "now": now, "step": step, "cap": cap}
        cursor.execute(_COUNT_SQL, params)
        row = cursor.fetchone()
    return None if row is None else row[0]


def _count_elsewhere(root_id: Any, cap: int, step: timedelta, now: datetime) -> datetime | None:
    # The embedded SQLite default: one writer at a time, so read-then-write decides.
    tree, _ = RunTree.objects.get_or_create(root_run_id=root_id)
    if tree.runs >= cap or _root_ended(root_id):
        return None
    tree.paced_until = max(tree.paced_until or now, now) + step
    tree.runs += 1
    tree.save(update_fields=["runs", "paced_until"])
    return tree.paced_until


def restarted(run: Run) -> None:
    """A root run's retry (a new generation) starts its tree's count afresh: from the runs of
    the tree still active (a previous generation's being ended), not from every run it ever
    started, which would fail the first child start of a tree that once reached the cap.
    The pace is kept. A child run's retry counts on in its root's tree. Every run not ended
    counts, paused ones too: a paused leftover is live, and its operator may resume it
    (security review: counting only the active ones let a retry start past the cap)."""
    if run.root_run_id is not None:
        return
    live = Run.objects.filter(root_run_id=run.id).exclude(status__in=RUN_TERMINAL)
    RunTree.objects.filter(root_run_id=run.id).update(runs=Coalesce(Subquery(live_count(live)), 0))


def live_count(runs: Any) -> Any:
    """``runs`` counted, as a subquery (no row when there are none: Coalesce it): the count
    is taken in the UPDATE's own statement."""
    return runs.order_by().values("root_run_id").annotate(n=Count("id")).values("n")


def _root_ended(root_id: Any) -> bool:
    return Run.objects.filter(id=root_id, status__in=RUN_TERMINAL).exists()


def end_tree(*, root_id: Any, seconds: float = END_TREE_SECONDS) -> int:
    """End what the ends of the tree of ``root_id`` left behind (``ending.end_orphans``),
    batch after batch, for at most ``seconds``; then, with some left, ask for another task.
    Returns how many runs it ended. Idempotent: a second call ends what is left, or nothing.
    """
    until = time.monotonic() + seconds
    total = 0
    while True:
        ended, more = end_orphans(root_id, now=timezone.now())
        total += ended
        if not more:
            return total
        if time.monotonic() >= until:
            logger.info("end_tree: %d runs of tree %s ended, more left", total, root_id)
            dispatch.end_tree_now(root_id)
            return total
        if not ended:
            # Every run left is held by a transaction of its own (milliseconds).
            time.sleep(HELD_PAUSE_SECONDS)


def resume_orphaned(now: datetime, batch: int) -> int:
    """The reconciler's part: trees whose ends left runs behind that have been quiet for
    ``LOST_MESSAGE_SECONDS`` (their ``runs.end_tree`` message lost) get a task again.
    Returns how many trees it sent. One probe of the active runs' index."""
    quiet = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    roots = list(
        Run.objects.filter(
            # Paused leftovers too: the sweep ends them, and nothing else would.
            status__in=[*RUN_ACTIVE, RunStatus.PAUSED],
            updated_at__lte=quiet,
            root_run__isnull=False,
        )
        .filter(orphaned())
        .order_by()
        .values_list("root_run_id", flat=True)
        .distinct()[:batch]
    )
    for root_id in roots:
        dispatch.end_tree_now(root_id)
    return len(roots)
