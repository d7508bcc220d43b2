"""``advance``: lock the run, plan from the journal, apply, all in one transaction.

Planning is bounded (contract section 9): a caller plans at most a budget of actions (about
one row written each), then hands the rest to a ``runs.advance`` task, which plans on in
rounds for a time budget and then sends itself to the back of the queue.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from workflows import kinds

from .. import dispatch
from ..models import AdvanceRequest, Run, StepRun
from ..status import RUN_TERMINAL
from . import events, journal
from .apply import ClaimAs, Deferred, apply_plan
from .ending import Ends
from .plan import Plan, plan
from .sql import cursor as prepared_cursor
from .store import (
    attempts_in_flight,
    charging,
    claim_holds,
    claim_params,
    record_charged,
    record_results_charged,
    recording,
    request_advance,
    result_bytes,
    settle_charge,
    take_advance_request,
)

logger = logging.getLogger(__name__)

# A plan that opens a wait which an event already there satisfies is planned again at once;
# each round consumes an event, so this only bounds a document of many waits in a row.
MAX_ROUNDS = 100

# What a request plans inline (POST /runs plans a run's first steps in its own transaction,
# as do an event delivery and an approval): at most this many actions, children started on the
# way included. Twenty rows are a few milliseconds here, and a start that needs more (nested
# loops over engine kinds, a fan-out, a fork of subworkflows) no longer grows with the document:
# one such start took the web process to 1.8 GB. The rest goes to a runs.advance task.
REQUEST_ACTIONS = 20
# A runs.advance task (and a step's worker planning the next step) plans in rounds of at most
# ADVANCE_ACTIONS actions, one transaction each, for ADVANCE_SECONDS; a run with more to do
# then asks for another advance (the back of the queue), so one huge run holds no worker long
# and the runs queued behind it go on. 500 rows are about a quarter of a second here.
ADVANCE_ACTIONS = 500
ADVANCE_SECONDS = 1.0


@dataclass
class Budget:
    """The actions one caller may still plan; shared by the child runs it starts."""

    actions: int = REQUEST_ACTIONS


def hand_over(run_id: Any) -> None:
    """Ask for an advance of the run after commit: a task plans what the budget left."""
    if request_advance(run_id):
        dispatch.advance_on_commit(run_id)


def run_advance(*, run_id: Any, seconds: float | None = None) -> Plan | None:
    """Plan and apply the next actions of a run; None when the run does not exist.

    Rounds of at most ADVANCE_ACTIONS actions, each its own transaction, for ``seconds``
    (ADVANCE_SECONDS; 0 for one round): what is left then is another advance's (asked for).

    Idempotent: the run row lock serialises concurrent calls, and each call plans from the
    journal as the previous one left it, so a duplicate finds nothing to do.
    """
    return run_advance_holding(run_id=run_id, seconds=seconds, hold=False)[0]


def run_fan_in(*, run_id: Any) -> Plan | None:
    """A fan-out chord's body (``runs.dispatch.offer_fan_out_on_commit``): advance the run
    unless one of its worker attempts is still in flight; None when it did not.

    Skipping then changes nothing: each attempt in flight asks for the advance its end needs
    (a failure at once, the last success once nothing else is in flight: see
    ``workers.execution._record_inside``), and the reconciler advances a run left quiet. So a
    body that fires early (a header task that handed its items on, the first of a run's
    chords while later rounds run) costs one index probe, not a plan of the whole journal."""
    if attempts_in_flight(run_id, kinds.names(kinds.Role.WORKER), besides=0):
        return None
    return run_advance(run_id=run_id)


def run_advance_holding(
    *, run_id: Any, seconds: float | None = None, hold: bool = True
) -> tuple[Plan | None, tuple[StepRun, str] | None]:
    """:func:`run_advance`, with ``hold`` also the lone new worker attempt it planned and
    did not offer, with its run's workflow id (see apply_plan): committed ``scheduled``, it
    is the caller's to run (a worker claims it like any other) or to offer. Should the
    caller die first, the reconciler offers it after ``LOST_MESSAGE_SECONDS``."""
    until = time.monotonic() + (ADVANCE_SECONDS if seconds is None else seconds)
    # An attempt held back in one round stays the caller's after a later round.
    held: tuple[StepRun, str] | None = None
    while True:
        # Before the journal is read (in a transaction of its own unless the caller has one):
        # a completion committed after this asks again (see store.request_advance).
        take_advance_request(run_id)
        with transaction.atomic():
            run = lock_run(run_id)
            if run is None:
                logger.warning("advance: run %s does not exist", run_id)
                return None, held
            planned, attempt = advance_locked(
                run,
                hold=hold and held is None,
                budget=Budget(ADVANCE_ACTIONS),
                hand_over_rest=False,
            )
            if attempt is not None:
                held = (attempt, run.workflow_id)
            if planned.more and time.monotonic() >= until:
                hand_over(run.id)
                return planned, held
        if not planned.more:
            return planned, held


class BatchFailed(DatabaseError):
    """The transaction of :func:`advance_many` failed (its connection, its commit, or one run's
    advance): none of its runs' advances was written; ``__cause__`` says why."""


