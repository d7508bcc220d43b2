"""Read a run's journal into the planner's views, and its pinned document.

Documents are immutable per version, so each process keeps the parsed ones it has seen.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from functools import cache, lru_cache
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils.dateparse import parse_datetime

from workflows import kinds
from workflows.models import WorkflowVersion

from ..models import Run, StepRun
from .plan import (
    DEFAULT_MAX_STEPS,
    HOLDERS,
    AttemptView,
    Prefix,
    RunView,
    Settings,
    positions_of,
    prefix_applies,
)
from .sql import cursor as prepared_cursor


@lru_cache(maxsize=512)
def document_of(version_id: int) -> dict[str, Any]:
    """The document of a workflow version. Versions never change, so caching is safe."""
    document: dict[str, Any] = WorkflowVersion.objects.values_list("document", flat=True).get(
        id=version_id
    )
    return document


def document_for(run: Run) -> dict[str, Any]:
    """The document a run plans: its version's, or, for an anonymous child run, the body it
    runs (with the version's limits)."""
    if not run.body:
        return document_of(run.version_id)
    return body_document(run.version_id, run.body)


@lru_cache(maxsize=512)
def body_document(version_id: int, body: str) -> dict[str, Any]:
    step_id, _, where = body.partition(".")
    step = steps_of(version_id)[step_id]
    steps = step["do"] if where == "do" else step["branches"][where.split(".", 1)[1]]
    limits = document_of(version_id).get("limits", {})
    return {"id": f"{step_id}-body", "steps": steps, "limits": limits}


def run_view(
    run: Run, attempts: list[AttemptView] | None = None, prefix: Prefix | None = None
) -> RunView:
    """The planner's view of ``run``; given its journal (``attempts``, after ``prefix``), a
    root run that never started a child costs no query for its tree's count."""
    alone = (
        run.root_run_id is None
        and attempts is not None
        and not (prefix is not None and prefix.children)
        and not any(kinds.role_of(a.kind) is kinds.Role.CHILD for a in attempts)
    )
    tree_used, tree_limit = (0, None) if alone else tree_budget(run)
    return RunView(
        id=str(run.id),
        status=run.status,
        input=run.input,
        correlation=run.correlation,
        generation=run.generation,
        started_at=run.started_at,
        deadline_at=run.deadline_at,
        scope=run.input if run.body else None,
        depth=run.depth,
        tree_used=tree_used,
        tree_limit=tree_limit,
        reruns=reruns_of(run),
        budget_added_usd=float(run.budget_added_usd or 0),
    )


def reruns_of(run: Run) -> tuple[tuple[int, str], ...]:
    return tuple((int(r["generation"]), str(r["from_step"])) for r in run.reruns or ())


# Attempts as max_steps counts them (plan._counts_as_attempt), in each run's own generation,
# of every run of the tree but the one planned; runs below the root count from the root's
# (last) start, so a retried root has its budget afresh. Also the root's version.
_TREE_SQL = """
SELECT root.version_id,
       (SELECT count(*)
          FROM {table} AS s
          JOIN {runs} AS d ON d.id = s.run_id
         WHERE (d.root_run_id = root.id OR d.id = root.id) AND d.id <> %(run)s
           AND (d.id = root.id OR d.created_at >= COALESCE(root.started_at, root.created_at))
           AND s.generation = d.generation AND s.status <> 'skipped'
           AND s.kind NOT IN ({uncounted}))
  FROM {runs} AS root
 WHERE root.id = %(root)s
"""


def tree_budget(run: Run) -> tuple[int, int | None]:
    """(attempts counted by the other runs of ``run``'s tree, the root's max_steps or None
    when ``run`` is the root). One indexed query; a run alone in its tree counts none.

    Read without a lock: runs of one tree advancing at once may each see the others' last
    committed count, so a tree can pass its budget by what they plan in one advance each.
    """
    root = run.root_run_id or run.id
    uncounted = ", ".join(f"'{kind}'" for kind in sorted(kinds.names(*HOLDERS)))
    sql = _TREE_SQL.format(
        table=StepRun._meta.db_table, runs=Run._meta.db_table, uncounted=uncounted
    )
    prep = Run._meta.pk.get_db_prep_value
    with connection.cursor() as cursor:
        cursor.execute(sql, {"run": prep(run.id, connection), "root": prep(root, connection)})
        row = cursor.fetchone()
    if row is None:
        return 0, None
    version_id, used = row
    if run.root_run_id is None:
        return int(used), None
    limit = document_of(version_id).get("limits", {}).get("max_steps", DEFAULT_MAX_STEPS)
    return int(used), limit


# A waiting subworkflow row's child run. On Postgres it is looked up by that row (LATERAL,
# kept apart by OFFSET 0): as a plain join, a worker's generic plan made while there were
# few child runs merged the rows with the index of every child run (run_parent_step_run),
# reading all those whose step came before the run's last row, at every step
# (tests/runs/test_journal_plan.py). SQLite has no LATERAL, and plans each statement anew.
_CHILD_JOIN = {
    "postgresql": """LEFT JOIN LATERAL (
    SELECT c.id, c.status, c.output, c.error FROM {runs} AS c
     WHERE s.kind = 'subworkflow' AND s.status = 'waiting' AND c.parent_step_run_id = s.id
    OFFSET 0) AS c ON true""",
    "other": """LEFT JOIN {runs} AS c
    ON s.kind = 'subworkflow' AND s.status = 'waiting' AND c.parent_step_run_id = s.id""",
}


@cache
def _sql(template: str, vendor: str) -> str:
    """``template`` (_JOURNAL_SQL, _JOURNALS_SQL) for the database's ``vendor``."""
    join = _CHILD_JOIN["postgresql" if vendor == "postgresql" else "other"]
    return template.format(table=StepRun._meta.db_table, child=join.format(runs=Run._meta.db_table))


# The planner needs a finish time only to time a retry, and a lease and deadline only for a
# running attempt: the CASEs spare parsing three timestamps on every other row.
_JOURNAL_SQL = """
SELECT s.id, s.step_id, s.path, s.kind, s.attempt, s.generation, s.status, s.branch, s.output,
       s.error, s.effect,
       CASE WHEN s.status IN ('failed', 'timed_out') THEN s.finished_at END,
       CASE WHEN s.status = 'running' THEN s.lease_expires_at END,
       CASE WHEN s.status = 'running' THEN s.deadline_at END,
       CASE WHEN s.status IN ('waiting', 'in_doubt') THEN s.not_before END,
       s.cost_usd, c.id, c.status, c.output, c.error,
       CASE WHEN s.status = 'scheduled' THEN s.budget_wait END
  FROM {table} AS s
  {child}
 WHERE s.run_id = %s AND s.id > %s
 ORDER BY s.id
"""


def journal_of(run_id: Any, *, after: int = 0) -> list[AttemptView]:
    """Every attempt of a run, oldest first; with ``after``, those with a greater id (the
    rows after a settled prefix, see plan.Prefix). Raw SQL: this runs once per step, and the
    ORM's per-row overhead was most of a step's cost on long runs."""
    with prepared_cursor() as cursor:
        send_journal_read(cursor, run_id, after)
        return journal_read(cursor)


def send_journal_read(cursor: Any, run_id: Any, after: int) -> None:
    """Execute :func:`journal_of`'s statement on ``cursor`` (in a pipeline, it is sent with
    the statements around it); :func:`journal_read` makes its rows attempts."""
    pk = Run._meta.pk.get_db_prep_value(run_id, connection)
    cursor.execute(_sql(_JOURNAL_SQL, connection.vendor), [pk, after])


def journal_read(cursor: Any) -> list[AttemptView]:
    return [_attempt(row) for row in cursor.fetchall()]


def kept_through(run_id: Any) -> int:
    """The last row id of the settled prefix this process keeps for the run (0: none), read
    before the run is locked: the journal after it can be read with the lock, in one round
    trip. The planner uses that read only if the prefix still applies (advance_locked)."""
    with _prefix_lock:
        kept = _prefixes.get(run_id)
    return kept[2].through_id if kept is not None else 0


# The journals of several runs in one round trip (a batch of fired runs), each after its own
# settled prefix: the same columns as _JOURNAL_SQL, the run's id first. Postgres only. Each
# run's rows are looked up by the run (LATERAL, kept apart by OFFSET 0): as a plain join of
# the array with the journal, a generic plan made with no statistics of run_id (a fresh
# install's empty tables analysed, the rows counted since by a vacuum) merged the sorted
# array with step_run_journal, reading every entry before the run's id, a random share of
# the table at each batch (tests/runs/test_skewed_plans.py).
_JOURNALS_SQL = """
SELECT s.run_id, s.id, s.step_id, s.path, s.kind, s.attempt, s.generation, s.status, s.branch,
       s.output, s.error, s.effect,
       CASE WHEN s.status IN ('failed', 'timed_out') THEN s.finished_at END,
       CASE WHEN s.status = 'running' THEN s.lease_expires_at END,
       CASE WHEN s.status = 'running' THEN s.deadline_at END,
       CASE WHEN s.status IN ('waiting', 'in_doubt') THEN s.not_before END,
       s.cost_usd, c.id, c.status, c.output, c.error,
       CASE WHEN s.status = 'scheduled' THEN s.budget_wait END
  FROM unnest(%s::uuid[], %s::bigint[]) AS a(run_id, after)
 CROSS JOIN LATERAL (
    SELECT s.run_id, s.id, s.step_id, s.path, s.kind, s.attempt, s.generation, s.status,
           s.branch, s.output, s.error, s.effect, s.finished_at, s.lease_expires_at,
           s.deadline_at, s.not_before, s.cost_usd, s.budget_wait
      FROM {table} AS s WHERE s.run_id = a.run_id AND s.id > a.after OFFSET 0) AS s
  {child}
 ORDER BY s.run_id, s.id
"""


def journals_of(afters: Mapping[Any, int]) -> dict[str, list[AttemptView]]:
    """:func:`journal_of` for several runs (run id -> ``after``), in one statement on
    Postgres; keyed by the runs' ids as strings."""
    found: dict[str, list[AttemptView]] = {str(run_id): [] for run_id in afters}
    if connection.vendor != "postgresql":
        return {str(run_id): journal_of(run_id, after=after) for run_id, after in afters.items()}
    keys = [Run._meta.pk.get_db_prep_value(run_id, connection) for run_id in afters]
    with prepared_cursor() as cursor:
        cursor.execute(
            _sql(_JOURNALS_SQL, connection.vendor),
            [keys, list(afters.values())],
        )
        for row in cursor.fetchall():
            found[str(row[0])].append(_attempt(row[1:]))
    return found


def _attempt(row: Any) -> AttemptView:
    return AttemptView(
        id=row[0],
        step_id=row[1],
        path=row[2],
        kind=row[3],
        attempt=row[4],
        generation=row[5],
        status=row[6],
        branch=row[7],
        output=from_json(row[8]),
        error=from_json(row[9]),
        effect=row[10],
        finished_at=from_timestamp(row[11]),
        lease_expires_at=from_timestamp(row[12]),
        deadline_at=from_timestamp(row[13]),
        not_before=from_timestamp(row[14]),
        cost_usd=float(row[15] or 0),
        child=_child(row[16:20]),
        size=_size(row[8]) + _size(row[9]),
        budget=_budget(row[20]),
    )


def _budget(value: Any) -> dict[str, Any] | None:
    """A scheduled attempt's budget wait: what the planner needs of it (its ``until``)."""
    if value is None:
        return None
    wait = from_json(value)
    return {"until": wait.get("until")} if isinstance(wait, dict) else {}


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes) else 0


