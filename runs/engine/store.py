"""The writes every step makes, as plain SQL.

An attempt is inserted once and recorded once, on every step of every run: the ORM's query
building was a visible share of a step's cost. Values go through each model field's own
``get_db_prep_save``, so JSON, UUIDs, timestamps and decimals are stored exactly as the ORM
stores them, on Postgres and SQLite alike.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.db.models import Field, Model

from workflows.templates import encoded_size

from ..models import AdvanceRequest, Run, StepRun
from ..status import StepStatus, run_sources, step_sources
from .sql import cursor as prepared_cursor

_TABLE = StepRun._meta.db_table


@functools.cache
def _field(name: str, model: type[Model] = StepRun) -> Field[Any, Any]:
    # Cached: looked up for every value of every row a step writes (py-spy: a visible share
    # of a worker's CPU per step).
    field = model._meta.get_field(name)
    # A reverse relation has no column of its own: every name written here is a column.
    if not isinstance(field, Field):
        raise TypeError(f"{model.__name__}.{name} is a relation, not a column")
    return field


@functools.cache
def _insert_sql(names: tuple[str, ...]) -> str:
    columns = ", ".join(_column(name) for name in names)
    return f"INSERT INTO {_TABLE} ({columns}) VALUES ({', '.join(['%s'] * len(names))})"


def _column(name: str, model: type[Model] = StepRun) -> str:
    column = _field(name, model).column
    if column is None:
        raise TypeError(f"{model.__name__}.{name} has no column")
    return column


def prep_value(name: str, value: Any, model: type[Model] = StepRun) -> Any:
    """``value`` as the ORM writes it to ``model``'s column ``name``."""
    return _field(name, model).get_db_prep_save(value, connection)


@dataclass(frozen=True)
class Increment:
    """A run field's change written as ``column = column + by``: right whatever the row
    held when the caller read it (``stored_bytes``, which fan-out completions add to
    without the run's lock)."""

    by: int


def run_update_sql(run_id: Any, changes: dict[str, Any]) -> tuple[str, list[Any]]:
    """The UPDATE of a run's ``changes``. One that writes a status is conditional on the
    table (``runs.status.RUN_MOVES``): the row must be in a status that may move to it, or
    hold it already (the same status written again is no move)."""

    def assignment(name: str, value: Any) -> str:
        column = _column(name, Run)
        return f"{column} = {column} + %s" if isinstance(value, Increment) else f"{column} = %s"

    assignments = ", ".join(assignment(n, v) for n, v in changes.items())
    params = [
        value.by if isinstance(value, Increment) else prep_value(name, value, Run)
        for name, value in changes.items()
    ]
    params.append(prep_value("id", run_id, Run))
    sql = f"UPDATE {Run._meta.db_table} SET {assignments} WHERE id = %s"
    if "status" in changes:
        target = changes["status"]
        sources = [target, *run_sources(target)]
        sql += f" AND status IN ({', '.join(['%s'] * len(sources))})"
        params += [str(source) for source in sources]
    return sql, params


# A write whose answer nobody reads (a sleep's close), sent as a data-modifying WITH of the
# next statement instead of a round trip of its own: (SQL, parameters).
Rider = tuple[str, list[Any]]


def _riding(riders: Sequence[Rider]) -> tuple[list[str], list[Any]]:
    """The WITH entries of ``riders`` and their parameters, in order. Postgres runs every
    data-modifying WITH once and to completion, whether or not the statement reads it."""
    entries = [f"rider_{index} AS ({sql})" for index, (sql, _) in enumerate(riders)]
    return entries, [param for _, params in riders for param in params]


def send_riders(riders: Sequence[Rider]) -> None:
    """The riders on their own, one statement each (nothing came for them to ride on)."""
    with prepared_cursor() as cursor:
        for sql, params in riders:
            cursor.execute(sql, params)


def update_run(run_id: Any, changes: dict[str, Any], *, riders: Sequence[Rider] = ()) -> None:
    """UPDATE the given fields of a run (locked by the caller), with ``riders`` on Postgres.
    A status the run's row may not move to raises: the caller checked the move on a stale
    instance."""
    sql, params = run_update_sql(run_id, changes)
    if riders:
        entries, rider_params = _riding(riders)
        sql, params = f"WITH {', '.join(entries)} {sql}", rider_params + params
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        if cursor.rowcount != 1 and "status" in changes:
            raise RuntimeError(f"run {run_id} cannot become {changes['status']} from its row")