def advance_many(
    run_ids: Sequence[Any],
    *,
    hold: bool = False,
    claim_as: ClaimAs | None = None,
    before_commit: Callable[[list[tuple[StepRun, str]]], None] | None = None,
) -> list[tuple[StepRun, str]]:
    """One bounded round of :func:`run_advance_holding` for each run (fired timers' runs), in
    one transaction: one commit for the batch instead of one a run (a commit waits for the
    disk, about 1 ms here, more than a round of a sleeping run's advance costs).

    A run whose advance raises (a plan's bug, a constraint, a deadlock) rolls the whole
    transaction back, with the messages it would have sent (BatchFailed): the caller then
    advances the runs one by one, and only that one fails. Runs are locked in id order, so two
    batches of the same runs
    (a redelivered message beside the reconciler's) take turns instead of deadlocking. With
    ``hold``, returns each run's lone new attempt left for the caller (see apply_plan) with
    its workflow id, in that order, each inserted claimed when ``claim_as`` says so (see
    apply_plan); ``before_commit`` sees them inside the transaction (a worker claims the
    first it runs there). A run left with more to plan asks for an advance
    task, as a one-round ``run_advance`` does.

    Raises :class:`BatchFailed` when a run's advance or the transaction fails: nothing of it
    was written (unless the commit went through unacknowledged), and the caller advances the
    runs one by one. A run advanced twice plans nothing new the second time.
    """
    ordered = sorted(dict.fromkeys(map(str, run_ids)))
    # Autocommit, before any journal is read, as run_advance takes each run's request.
    take_advance_requests(ordered)
    held: list[tuple[StepRun, str]] = []
    # The lone next attempts of the runs read together, inserted together (one statement
    # for the batch instead of one a run): a run read on its own (inside a tree) may read
    # what the runs before it wrote, so they are inserted before it is advanced.
    deferred = Deferred()
    try:
        with transaction.atomic():
            read = _read_many(ordered)
            for run_id in ordered:
                # No savepoint a run: two round trips each (SAVEPOINT, RELEASE), a sixth of
                # a fired run's statements. A run that raises rolls the chunk back, and the
                # caller advances its runs one by one (BatchFailed): that run alone fails.
                try:
                    run, first = read.get(run_id) or (None, None)
                    if run is None:
                        deferred.flush()
                        run = lock_run(run_id)
                    if run is None:
                        logger.warning("advance: run %s does not exist", run_id)
                        continue
                    _, attempt = advance_locked(
                        run,
                        hold=hold,
                        budget=Budget(ADVANCE_ACTIONS),
                        claim_as=claim_as,
                        read=first,
                        defer=deferred if first is not None else None,
                    )
                except Exception as error:
                    raise BatchFailed(f"advancing run {run_id} failed") from error
                if attempt is not None:
                    held.append((attempt, run.workflow_id))
            try:
                deferred.flush()
            except Exception as error:
                raise BatchFailed(f"inserting {len(ordered)} runs' next attempts failed") from error
            if before_commit is not None:
                before_commit(held)
    except DatabaseError as error:
        raise BatchFailed(f"advancing {len(ordered)} runs in one transaction failed") from error
    return held