# --- settled prefixes (plan.Prefix) ---------------------------------------------------------
#
# Each process keeps the settled beginnings of the runs it planned lately, so that the next
# step of a run it planned reads and walks only the rows after it. A prefix is kept only once
# the transaction that cut it committed (it may have been cut from that transaction's own
# writes), and holds the outputs of its steps: the cache is bounded by their stored bytes and
# by a count of runs, least recently used first out. Another process's plans need no telling:
# a prefix only covers rows that never change, and a stale one is merely shorter.

PREFIX_CACHE_RUNS = 2048
# Stored JSON bytes: parsed into Python objects they take about five to six times as much
# (measured), so this is about 50 MB of each worker process at most.
PREFIX_CACHE_BYTES = 8 * 1024 * 1024
_prefixes: OrderedDict[Any, tuple[int, str, Prefix]] = OrderedDict()
_prefix_bytes = 0
_prefix_lock = threading.Lock()


def prefix_for(run: Run, prefix: Prefix | None = None) -> Prefix | None:
    """The settled prefix to plan ``run`` from: ``prefix`` (one this transaction cut) or the
    one this process kept, if it still applies to the run; else None (plan from the whole
    journal)."""
    if prefix is None:
        with _prefix_lock:
            kept = _prefixes.get(run.id)
            if kept is None:
                return None
            _prefixes.move_to_end(run.id)
        version_id, body, prefix = kept
        if version_id != run.version_id or body != run.body:
            return None
    if not prefix_applies(document_for(run), run.generation, reruns_of(run), prefix):
        return None
    return prefix