def insert_attempt(
    values: dict[str, Any],
    *,
    run_id: Any = None,
    run_changes: dict[str, Any] | None = None,
    riders: Sequence[Rider] = (),
) -> int:
    """INSERT one step run and return its id; ``values`` maps field names to values.

    ``run_changes`` (the run's own changed fields) are written too, and ``riders`` sent: on
    Postgres in the same statement, as data-modifying WITHs, which spares a round trip each
    on every step (Postgres only: there are riders only there).
    """
    params = [prep_value(name, value) for name, value in values.items()]
    insert = _insert_sql(tuple(values))
    # RETURNING needs SQLite 3.35; Django 5.2 runs on 3.31, which has only lastrowid.
    returning = connection.features.can_return_columns_from_insert
    with prepared_cursor() as cursor:
        if (run_changes or riders) and connection.vendor == "postgresql":
            entries, with_params = _riding(riders)
            counted = "NULL"
            if run_changes:
                update, update_params = run_update_sql(run_id, run_changes)
                entries.append(f"run_update AS ({update} RETURNING 1)")
                with_params += update_params
                counted = "(SELECT count(*) FROM run_update)"
            cursor.execute(
                f"WITH {', '.join(entries)} {insert} RETURNING id, {counted}",
                with_params + params,
            )
            inserted, updated = cursor.fetchone()
            if run_changes and updated != 1 and "status" in run_changes:
                raise RuntimeError(f"run {run_id} cannot become {run_changes['status']}")
            return int(inserted)
        if run_changes:
            update_run(run_id, run_changes)
        if not returning:
            cursor.execute(insert, params)
            return connection.ops.last_insert_id(cursor, _TABLE, "id")
        cursor.execute(f"{insert} RETURNING id", params)
        return int(cursor.fetchone()[0])


# Rows per multi-row INSERT of a fan-out: well under Postgres's 65,535 parameters a statement
# (an attempt has about 30 columns), and a few hundred kilobytes of SQL.
INSERT_BATCH = 500


def insert_attempts(
    rows: list[dict[str, Any]],
    *,
    run_id: Any = None,
    run_changes: dict[str, Any] | None = None,
    riders: Sequence[Rider] = (),
) -> list[int]:
    """INSERT many step runs (a fan-out's items or branches) and return their ids in order:
    one multi-row statement per ``INSERT_BATCH`` rows on Postgres instead of one per row.
    ``run_changes`` are written first (one UPDATE for the whole fan-out). Every row has the
    same fields. Elsewhere (SQLite without RETURNING), one row at a time."""
    if connection.vendor != "postgresql" or len(rows) < 2:
        last = len(rows) - 1
        return [
            insert_attempt(
                values,
                run_id=run_id,
                run_changes=run_changes if i == last else None,
                riders=riders if i == last else (),
            )
            for i, values in enumerate(rows)
        ]
    names = tuple(rows[0])
    if run_changes:
        update_run(run_id, run_changes, riders=riders)
    elif riders:
        send_riders(riders)
    insert = _insert_unnest_sql(names)
    ids: list[int] = []
    with prepared_cursor() as cursor:
        for start in range(0, len(rows), INSERT_BATCH):
            batch = rows[start : start + INSERT_BATCH]
            cursor.execute(insert, _unnest_columns(names, batch))
            # Postgres inserts and returns the rows of UNNEST in their order (Django's
            # bulk_create on Postgres inserts through UNNEST and counts on it too).
            ids += [int(found[0]) for found in cursor.fetchall()]
    return ids


@dataclass(frozen=True)
class LoneAttempt:
    """One run's lone next attempt (``values``, field names to values), with the run's own
    changed fields and its plan's riders: what ``insert_attempt`` writes for one run."""

    run_id: Any
    values: dict[str, Any]
    run_changes: dict[str, Any]
    riders: Sequence[Rider]