def _read_many(run_ids: list[str]) -> dict[str, tuple[Run, tuple[int, list[Any]]]]:
    """Lock the runs (in id order) and read their journals, two statements for them all:
    each top-level run with the journal after its kept prefix, for the first round of its
    advance. A run inside a tree is read again in its own turn: an advance of its parent or
    root earlier in the batch may have ended it or its rows (an advance writes its own run
    and that run's descendants only, so a top-level run's read stays true)."""
    if connection.vendor != "postgresql" or len(run_ids) < 2:
        return {}
    runs = lock_runs(run_ids)
    afters: dict[str, int] = {}
    for run_id, run in runs.items():
        if run.root_run_id is None and run.parent_run_id is None:
            prefix = journal.prefix_for(run)
            afters[run_id] = prefix.through_id if prefix is not None else 0
    journals = journal.journals_of(afters)
    return {run_id: (runs[run_id], (after, journals[run_id])) for run_id, after in afters.items()}


def take_advance_requests(run_ids: Sequence[Any]) -> None:
    """``store.take_advance_request`` for several runs, in one statement (autocommit)."""
    if connection.vendor != "postgresql" or len(run_ids) < 2:
        for run_id in run_ids:
            take_advance_request(run_id)
        return
    keys = [Run._meta.pk.get_db_prep_value(run_id, connection) for run_id in run_ids]
    with prepared_cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {AdvanceRequest._meta.db_table} WHERE run_id = ANY(%s::uuid[])", [keys]
        )


def lock_run(run_id: Any) -> Run | None:
    """The run's row, locked until the transaction ends (``SELECT ... FOR UPDATE``).

    A raw query: it runs once per step, and the ORM's query building was a visible share
    of a step's cost.
    """
    # NO KEY UPDATE: advances still take turns, but inserts that only reference the run (an
    # attempt's deadline timer at its claim, an advance request) do not wait behind one.
    lock = " FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    pk = Run._meta.pk.get_db_prep_value(run_id, connection)
    with prepared_cursor() as cursor:
        cursor.execute(f"SELECT {_RUN_COLUMNS} FROM {Run._meta.db_table} WHERE id = %s{lock}", [pk])
        row = cursor.fetchone()
    return None if row is None else _run_of(row)


def lock_run_recording(
    run_id: Any, step_run_id: int, claim: Any, values: dict[str, Any]
) -> tuple[Run | None, bool]:
    """``lock_run`` and ``store.record_result`` (the run locked first, as always), in one
    round trip on Postgres: (the run or None, whether the attempt's result was recorded).
    A worker records each step so; the two statements were two of a step's seven."""
    run, recorded, _ = lock_run_recording_reading(run_id, step_run_id, claim, values)
    return run, recorded