def keep_prefix(run: Run, prefix: Prefix) -> None:
    """Keep ``prefix`` for this process's later plans of ``run`` once the transaction commits
    (a rolled back one keeps nothing)."""
    transaction.on_commit(lambda: _keep(run.id, run.version_id, run.body, prefix))


def _keep(run_id: Any, version_id: int, body: str, prefix: Prefix) -> None:
    global _prefix_bytes
    if prefix.size > PREFIX_CACHE_BYTES // 4:
        return
    with _prefix_lock:
        old = _prefixes.pop(run_id, None)
        if old is not None:
            _prefix_bytes -= old[2].size
            if old[2].generation == prefix.generation and old[2].steps > prefix.steps:
                prefix = old[2]  # another plan of this process got further
        _prefixes[run_id] = (version_id, body, prefix)
        _prefix_bytes += prefix.size
        while len(_prefixes) > PREFIX_CACHE_RUNS or _prefix_bytes > PREFIX_CACHE_BYTES:
            _, (_, _, dropped) = _prefixes.popitem(last=False)
            _prefix_bytes -= dropped.size


def forget_prefixes() -> None:
    """Drop every kept prefix (tests; a process that must plan from whole journals)."""
    global _prefix_bytes
    with _prefix_lock:
        _prefixes.clear()
        _prefix_bytes = 0


