"""The cursor of the statements every step sends: prepared on the server.

Django's psycopg cursors bind parameters on the client and never prepare, so Postgres parses,
analyses and plans each statement every time. For the handful of statements a step sends
(claim, record, insert the next attempt, read the journal) that was more of Postgres's time
than running them: on 16 runs of 200 steps, 0.59 ms a step of planning against 0.37 ms of
execution (``pg_stat_statements``, issue 17). This cursor binds on the server, and psycopg
prepares a statement once per connection from its second use (``prepare_threshold``, set in
the settings with ``DJFLOW_DB_PREPARED_STATEMENTS``), keeping the 100 latest per connection.

Its statements must be valid with ``$n`` parameters: no parameter where Postgres needs a
literal (``interval %s`` is not, ``%s * interval '1 second'`` is), and a parameter's type
given where the statement leaves it open (``%s::uuid``). Statuses and other constants of
the code are written into the text, not bound: a generic plan cannot use a partial index
whose predicate names a bound value.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.postgresql.base import TIMESTAMPTZ_OID, ServerBindingCursor
from django.db.backends.postgresql.psycopg_any import register_tzloader
from psycopg import Error
from psycopg.pq import Format

logger = logging.getLogger(__name__)

# Typed as Any: django-stubs know this backend class only as the psycopg 2 fallback.
_ServerBindingCursor: Any = ServerBindingCursor


class _PreparingCursor(_ServerBindingCursor):  # type: ignore[misc]
    # psycopg 3.3 leaves the cursor's query unset when it runs a prepared statement; Django's
    # query log (CaptureQueriesContext, DEBUG) reads the SQL from it, and would log None.
    def _send_query_prepared(self, name: bytes, pgq: Any, **kwargs: Any) -> None:
        self._query = pgq
        super()._send_query_prepared(name, pgq, **kwargs)


def _prepares(db: Any) -> bool:
    return bool(
        db.vendor == "postgresql"
        and db.settings_dict["OPTIONS"].get("prepare_threshold") is not None
    )


def generic_plans(sender: Any, connection: Any, **_: Any) -> None:
    """On each new Postgres connection that prepares (Django's ``connection_created``): plan
    the prepared statements once, generically, instead of again at each run.

    Postgres otherwise plans a prepared statement afresh while its generic plan's estimate
    is above the custom ones', which a range (the journal's ``s.id > %s``) always is: the
    journal read was planned at every step (0.27 ms of Postgres a step, ``pg_stat_statements``
    on 1,000 runs of 5 steps), while its generic plan is the same index range scan. Only
    this module's statements are prepared, so nothing else is planned generically.
    """
    if _prepares(connection):
        with connection.cursor() as setting:
            setting.execute("SET plan_cache_mode = force_generic_plan")


def cursor() -> Any:
    """A cursor on the default connection (in its transaction, through Django's execute
    wrappers, so query capture and counts see its statements) that prepares on Postgres
    when prepared statements are on; Django's own cursor otherwise."""
    # The connection itself, not the proxy: each attribute of django.db.connection is a
    # lookup through a context-local (a visible share of a step's CPU, measured by py-spy).
    db = connections[DEFAULT_DB_ALIAS]
    if not _prepares(db):
        return db.cursor()
    db.ensure_connection()
    raw_connection = db.connection
    _replan_if_grown(db, raw_connection)
    # What db.cursor() does (_cursor -> create_cursor -> _prepare_cursor), with the
    # server-binding cursor class Django uses under OPTIONS' server_side_binding.
    with db.wrap_database_errors:
        raw = _PreparingCursor(raw_connection)
        if _other_timezone(raw_connection, db.timezone):
            register_tzloader(db.timezone, raw)
    return db._prepare_cursor(raw)  # type: ignore[attr-defined]


def _other_timezone(raw_connection: Any, timezone: Any) -> bool:
    # As create_cursor: a cursor needs its own loader only when the connection's differs.
    loader = raw_connection.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
    return bool(timezone != loader.timezone)


# The tables every step's statements read by key. Statements prepared while they were small
# keep plans made for their size (below).
GROWING_TABLES = ("runs_steprun", "runs_run", "runs_timer")
# How often a connection compares their size with the size its plans were made at.
REPLAN_CHECK_SECONDS = 5.0
# Plans are made again once the tables are this many times the size they were made at (and
# at least REPLAN_MIN_PAGES more): once tables are a few pages, an index lookup is cheaper
# than a scan whatever their size, so plans settle after a few doublings.
REPLAN_GROWTH = 2
REPLAN_MIN_PAGES = 8


@dataclass
class _Plans:
    raw: Any  # the psycopg connection they were prepared on
    pages: list[int] | None  # each table's pages when they were (about) made
    checked: float  # time.monotonic() of the last look
    replans: int = 0


def _replan_if_grown(db: Any, raw_connection: Any) -> None:
    """Drop this connection's prepared statements (psycopg prepares them again on their next
    uses) once the tables they read have grown well past the size their plans were made at.

    A prepared statement's plan is made once, generically (generic_plans), from the tables'
    size at that moment: a worker that started while ``runs_steprun`` held a few rows planned
    a sequential scan for the claim and the record of every attempt, and kept those plans
    while a fan-out filled the table with 10,000 rows: 1 to 2.5 ms a statement instead of 0.1,
    growing with the table (issue 17's ninth session, bench.fanout at 10,000 items). Postgres
    plans again on its own after an ANALYZE, which autovacuum makes only once a minute at
    best, and never where it is off.
    """
    now = time.monotonic()
    plans = getattr(db, "_djflow_plans", None)
    if plans is None or plans.raw is not raw_connection:
        plans = db._djflow_plans = _Plans(raw=raw_connection, pages=None, checked=now)
    elif now < plans.checked + REPLAN_CHECK_SECONDS:
        return
    if db.in_atomic_block or not db.get_autocommit() or raw_connection.pgconn.pipeline_status:
        # Between transactions only (a worker claims each task's first attempt there): a
        # look that fails must not end the caller's transaction.
        return
    plans.checked = now
    # On psycopg's own cursor, not Django's: the look is not one of the statements a step
    # is counted by (tests, bench.pg_counts' per-step figures count Django's). to_regclass:
    # no error before the tables exist. Never prepared (prepare=False): nothing to drop.
    try:
        with raw_connection.cursor() as looking:
            looking.execute(
                "SELECT coalesce(pg_relation_size(to_regclass(t)), 0)"
                " / current_setting('block_size')::int FROM unnest(%s::text[]) AS t",
                [list(GROWING_TABLES)],
                prepare=False,
            )
            pages = [int(row[0]) for row in looking.fetchall()]
            if plans.pages is None or len(plans.pages) != len(pages):
                plans.pages = pages
            elif any(
                size >= max(made * REPLAN_GROWTH, made + REPLAN_MIN_PAGES)
                for size, made in zip(pages, plans.pages, strict=True)
            ):
                # psycopg reads this statement's status and forgets its own prepared
                # statements too (psycopg/_preparing.py, _should_discard), and the next uses
                # prepare them anew. It reads the status of a text it has not seen before
                # only: hence a new one each time (a second plain DEALLOCATE ALL went
                # unnoticed, and psycopg ran statements the server no longer had).
                plans.replans += 1
                looking.execute(f"DEALLOCATE ALL /* replan {plans.replans} */", prepare=False)
                plans.pages = pages
            else:
                # A table that shrank (retention, TRUNCATE) is planned again by Postgres for
                # its new size: its growth counts from there.
                plans.pages = list(map(min, pages, plans.pages))
    except Error:
        logger.warning("could not compare the tables' size with the plans'", exc_info=True)