def lock_run_recording_reading(
    run_id: Any,
    step_run_id: int,
    claim: Any,
    values: dict[str, Any],
    *,
    after: int | None = None,
) -> tuple[Run | None, bool, tuple[int, list[Any]] | None]:
    """:func:`lock_run_recording`, and with ``after`` the run's journal after that row id,
    read under the lock in the same round trip on Postgres (pipelined: the two statements
    go together, the read runs once the lock is taken): ``advance_locked``'s ``read``.
    A step's round trips were the lock with the record, the journal, the next attempt's
    insert and the commit; now three."""
    if connection.vendor != "postgresql":
        run = lock_run(run_id)
        recorded = run is not None and _charged(run, step_run_id, claim, values)
        read = None
        if run is not None and after is not None:
            read = (after, journal.journal_of(run_id, after=after))
        return run, recorded, read
    update, params = recording(step_run_id, claim, values)
    size = result_bytes(values)
    charge, charge_params = charging(
        run_id, size, guard=f" AND EXISTS (SELECT 1 FROM locked){claim_holds()}"
    )
    # The run's lock is taken as the UPDATE's condition reads ``locked``, before the
    # attempt's row is: the order every transaction of the engine takes them in. The run is
    # charged what the result stores in the same statement (DJFLOW_MAX_RUN_BYTES): a result
    # over the cap is not written.
    sql = (
        f"WITH locked AS (SELECT {_RUN_COLUMNS} FROM {Run._meta.db_table}"
        " WHERE id = %s FOR NO KEY UPDATE),"
        f" charged AS ({charge}),"
        f" recorded AS ({update} AND EXISTS (SELECT 1 FROM charged) RETURNING 1)"
        " SELECT locked.*, (SELECT count(*) FROM charged), (SELECT count(*) FROM recorded)"
        " FROM locked"
    )
    rows = None
    with prepared_cursor() as cursor, prepared_cursor() as reader, _pipelined():
        cursor.execute(
            sql,
            [
                Run._meta.pk.get_db_prep_value(run_id, connection),
                *charge_params,
                *claim_params(step_run_id, claim),
                *params,
            ],
        )
        if after is not None:
            journal.send_journal_read(reader, run_id, after)
        row = cursor.fetchone()
        if after is not None:
            rows = journal.journal_read(reader)
    if row is None:
        return None, False, None
    run = _run_of(row[:-2])
    outcome = settle_charge(run_id, step_run_id, claim, values, size, row[-2], row[-1])
    if outcome == "recorded":
        # ``locked`` was read before the charge: the plan sees the run's total with it.
        run.stored_bytes += size
    elif outcome == "refused" and rows is not None:
        # The journal was read with the attempt still running: read it again.
        rows = journal.journal_of(run_id, after=after or 0)
    return run, outcome != "lost", None if rows is None else (after or 0, rows)


def _charged(run: Run, step_run_id: int, claim: Any, values: dict[str, Any]) -> bool:
    """Record a result charged against its (locked) run: whether a row was written."""
    outcome = record_charged(run.id, step_run_id, claim, values)
    if outcome == "recorded":
        run.stored_bytes += result_bytes(values)
    return outcome != "lost"


def lock_runs_recording_reading(
    entries: Sequence[tuple[Any, int, Any, dict[str, Any], int | None]],
) -> list[tuple[Run | None, bool, tuple[int, list[Any]] | None]]:
    """:func:`lock_run_recording_reading` for several top-level runs' attempts (run id,
    attempt id, claim, values, ``after``; a batch's results, one a run), in three statements
    for them all instead of two each on Postgres: the runs locked in id order, the results
    recorded, the journals read. Each run's plan may use its read: a plan writes its own run
    and that run's descendants only (see _read_many)."""
    if connection.vendor != "postgresql":
        return [
            lock_run_recording_reading(run_id, step_run_id, claim, values, after=after)
            for run_id, step_run_id, claim, values, after in entries
        ]
    runs = lock_runs([run_id for run_id, *_ in entries])
    mine = [entry for entry in entries if str(entry[0]) in runs]
    # Each run charged what its result stores, in the statement that records it.
    recorded, added = record_results_charged(
        [(run_id, step_run_id, claim, values) for run_id, step_run_id, claim, values, _ in mine]
    )
    for run_id, size in added.items():
        # Locked and read before the charge: the plans see the runs' totals with it.
        runs[run_id].stored_bytes += size
    afters = {str(entry[0]): entry[4] for entry in mine if entry[4] is not None}
    journals = journal.journals_of(afters) if afters else {}
    return [
        (
            runs.get(str(run_id)),
            step_run_id in recorded,
            (after, journals[str(run_id)]) if after is not None and str(run_id) in afters else None,
        )
        for run_id, step_run_id, _, _, after in entries
    ]