def positions_for(run: Run) -> Mapping[str, int]:
    """plan.positions_of the document ``run`` plans, kept per version (and body)."""
    return _positions(run.version_id, run.body or "")


@lru_cache(maxsize=512)
def _positions(version_id: int, body: str) -> Mapping[str, int]:
    document = body_document(version_id, body) if body else document_of(version_id)
    return positions_of(document["steps"])


def _child(columns: tuple[Any, ...]) -> dict[str, Any] | None:
    child_id, status, output, error = columns
    if child_id is None:
        return None
    return {
        "id": str(child_id),
        "status": status,
        "output": from_json(output),
        "error": from_json(error),
    }


def from_json(value: Any) -> Any:
    """A JSON column read by a raw cursor: text on both Postgres and SQLite."""
    return json.loads(value) if isinstance(value, str | bytes) else value


def from_timestamp(value: Any) -> datetime | None:
    """A timestamp read by a raw cursor: an aware datetime from Postgres; from SQLite text
    (an expression's value) or a naive datetime (a column's, through Django's converter),
    both in UTC as Django stores them."""
    if value is None:
        return None
    parsed = value if isinstance(value, datetime) else parse_datetime(value)
    if parsed is not None and parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed


def planner_settings() -> Settings:
    return Settings(
        deadline_grace=timedelta(seconds=settings.DJFLOW["DEADLINE_GRACE_SECONDS"]),
        in_doubt=timedelta(seconds=settings.DJFLOW["IN_DOUBT_SECONDS"]),
        max_steps_ceiling=settings.DJFLOW["MAX_STEPS_CEILING"],
    )


@lru_cache(maxsize=512)
def steps_of(version_id: int) -> dict[str, dict[str, Any]]:
    """Every step of a version's document by id, nested ones included (ids are unique)."""
    found: dict[str, dict[str, Any]] = {}

    def visit(steps: list[dict[str, Any]]) -> None:
        for step in steps:
            found[step["id"]] = step
            for name in ("then", "else"):
                visit(step.get(name, []))
            for body in [*step.get("branches", {}).values(), step.get("do")]:
                if isinstance(body, list):
                    visit(body)
                elif isinstance(body, dict):
                    visit([body])

    document = document_of(version_id)
    visit(document["steps"])
    # The on_failure handler's steps are run by workers like any (their ids are unique too).
    visit(document.get("on_failure") or [])
    return found