def insert_lone_attempts(entries: Sequence[LoneAttempt]) -> list[int]:
    """The lone attempts of several runs' plans (a batch of fired runs, all locked by the
    caller), each with its run's update and riders, in one statement on Postgres: the
    attempts through one ``UNNEST``, every update and rider a data-modifying ``WITH``.
    Returns the attempts' ids in order. A run whose status may not move as its changes say
    raises (the caller's transaction then rolls the statement back, as for
    ``insert_attempt``). Every attempt has the same fields."""
    if connection.vendor != "postgresql" or len(entries) < 2:
        return [
            insert_attempt(
                entry.values,
                run_id=entry.run_id,
                run_changes=entry.run_changes or None,
                riders=entry.riders,
            )
            for entry in entries
        ]
    withs, params = _riding([rider for entry in entries for rider in entry.riders])
    updates: list[str] = []
    for index, entry in enumerate(entries):
        if entry.run_changes:
            update, update_params = run_update_sql(entry.run_id, entry.run_changes)
            updates.append(f"run_update_{index}")
            withs.append(f"{updates[-1]} AS ({update} RETURNING 1)")
            params += update_params
    names = tuple(entries[0].values)
    counted = " + ".join(f"(SELECT count(*) FROM {name})" for name in updates) or "0"
    insert = f"{_insert_unnest_sql(names)}, {counted}"
    with prepared_cursor() as cursor:
        columns = _unnest_columns(names, [entry.values for entry in entries])
        cursor.execute(f"WITH {', '.join(withs)} {insert}" if withs else insert, params + columns)
        found = cursor.fetchall()
    # A run's update without a status always finds its (locked) row: a count short of the
    # updates is a status the row may not move to (see run_update_sql).
    if found and found[0][1] != len(updates):
        raise RuntimeError(
            f"{len(updates) - found[0][1]} of {len(updates)} runs cannot move as planned"
        )
    # Postgres inserts and returns the rows of UNNEST in their order (see insert_attempts).
    return [int(row[0]) for row in found]


def _unnest_columns(names: tuple[str, ...], rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """``rows``' values as ``_insert_unnest_sql`` takes them: one array a column, each value
    as the ORM writes it. The statement's text is then the same for any number of rows, so
    it is parsed (and prepared) once, not as a VALUES list of 20,000 placeholders that
    psycopg split and Postgres parsed again for every round of a fan-out (py-spy: a fifth of
    a fan-out's advance in psycopg's _split_query)."""
    fields = [_field(name) for name in names]
    return [
        [field.get_db_prep_save(values[name], connection) for values in rows]
        for name, field in zip(names, fields, strict=True)
    ]


@functools.cache
def _insert_unnest_sql(names: tuple[str, ...]) -> str:
    """``INSERT ... SELECT * FROM UNNEST(...) RETURNING id``, one typed array a column, as
    Django's bulk_create writes it on Postgres (its types without their size: no value is
    cut to a ``varchar(n)[]``'s length, the column checks it)."""
    columns = ", ".join(_column(name) for name in names)
    types = [str(_field(name).db_type(connection)).split("(")[0] for name in names]
    arrays = ", ".join(f"(%s)::{db_type}[]" for db_type in types)
    return f"INSERT INTO {_TABLE} ({columns}) SELECT * FROM UNNEST({arrays}) RETURNING id"


def recording(step_run_id: int, claim: Any, values: dict[str, Any]) -> tuple[str, list[Any]]:
    """The UPDATE that records a running attempt's result if the claim still holds."""
    (source,) = step_sources(values["status"], [StepStatus.RUNNING])
    assignments = ", ".join(f"{_column(n)} = %s" for n in values)
    params = [prep_value(name, value) for name, value in values.items()]
    sql = f"UPDATE {_TABLE} SET {assignments} WHERE id = %s AND status = %s AND claim = %s"
    return sql, [*params, step_run_id, str(source), prep_value("claim", claim)]


def record_result(step_run_id: int, claim: Any, values: dict[str, Any]) -> bool:
    """Record a running attempt's result, if the claim still holds; True when it did.

    The fencing check: an attempt given up meanwhile (expired, cancelled) has lost its
    claim, and its late result updates no row.
    """
    sql, params = recording(step_run_id, claim, values)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount == 1)


# --- what a run stores (DJFLOW_MAX_RUN_BYTES) ----------------------------------------------

# The fields of an attempt's result that hold values a handler made (counted against the run).
_CHARGED = ("output", "error", "spans")