@contextlib.contextmanager
def _pipelined() -> Iterator[None]:
    """psycopg's pipeline mode for the first statement of a transaction: the ``BEGIN`` it
    sends first is then sent with it, not a round trip of its own (one of a step's five)."""
    import psycopg

    raw = connection.connection
    if raw is None or connection.get_autocommit() or not psycopg.Pipeline.is_supported():
        yield
        return
    with connection.wrap_database_errors, raw.pipeline():
        yield


def lock_runs(run_ids: Sequence[Any]) -> dict[str, Run]:
    """:func:`lock_run` for several runs in one statement, locked in id order; keyed by the
    runs' ids as strings (a run that does not exist is missing)."""
    keys = [Run._meta.pk.get_db_prep_value(run_id, connection) for run_id in run_ids]
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT {_RUN_COLUMNS} FROM {Run._meta.db_table} WHERE id = ANY(%s::uuid[])"
            " ORDER BY id FOR NO KEY UPDATE",
            [keys],
        )
        rows = cursor.fetchall()
    found = {}
    for row in rows:
        run = _run_of(row)
        found[str(run.id)] = run
    return found


def _run_of(row: Any) -> Run:
    # What a queryset does with a row: each field's converters (JSON, encrypted fields),
    # then the model's own from_db (which marks it as loaded from the database).
    values = []
    for value, (field, converters) in zip(row, _run_converters(), strict=True):
        for convert in converters:
            value = convert(value, field, connection)
        values.append(value)
    return Run.from_db(connection.alias, _RUN_NAMES, values)


# Every concrete field of a run, in the model's order (Model.from_db takes them so).
_RUN_COLUMNS = ", ".join(
    connection.ops.quote_name(str(field.column)) for field in Run._meta.concrete_fields
)
_RUN_NAMES = [field.attname for field in Run._meta.concrete_fields]


@functools.cache
def _run_converters() -> list[tuple[Any, list[Any]]]:
    found = []
    for field in Run._meta.concrete_fields:
        column = field.get_col(Run._meta.db_table)
        found.append(
            (column, connection.ops.get_db_converters(column) + field.get_db_converters(connection))
        )
    return found


