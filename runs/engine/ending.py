"""Ending a run: the one path for every end (completed, failed, timed out, cancelled).

The applier calls :func:`end_run` when a plan finishes the run; ``runs.services.run_cancel``
calls it for an operator's cancel; :func:`cancel_children` ends the child runs of subworkflow
rows the planner cancelled. With the run locked by the caller, in the caller's transaction:

- the run moves to its end (through the table, ``runs.moves``) with its output and error;
- its rows still in flight are closed: an open condition row fails with a run that failed or
  timed out (the failure came up through it) and is cancelled otherwise; every other row is
  cancelled, its claim taken away, so a body still running has its result refused, and its
  task is revoked best-effort after commit;
- what the kinds of its rows keep beside them closes (``Kind.cancelled``: the approval
  requests of its approval rows, whose links then show a closed request);
- its child runs that have not ended are cancelled, transitively, each under its own lock: a
  parent's lock is always taken before its children's, never under them, and never waited
  for: a child another transaction holds (its own advance, a worker recording its step),
  and every one of a tree that started more than ``DJFLOW_CANCEL_INLINE_RUNS`` runs, is
  left to a ``runs.end_tree`` task (:func:`end_orphans`), which ends the live runs of the
  tree whose parent has ended, in batches, in id order, again taking no lock it would wait
  for. An end waits for no run
  lock beyond the one its caller took first, so it deadlocks with no advance, child start or
  other end (a cancel of a fork bomb's root was three 503s in a row, each a deadlock);
- its unfired timers are deleted: an ended run needs none;
- its concurrency slot, if it held one, goes to the next runs waiting for its key, in this
  transaction (``slots.release``);
- its end is counted (``runs.metrics``) once the transaction commits;
- its parent is asked to advance (after commit, never planned here): a child's end is its
  subworkflow step's. A child ended because its parent is ending asks nothing of it;
- with tracing on, its spans are emitted after commit (``runs.tracing``);
- each ``notify`` entry of its document that lists this end gets a delivery row, offered to
  a worker after commit (``workers.notify`` sends it, at least once).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q

from workflows import kinds
from workflows.kinds import Role

from .. import dispatch, metrics, tracing
from ..models import NotifyDelivery, Run, RunTree, StepRun, Timer
from ..moves import move_steps, moved, run_move
from ..status import RUN_TERMINAL, STEP_IN_FLIGHT, RunStatus, StepStatus
from . import slots
from .journal import document_of
from .sql import cursor as prepared_cursor
from .store import request_advance, run_update_sql, update_run

# An open condition row takes its run's failure; with any other end it is cancelled.
_CONDITION_FAILS_WITH = frozenset({RunStatus.FAILED, RunStatus.TIMED_OUT})
# How a child run's error names its parent's end.
_PARENT_ENDED: dict[str, str] = {
    RunStatus.COMPLETED: "completed",
    RunStatus.FAILED: "failed",
    RunStatus.TIMED_OUT: "timed out",
    RunStatus.CANCELLED: "was cancelled",
}


def cancelled_error(reason: str) -> dict[str, Any]:
    """A cancelled run's error: class ``cancelled`` and why."""
    return {"class": "cancelled", "message": reason, "step": None}


class Below:
    """What one end may still do to the runs below its run in its own transaction: end at
    most ``left`` more (``DJFLOW_CANCEL_INLINE_RUNS``), none of a tree that started more
    than that, none it would wait for. Whatever it leaves is handed to a ``runs.end_tree``
    task of the tree's root once the transaction commits (``handed``)."""

    def __init__(self, left: int | None = None, *, sweeping: bool = False) -> None:
        self.left = settings.DJFLOW["CANCEL_INLINE_RUNS"] if left is None else left
        # Inside end_orphans: what is left is the sweep's own next batch, not a new task.
        self.sweeping = sweeping
        self.handed: set[str] = set()
        self.sized = False

    def take(self, child_id: Any, *, root_id: Any) -> Run | None:
        """The child (of the tree of ``root_id``), locked, if this end may end it now; else
        None, and the tree's sweep ends it if it has not ended."""
        if not self.sized:
            self.sized = True
            # A tree that started more runs than the budget: all of them are the sweep's,
            # and the end answers at once (100 ended inline took a cancel 1.1 s, under a
            # worker advancing the tree on both cores).
            if RunTree.objects.filter(root_run_id=root_id, runs__gt=self.left).exists():
                self.left = 0
        if self.left <= 0:
            # Live when its parent's end read it: the sweep finds nothing if it ended since.
            self.hand(root_id)
            return None
        child = _lock_now(child_id)
        if child is not None:
            self.left -= 1
            return child
        if Run.objects.filter(id=child_id).exclude(status__in=RUN_TERMINAL).exists():
            self.hand(root_id)
        return None

    def hand(self, root_id: Any) -> None:
        if self.sweeping or str(root_id) in self.handed:
            return
        self.handed.add(str(root_id))
        dispatch.end_tree_on_commit(root_id)