def result_bytes(values: dict[str, Any]) -> int:
    """What recording ``values`` stores of a handler's making, as compact UTF-8 JSON (the
    form every bound is stated in): its output, error and spans."""
    return sum(encoded_size(values[name]) for name in _CHARGED if values.get(name))


def max_run_bytes() -> int:
    from django.conf import settings

    return int(settings.DJFLOW["MAX_RUN_BYTES"])


def over_cap_error(what: str, size: int, stored: int | None = None) -> dict[str, Any]:
    """The error (class limit) of a write that would pass DJFLOW_MAX_RUN_BYTES."""
    held = "" if stored is None else f" on top of the {stored} bytes it holds"
    return {
        "class": "limit",
        "message": f"DJFLOW_MAX_RUN_BYTES ({max_run_bytes()}) reached: {what} ({size} bytes)"
        f" would bring what the run stores{held} past it; it was not stored",
    }


def over_cap(values: dict[str, Any], size: int) -> dict[str, Any]:
    """``values`` as recorded when they would pass the run's cap: the attempt failed with
    class limit, none of its output, error or spans kept (same fields, for batch writes)."""
    refused = {**values, "status": StepStatus.FAILED, "output": None, "spans": []}
    refused["error"] = over_cap_error("this attempt's result", size)
    return refused


def charging(run_id: Any, size: int, *, guard: str = "") -> tuple[str, list[Any]]:
    """The UPDATE adding ``size`` to the run's ``stored_bytes`` if that stays within
    DJFLOW_MAX_RUN_BYTES (``RETURNING 1`` when it did). Concurrent completions of one run
    take turns on its row, and each re-reads the total it adds to (READ COMMITTED
    re-checks the condition on the row's latest version), so the total is exact and the
    cap holds however many complete at once. ``guard``: more SQL conditions."""
    table = Run._meta.db_table
    sql = (
        f"UPDATE {table} SET stored_bytes = stored_bytes + %s WHERE id = %s"
        f" AND stored_bytes + %s <= %s{guard} RETURNING 1"
    )
    return sql, [size, prep_value("id", run_id, Run), size, max_run_bytes()]


def record_results_charged(
    entries: Sequence[tuple[Any, int, Any, dict[str, Any]]],
) -> tuple[set[int], dict[str, int]]:
    """:func:`record_results` for several runs' attempts (run id, attempt id, claim, values;
    one a run, each run locked by the caller), each run charged what its result stores in
    the same statement (:func:`charging`). A result that would pass its run's cap is
    recorded failed, class limit (``over_cap``), by a second statement; a charge whose
    result lost its claim is taken back. Returns the ids recorded either way, and what each
    run (by id as a string) was charged."""
    if connection.vendor != "postgresql" or len(entries) < 2:
        recorded, added = set(), {}
        for run_id, step_run_id, claim, values in entries:
            outcome = record_charged(run_id, step_run_id, claim, values)
            if outcome != "lost":
                recorded.add(step_run_id)
            if outcome == "recorded":
                added[str(run_id)] = result_bytes(values)
        return recorded, added
    if len({str(run_id) for run_id, *_ in entries}) != len(entries):
        raise ValueError("one result a run: a run's charges would be added once")
    for status in {values["status"] for *_, values in entries}:
        step_sources(status, [StepStatus.RUNNING])
    sizes = [result_bytes(values) for *_, values in entries]
    names = tuple(entries[0][3])
    columns = _unnest_columns(
        ("id", "claim", *names),
        [{"id": i, "claim": claim, **values} for _, i, claim, values in entries],
    )
    runs = [prep_value("id", run_id, Run) for run_id, *_ in entries]
    with prepared_cursor() as cursor:
        cursor.execute(
            _record_charged_unnest_sql(names),
            [runs, sizes, max_run_bytes(), *columns, str(StepStatus.RUNNING)],
        )
        found = cursor.fetchall()
    recorded = {int(value) for kind, value in found if kind == "recorded"}
    charged = {str(value) for kind, value in found if kind == "charged"}
    refused, added = [], {}
    for (run_id, step_run_id, claim, values), size in zip(entries, sizes, strict=True):
        if str(run_id) not in charged:
            refused.append((step_run_id, claim, over_cap(values, size)))
        elif step_run_id not in recorded:
            refund(run_id, size)
        else:
            added[str(run_id)] = size
    if refused:
        recorded |= record_results(refused)
    return recorded, added