def advance_locked(
    run: Run,
    *,
    hold: bool = False,
    budget: Budget | None = None,
    hand_over_rest: bool = True,
    claim_as: ClaimAs | None = None,
    read: tuple[int, list[Any]] | None = None,
    defer: Deferred | None = None,
    ends: Ends | None = None,
) -> tuple[Plan, StepRun | None]:
    """The body of :func:`run_advance` for a caller that already holds the run's lock;
    with ``hold``, also the lone new attempt left for the caller to run (see apply_plan),
    inserted claimed when ``claim_as`` says so.

    Plans at most ``budget`` actions (REQUEST_ACTIONS unless given), child runs it starts
    included; when there is more to plan (``Plan.more``) an advance task is asked for, unless
    ``hand_over_rest`` is false (the caller plans on itself). ``read`` is the run's journal
    after a row id, read by the caller under the lock (a batch reads several runs' at once):
    the first round uses it if it plans from that row, and reads the journal itself if not.
    ``defer`` (a batch's, see apply_plan) may take a held attempt's insert: the attempt has
    its id once the caller flushes it. ``ends`` (a batch's, see ``ending.Ends``) may take the
    run's end: it is written when the caller flushes it.

    A wait_event the plan opened takes an event that arrived before it (after the run
    started), and the run is planned again from there, in the same transaction.
    """
    if run.concurrency_key is not None and run.admitted_at is None:
        # Waiting for a concurrency slot (runs.engine.slots): nothing is planned until its
        # key admits it, and nothing here asks for one (the lock order: gate, then runs).
        return Plan(), None
    budget = budget if budget is not None else Budget()
    # An attempt held back in one round (not offered) is the caller's even when a later
    # round, planned again after a hand-off or a taken event, holds nothing.
    held: StepRun | None = None
    # The run's settled beginning (plan.Prefix): this process's from an earlier plan, then
    # the one each round cuts (its rows, this transaction's writes among them, are seen here).
    prefix = journal.prefix_for(run)
    for round_ in range(MAX_ROUNDS):
        if round_ and defer is not None:
            # A round reads the journal: nothing this advance wrote may wait (a deferring
            # plan is its advance's last, but this costs nothing when nothing is pending).
            defer.flush()
        now = timezone.now()
        prefix = journal.prefix_for(run, prefix) if prefix is not None else None
        checked = prefix is not None and settings.DJFLOW["CHECK_PREFIX"]
        if checked:
            # The check plans from the same read of the whole journal: a completion committed
            # between two reads (inside a composite step, recorded without the run's lock)
            # would be a difference that is not the prefix's.
            whole = journal.journal_of(run.id)
            attempts = [a for a in whole if prefix is not None and a.id > prefix.through_id]
        else:
            after = prefix.through_id if prefix else 0
            if read is not None and read[0] == after:
                attempts = read[1]
            else:
                attempts = journal.journal_of(run.id, after=after)
        read = None
        document = journal.document_for(run)
        view = journal.run_view(run, attempts, prefix)
        planned = plan(
            document,
            view,
            attempts,
            now,
            journal.planner_settings(),
            max_actions=budget.actions,
            prefix=prefix,
            positions=journal.positions_for(run),
        )
        if checked:
            _check_prefix(run, planned, whole, view, now, budget.actions)
        if planned.prefix is not None:
            prefix = planned.prefix
            journal.keep_prefix(run, prefix)
        budget.actions -= len(planned.actions)
        holding = hold and held is None
        applied = apply_plan(
            run,
            planned,
            now,
            hold=holding,
            claim_as=claim_as if holding else None,
            defer=defer if holding else None,
            ends=ends,
        )
        held = held or applied.held
        if run.status in RUN_TERMINAL:
            # The plan ended the run beside what it opened (a parallel step's first branch
            # began, a later one past a limit): the end cancelled it; nothing goes on.
            return planned, held
        for child in applied.children:
            # A child run's first steps are planned in this transaction (as run_start plans
            # a run's) while the budget lasts; past it, an advance task plans them. A
            # subworkflow calling itself once recursed here until Python's stack ran out (a
            # 500 on every start): the chain's depth (at most 8, see plan) and the budget
            # bound it now.
            if budget.actions > 0:
                advance_locked(child, budget=budget)
            else:
                hand_over(child.id)
        if planned.more:
            if hand_over_rest:
                hand_over(run.id)
            return planned, held
        taken = [wait for wait in applied.waits if events.take_event(run, wait)]
        if not taken and not applied.replan:
            return planned, held
    logger.warning("advance: run %s planned %d rounds in a row; stopping", run.id, MAX_ROUNDS)
    return planned, held


def _check_prefix(
    run: Run, planned: Plan, attempts: list[Any], view: Any, now: Any, max_actions: int
) -> None:
    """The engine's own tests (DJFLOW_CHECK_PREFIX): a plan from a prefix must be the plan
    the whole journal (``attempts``, the same read) gives, or the prefix stood for rows it
    should not have. The run's view is the same too (its tree's count is read unlocked)."""
    whole = plan(
        journal.document_for(run),
        view,
        attempts,
        now,
        journal.planner_settings(),
        max_actions=max_actions,
    )
    mine = (planned.actions, planned.waiting, planned.approval, planned.budget, planned.more)
    theirs = (whole.actions, whole.waiting, whole.approval, whole.budget, whole.more)
    if mine != theirs:
        raise AssertionError(f"run {run.id}: from a prefix {mine}, from the journal {theirs}")