def end_run(
    run: Run,
    status: str,
    *,
    now: datetime,
    output: Any = None,
    error: Mapping[str, Any] | None = None,
    together: Ends | None = None,
) -> bool:
    """End ``run`` (locked by the caller) with ``status``: see the module's docstring. A
    move the table forbids (the run has ended already, say) raises ``IllegalTransition``
    before anything is written. True when every run below it ended in this transaction,
    False when a ``runs.end_tree`` task ends the rest after commit.

    With ``together`` (a batch's, see :class:`Ends`), a top-level run's end is written with
    the batch's other ends when the caller flushes it; the instance shows its end at once."""
    if status not in RUN_TERMINAL:
        raise ValueError(f"{status} is not an end")
    if together is not None and together.takes(run):
        together.add(run, status, now=now, output=output, error=error)
        return True
    below = Below()
    _end(run, status, now=now, output=output, error=error, below=below)
    _wake_parent(run)
    return not below.handed


class Ends:
    """The ends of a batch's runs (``advance_runs``' results recorded together), written
    together when ``flush`` is called, in the batch's transaction: one statement for the
    batch's moves, timers and what the runs leave, instead of one a run. The ends were 27 % of
    the ``advance_runs`` tasks' time with 10,000 runs due at once (py-spy, issue 17's tenth
    session), most of it round trips; the burst took 28 % less once they went together.

    Taken only for a run outside any tree and holding no concurrency slot: nothing else in
    the batch reads it, its children or its key's queue before the flush (the caller's other
    runs are top-level runs of their own). The rest of each end (its rows in flight, its
    children, its slot, notifications, metrics and spans) follows the move at the flush, in
    the batch's order, as ``end_run`` does after a lone move."""

    def __init__(self) -> None:
        self.pending: list[tuple[Run, str, dict[str, Any], datetime]] = []

    @staticmethod
    def takes(run: Run) -> bool:
        return run.parent_run_id is None and run.root_run_id is None and run.concurrency_key is None

    def add(
        self,
        run: Run,
        status: str,
        *,
        now: datetime,
        output: Any,
        error: Mapping[str, Any] | None,
    ) -> None:
        """Take the run's end: checked against the table, shown on the instance at once."""
        changes = _changes(run, status, now=now, output=output, error=error)
        moved(run, changes)
        self.pending.append((run, status, changes, now))

    def flush(self) -> None:
        """Write the ends taken so far, then the rest of each (see the class)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        if connection.vendor != "postgresql":
            found = {run.id: _move_leaving(run.id, changes) for run, _, changes, _ in pending}
        else:
            found = _move_many([(run.id, changes) for run, _, changes, _ in pending])
        below = Below()
        for run, status, _, now in pending:
            left, children = found.get(run.id, ([], []))
            _after_move(run, status, now=now, left=left, children=children, below=below)
            _wake_parent(run)


def cancel_children(rows: Any, *, reason: str, now: datetime) -> None:
    """Cancel, transitively, the child runs of these subworkflow step runs (the planner
    cancelled the rows; their run goes on, and is asked to advance as for any child's end)."""
    children = Run.objects.filter(parent_step_run__in=rows).exclude(status__in=RUN_TERMINAL)
    below = Below()
    for child_id, root_id in children.values_list("id", "root_run_id"):
        # One held by its own advance is the sweep's once its row is free (its subworkflow
        # row, cancelled by the caller, no longer waits for it: ``orphaned``).
        child = below.take(child_id, root_id=root_id)
        if child is not None:
            _cancel(child, reason, now=now, below=below)
            _wake_parent(child)


def let_kinds_close(rows: list[tuple[int, str]], now: datetime) -> None:
    """Open rows about to be cancelled: each kind that keeps something of its own beside
    the row (an approval's request) closes it (``Kind.cancelled``)."""
    by_kind: dict[str, list[int]] = {}
    for row_id, kind in rows:
        by_kind.setdefault(kind, []).append(row_id)
    for name, ids in by_kind.items():
        spec = kinds.get(name)
        if spec is not None and spec.cancelled is not None:
            spec.cancelled(ids, now)


def _changes(
    run: Run, status: str, *, now: datetime, output: Any, error: Mapping[str, Any] | None
) -> dict[str, Any]:
    return run_move(
        run,
        status,
        output=output,
        error=dict(error) if error else None,
        finished_at=now,
        updated_at=now,
    )


def _end(
    run: Run,
    status: str,
    *,
    now: datetime,
    output: Any,
    error: Mapping[str, Any] | None,
    below: Below,
) -> None:
    changes = _changes(run, status, now=now, output=output, error=error)
    # The run's unfired timers are deleted, and what it leaves read, by the statement that
    # moves it (one round trip; an ended run needs no timer).
    left, children = _move_leaving(run.id, changes)
    moved(run, changes)
    _after_move(run, status, now=now, left=left, children=children, below=below)


def _cancel(run: Run, reason: str, *, now: datetime, below: Below) -> None:
    """End ``run`` (locked) cancelled, for ``reason``: a run below one that ended."""
    _end(run, RunStatus.CANCELLED, now=now, output=None, error=cancelled_error(reason), below=below)


def _after_move(
    run: Run,
    status: str,
    *,
    now: datetime,
    left: list[tuple[int, str, str]],
    children: list[Any],
    below: Below,
) -> None:
    """An end's writes after its move (see ``_end``): what the run leaves closed, its slot,
    its counts and spans, its notifications, and the children ``below`` lets it end."""
    # Its slot, if it held one, to the key's next waiting run: durable with the end.
    slots.release(run, now=now)
    # Counted once this transaction commits, never on its path (runs.metrics).
    metrics.run_ended(
        workflow=run.workflow_id,
        status=status,
        started_at=run.started_at or run.created_at,
        finished_at=now,
    )
    # Its spans (run, steps, the attempts no worker ran) once the end commits, if traced.
    tracing.on_run_end(run.id)
    if not run.body:
        # A body run is its parent's business: only a workflow's own run tells its hooks.
        _queue_notifications(run, status, now)
    if left:
        in_flight = StepRun.objects.filter(run=run, status__in=STEP_IN_FLIGHT)
        let_kinds_close([(row_id, kind) for row_id, kind, _ in left], now)
        if status in _CONDITION_FAILS_WITH:
            branches = in_flight.filter(kind__in=kinds.names(Role.BRANCH))
            move_steps(branches, StepStatus.FAILED, finished_at=now)
        move_steps(in_flight, StepStatus.CANCELLED, finished_at=now, claim=None)
        dispatch.revoke_on_commit([task_id for _, _, task_id in left if task_id])
    reason = f"parent run {run.id} {_PARENT_ENDED[status]}"
    for child_id in children:
        child = below.take(child_id, root_id=run.root_run_id or run.id)
        if child is not None:
            _cancel(child, reason, now=now, below=below)
    if left or children or connection.vendor != "postgresql":
        # Deleted again after what closing the rows and children did (a kind's close may
        # arm a timer of the run); a run that completes has nothing left and skips this.
        Timer.objects.filter(run=run, fired_at__isnull=True).delete()


def _queue_notifications(run: Run, status: str, now: datetime) -> None:
    """The document's notify entries that list this end: a delivery row each, in this
    transaction, offered to a worker once it commits (``workers.notify``)."""
    wanted = [
        (index, entry)
        for index, entry in enumerate(document_of(run.version_id).get("notify") or ())
        if status in entry.get("events", ())
    ]
    if not wanted:
        return
    rows = NotifyDelivery.objects.bulk_create(
        NotifyDelivery(
            run=run, entry=index, event=status, url=entry["url"], due_at=now, created_at=now
        )
        for index, entry in wanted
    )
    dispatch.notify_on_commit([row.id for row in rows])


_STEPS, _RUNS, _TIMERS = StepRun._meta.db_table, Run._meta.db_table, Timer._meta.db_table


def _in(statuses: Any) -> str:
    # Constants of the code, in the text: a prepared statement's generic plan can use the
    # partial indexes whose predicates name them (see runs.engine.sql).
    return ", ".join(f"'{status}'" for status in sorted(map(str, statuses)))


def _left_sql(key: str) -> str:
    """What runs leave behind as they end, in one round trip (a run that completes leaves
    nothing, and this is all it reads), each row with the run it is left by (``key`` matches
    the run's id): its rows in flight, and every child run not ended, not only those of its
    rows in flight, since a run's children are its own to end whatever their rows say."""
    return f"""
SELECT run_id, id, kind, celery_task_id, NULL AS child FROM {_STEPS}
 WHERE run_id {key} AND status IN ({_in(STEP_IN_FLIGHT)})
 UNION ALL
SELECT parent_run_id, NULL, NULL, NULL, id FROM {_RUNS}
 WHERE parent_run_id {key} AND status NOT IN ({_in(RUN_TERMINAL)})
"""


# How the statements below match a run's id, or several (Ends). One run by equality: a
# generic plan made for an array expects ten values, and its estimates differ from a lone
# run's.
_ONE, _SEVERAL = "= %s", "= ANY(%s::uuid[])"


def _drop_timers_sql(key: str) -> str:
    """The delete of the ended runs' unfired timers (``key`` matches their ids), found in
    the runs' own index (timer_run_key_unique). Written ``fired_at IS NULL``, the condition
    let the delete use either partial index of unfired timers, and a generic plan made
    while the statistics counted few unfired timers (an empty table, or one analysed
    between bursts) took timer_due, reading every pending timer of every run at each end:
    1.6 ms an end with 10,000 pending, against 0.04 ms (bench/README.md). Postgres does not
    prove an index's ``fired_at IS NULL`` from ``(fired_at IS NULL) IS TRUE``, which holds
    for the same rows (tests/runs/test_timer_claim.py pins both). It stays in the delete's
    own condition, which Postgres checks again on a timer the clock fires meanwhile: that
    timer is kept, fired."""
    return f"DELETE FROM {_TIMERS} WHERE run_id {key} AND (fired_at IS NULL) IS TRUE"


# What a run leaves: (its rows in flight as (id, kind, task id), its children not ended).
Leaving = tuple[list[tuple[int, str, str]], list[Any]]


def _move_leaving(run_id: Any, changes: dict[str, Any]) -> Leaving:
    """Write the run's end (``changes``, conditional on the status table as ``update_run``
    writes it) and read what it leaves. On Postgres one statement (``_move_many``), which
    also deletes the run's unfired timers: a fired run's end was three round trips of its
    seven (the move, this read, the commit)."""
    if connection.vendor != "postgresql":
        update_run(run_id, changes)
        return _left(run_id)
    return _move_many([(run_id, changes)])[run_id]


def _move_many(entries: list[tuple[Any, dict[str, Any]]]) -> dict[Any, Leaving]:
    """``_move_leaving`` for one run or several in one statement (Postgres): each run's
    move a data-modifying WITH of its own (conditional on its status, as ``run_update_sql``
    writes it), their unfired timers deleted, and what each leaves read, keyed by run. The
    read sees the rows as they were before the statement, as it did after the moves: they
    write the runs' own rows only."""
    withs: list[str] = []
    params: list[Any] = []
    for index, (run_id, changes) in enumerate(entries):
        update, update_params = run_update_sql(run_id, changes)
        withs.append(f"moved_{index} AS ({update} RETURNING 1)")
        params += update_params
    keys = [Run._meta.pk.get_db_prep_value(run_id, connection) for run_id, _ in entries]
    key, matched = (_ONE, keys[0]) if len(keys) == 1 else (_SEVERAL, keys)
    # The moves' count rides in a row of its own, the only one whose last column is set:
    # runs that leave nothing return that row alone.
    counted = " + ".join(f"(SELECT count(*) FROM moved_{index})" for index in range(len(withs)))
    sql = (
        f"WITH {', '.join(withs)},"
        f" dropped AS ({_drop_timers_sql(key)})"
        f" SELECT NULL, NULL, NULL, NULL, NULL, {counted}"
        f" UNION ALL SELECT *, NULL FROM ({_left_sql(key)}) AS left_behind"
    )
    found = _found(sql, [*params, matched, matched, matched])
    moves = [row[5] for row in found if row[5] is not None]
    if moves != [len(entries)]:
        if len(entries) == 1:
            (run_id, changes), *_ = entries
            raise RuntimeError(f"run {run_id} cannot become {changes['status']} from its row")
        raise RuntimeError(f"{len(entries) - sum(moves)} of {len(entries)} runs cannot end")
    leaving = _leaving_by_run([row[:5] for row in found if row[5] is None])
    return {run_id: leaving.get(_run_key(run_id), ([], [])) for run_id, _ in entries}


def _left(run_id: Any) -> Leaving:
    """The run's rows in flight and its children that have not ended (not Postgres)."""
    key = Run._meta.pk.get_db_prep_value(run_id, connection)
    return _leaving_by_run(_found(_left_sql(_ONE), [key, key])).get(_run_key(run_id), ([], []))


def _found(sql: str, params: list[Any]) -> list[Any]:
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def _run_key(run_id: Any) -> Any:
    # A run's id as one value whatever it came as: a UUID, its text, or SQLite's 32 hex
    # digits as the database returns it.
    return Run._meta.pk.to_python(run_id)


def _leaving_by_run(found: list[Any]) -> dict[Any, Leaving]:
    leaving: dict[Any, Leaving] = {}
    for run_id, row_id, kind, task_id, child in found:
        left, children = leaving.setdefault(_run_key(run_id), ([], []))
        if child is None:
            left.append((row_id, kind, task_id))
        else:
            children.append(child)
    return leaving


def _lock_now(run_id: Any) -> Run | None:
    """The run, locked, unless it has ended or another transaction holds it: never waited
    for (see the module's docstring). NO KEY UPDATE, as advances lock: inserts that only
    reference the run (a child's start, an advance request) do not wait behind it."""
    run = (
        Run.objects.select_for_update(no_key=True, skip_locked=True)
        .filter(id=run_id)
        .exclude(status__in=RUN_TERMINAL)
        .first()
    )
    return run


# The sweep's batch: runs ended in one transaction (each a few statements; 200 ends are
# about a quarter of a second here), so a batch holds its locks briefly.
SWEEP_BATCH = 200


def orphaned() -> Q:
    """Runs whose parent has ended or whose parent's subworkflow row was cancelled: what an
    end left behind, if they have not ended."""
    return Q(parent_run__status__in=RUN_TERMINAL) | Q(parent_step_run__status=StepStatus.CANCELLED)


def orphans_of(root_id: Any) -> Any:
    """The live runs of the tree of ``root_id`` that its ends left behind."""
    return (
        Run.objects.filter(root_run_id=root_id).exclude(status__in=RUN_TERMINAL).filter(orphaned())
    )


def end_orphans(root_id: Any, *, now: datetime, batch: int = SWEEP_BATCH) -> tuple[int, bool]:
    """End, cancelled, up to ``batch`` of the runs the ends of the tree of ``root_id`` left
    behind (``orphans_of``), in one transaction: locked in id order, skipping those another
    transaction holds (never waiting, so it deadlocks with nothing), their own children left
    to the next batch. Returns (how many it ended, whether any are left: skipped, past the
    batch, or orphaned by these ends)."""
    with transaction.atomic():
        doomed = list(
            orphans_of(root_id)
            .select_for_update(no_key=True, skip_locked=True, of=("self",))
            .annotate(parent_status=F("parent_run__status"))
            .order_by("id")[:batch]
        )
        below = Below(0, sweeping=True)
        for run in doomed:
            ended = _PARENT_ENDED.get(run.parent_status)
            reason = (
                f"parent run {run.parent_run_id} {ended}"
                if ended
                else f"its subworkflow step in run {run.parent_run_id} was cancelled"
            )
            _cancel(run, reason, now=now, below=below)
    return len(doomed), orphans_of(root_id).exists()


def _wake_parent(run: Run) -> None:
    # Asked for, not planned here: the parent's lock is never taken under a child's.
    if run.parent_run_id is not None and request_advance(run.parent_run_id):
        dispatch.advance_on_commit(run.parent_run_id)