@functools.cache
def _record_charged_unnest_sql(names: tuple[str, ...]) -> str:
    """:func:`_record_unnest_sql` with each attempt's run charged first (``charged``) and
    only the attempts of runs charged recorded; answers ("charged", run id) and
    ("recorded", attempt id) rows."""
    table = Run._meta.db_table
    record = _record_unnest_sql(names).replace(
        " RETURNING s.id", " AND s.run_id IN (SELECT id FROM charged) RETURNING s.id"
    )
    return (
        f"WITH charged AS (UPDATE {table} AS r SET stored_bytes = r.stored_bytes + c.n"
        " FROM UNNEST(%s::uuid[], %s::bigint[]) AS c(id, n)"
        " WHERE r.id = c.id AND r.stored_bytes + c.n <= %s RETURNING r.id),"
        f" recorded AS ({record})"
        " SELECT 'charged', id::text FROM charged"
        " UNION ALL SELECT 'recorded', id::text FROM recorded"
    )


def claim_holds() -> str:
    """:func:`charging`'s guard: the attempt still runs under its claim (a charge for a
    result that cannot be recorded is mostly not made; the rare race is refunded)."""
    return (
        f" AND EXISTS (SELECT 1 FROM {_TABLE} WHERE id = %s"
        f" AND status = '{StepStatus.RUNNING}' AND claim = %s)"
    )


def claim_params(step_run_id: int, claim: Any) -> list[Any]:
    return [step_run_id, prep_value("claim", claim)]


def refund(run_id: Any, size: int) -> None:
    """Take back a charge whose result was not recorded (its claim was lost meanwhile)."""
    if size:
        update_run(run_id, {"stored_bytes": Increment(-size)})


def record_charged(run_id: Any, step_run_id: int, claim: Any, values: dict[str, Any]) -> str:
    """Record a running attempt's result and charge its run what it stores, in one
    statement on Postgres: "recorded"; "refused" when the result would pass the run's
    DJFLOW_MAX_RUN_BYTES (the attempt is recorded failed, class limit, none of its values
    stored); "lost" when the claim no longer holds (nothing written, nothing charged)."""
    size = result_bytes(values)
    update, params = recording(step_run_id, claim, values)
    if connection.vendor == "postgresql":
        charge, charge_params = charging(run_id, size, guard=claim_holds())
        sql = (
            f"WITH charged AS ({charge}),"
            f" recorded AS ({update} AND EXISTS (SELECT 1 FROM charged) RETURNING 1)"
            " SELECT (SELECT count(*) FROM charged), (SELECT count(*) FROM recorded)"
        )
        with prepared_cursor() as cursor:
            cursor.execute(sql, [*charge_params, *claim_params(step_run_id, claim), *params])
            charged, recorded = cursor.fetchone()
    else:
        charge, charge_params = charging(run_id, size)
        with prepared_cursor() as cursor:
            cursor.execute(charge.removesuffix(" RETURNING 1"), charge_params)
            charged = cursor.rowcount
            recorded = charged and record_result(step_run_id, claim, values)
    return settle_charge(run_id, step_run_id, claim, values, size, charged, recorded)


def settle_charge(
    run_id: Any,
    step_run_id: int,
    claim: Any,
    values: dict[str, Any],
    size: int,
    charged: int,
    recorded: int,
) -> str:
    """After a charged record (:func:`record_charged`'s answer): a charge whose record
    lost its claim is taken back; a refused charge records the attempt failed (class
    limit) if its claim holds."""
    if recorded:
        return "recorded"
    if charged:
        refund(run_id, size)
        return "lost"
    if record_result(step_run_id, claim, over_cap(values, size)):
        return "refused"
    return "lost"


def attempts_in_flight(run_id: Any, kinds: frozenset[str], *, besides: int) -> bool:
    """Whether the run has an attempt of one of ``kinds`` scheduled or running, other than
    ``besides``: one index probe (the partial index of in-flight attempts by run), however
    long the journal. A fan-out's completion asks it once, after its commit."""
    if not kinds:
        return False
    names = sorted(kinds)
    with prepared_cursor() as cursor:
        cursor.execute(_in_flight_sql(len(names)), [prep_value("id", run_id, Run), *names, besides])
        return cursor.fetchone() is not None


def _in_flight_sql(kinds: int) -> str:
    """:func:`attempts_in_flight`'s statement for ``kinds`` kinds. The statuses in the text,
    not bound: the partial index's predicate names them, and a prepared statement's generic
    plan could not use it for bound ones."""
    return (
        f"SELECT 1 FROM {_TABLE} WHERE run_id = %s"
        f" AND status IN ('{StepStatus.SCHEDULED}', '{StepStatus.RUNNING}')"
        f" AND kind IN ({', '.join(['%s'] * kinds)}) AND id <> %s LIMIT 1"
    )


def request_advance(run_id: Any) -> bool:
    """Ask for an advance of the run; True when no request was pending (the caller sends
    the message), False when one is: its advance will see this transaction's writes.

    That holds because a pending request is locked (``FOR KEY SHARE``) until the caller's
    transaction ends: the advance takes the request away (``take_advance_request``) before
    it reads the journal, and that ``DELETE`` waits for this transaction to commit. Without
    the lock, an advance taking the request between this statement and the commit read a
    journal without these writes, and nobody asked again: the fan-out stayed open until the
    run's deadline. A request taken away before it could be locked is made anew.
    """
    table = AdvanceRequest._meta.db_table
    run = prep_value("id", run_id, Run)
    with prepared_cursor() as cursor:
        while True:
            cursor.execute(
                f"INSERT INTO {table} (run_id, requested_at) VALUES (%s, %s)"
                " ON CONFLICT DO NOTHING",
                [run, _prep_now()],
            )
            if cursor.rowcount == 1:
                return True
            if connection.vendor != "postgresql":
                # SQLite has one writer at a time: no DELETE comes before this commit.
                return False
            cursor.execute(f"SELECT 1 FROM {table} WHERE run_id = %s FOR KEY SHARE", [run])
            if cursor.fetchone() is not None:
                return False


def take_advance_request(run_id: Any) -> None:
    """Take the run's advance request away (autocommit, before the journal is read). Waits
    for the transactions that found it pending: the journal read next has their writes."""
    with prepared_cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {AdvanceRequest._meta.db_table} WHERE run_id = %s",
            [prep_value("id", run_id, Run)],
        )


def _prep_now() -> Any:
    from django.utils import timezone

    return AdvanceRequest._meta.get_field("requested_at").get_db_prep_save(
        timezone.now(), connection
    )


def record_results(entries: Sequence[tuple[int, Any, dict[str, Any]]]) -> set[int]:
    """:func:`record_result` for several attempts (id, claim, values), in one statement on
    Postgres (a batch of fired runs' results, recorded together); returns the ids recorded.
    Every entry's values have the same fields."""
    if connection.vendor != "postgresql" or len(entries) < 2:
        return {
            step_run_id
            for step_run_id, claim, values in entries
            if record_result(step_run_id, claim, values)
        }
    for status in {values["status"] for _, _, values in entries}:
        # Each result's move, checked against the table as recording() checks one.
        step_sources(status, [StepStatus.RUNNING])
    names = tuple(entries[0][2])
    columns = _unnest_columns(
        ("id", "claim", *names),
        [{"id": i, "claim": claim, **values} for i, claim, values in entries],
    )
    with prepared_cursor() as cursor:
        cursor.execute(_record_unnest_sql(names), [*columns, str(StepStatus.RUNNING)])
        return {int(row[0]) for row in cursor.fetchall()}


@functools.cache
def _record_unnest_sql(names: tuple[str, ...]) -> str:
    """``UPDATE ... FROM UNNEST(...)``: each attempt's result if its claim still holds."""
    every = ("id", "claim", *names)
    types = [str(_field(name).db_type(connection)).split("(")[0] for name in every]
    arrays = ", ".join(f"(%s)::{db_type}[]" for db_type in types)
    aliases = ", ".join(f"v_{_column(name)}" for name in every)
    assignments = ", ".join(f"{_column(n)} = v.v_{_column(n)}" for n in names)
    return (
        f"UPDATE {_TABLE} AS s SET {assignments} FROM UNNEST({arrays}) AS v({aliases})"
        f" WHERE s.id = v.v_id AND s.status = %s AND s.claim = v.v_claim RETURNING s.id"
    )
