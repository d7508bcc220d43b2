"""What a step costs Postgres and the CPU: statements, commits and CPU seconds (issue 17).

Bench-only. ``pg_stat_statements`` is not preloaded on this Postgres
(``SHOW shared_preload_libraries`` is empty), so statements are counted in the worker: a
worker started with ``--include bench.pg_counts`` installs, on every database connection it
opens (Django's ``connection_created``), an execute wrapper that counts the statements the
process sends, and adds its count to a Redis key after each task (one ``INCRBY``; that worker
is used for counting only, never for a timed figure). Commits and rollbacks are
``pg_stat_database``'s ``xact_commit`` / ``xact_rollback`` deltas on the bench database, read
from the maintenance database so that reading them commits nothing on the bench one. CPU
seconds are ``utime + stime`` from ``/proc/<pid>/stat`` of the worker's processes and of the
Postgres backends connected to the bench database.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

STATEMENTS_KEY = "bench:pg_counts:statements"

# --- In the counting worker ----------------------------------------------------------------

_counted = 0


def _count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    global _counted
    _counted += 1
    return execute(sql, params, many, context)


def _install(sender: Any, connection: Any, **kwargs: Any) -> None:
    # The list Django's ``execute_wrapper`` context manager appends to, for the connection's life.
    if _count not in connection.execute_wrappers:
        connection.execute_wrappers.append(_count)


@functools.cache
def _redis() -> Any:
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def _flush(**kwargs: Any) -> None:
    global _counted
    if _counted:
        counted, _counted = _counted, 0
        _redis().incrby(STATEMENTS_KEY, counted)


def _connect() -> None:
    from celery.signals import task_postrun
    from django.db.backends.signals import connection_created

    connection_created.connect(_install, weak=False, dispatch_uid="bench.pg_counts")
    task_postrun.connect(_flush, weak=False, dispatch_uid="bench.pg_counts")


if os.environ.get("DJFLOW_BENCH_COUNT_STATEMENTS") == "1":
    # Only the counting worker sets it; importing this module elsewhere changes nothing.
    _connect()


# --- In the benchmark ----------------------------------------------------------------------


def _maintenance_url(url: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/postgres"))


def _database(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def transactions(url: str) -> tuple[int, int]:
    """(``xact_commit``, ``xact_rollback``) of the database of ``url``, as flushed so far."""
    import psycopg

    with psycopg.connect(_maintenance_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
            [_database(url)],
        ).fetchone()
    if row is None:
        raise RuntimeError(f"no pg_stat_database row for {_database(url)}")
    return int(row[0]), int(row[1])


def settled_transactions(url: str, quiet: float = 11.0) -> tuple[int, int]:
    """:func:`transactions` once every backend has reported its own.

    A Postgres 15 backend flushes its counters at most once a second while busy and, once
    idle, within ``PGSTAT_IDLE_INTERVAL`` (10 s); so the counts are read after ``quiet``
    seconds of no work, and again until two reads a second apart agree.
    """
    time.sleep(quiet)
    last = transactions(url)
    while True:
        time.sleep(1.0)
        now = transactions(url)
        if now == last:
            return now
        last = now


def backend_pids(url: str) -> list[int]:
    """The server processes of the connections to the database of ``url``."""
    import psycopg

    with psycopg.connect(_maintenance_url(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", [_database(url)]
        ).fetchall()
    return [int(pid) for (pid,) in rows]


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """``utime + stime`` of each live process of ``pids``, in seconds."""
    seconds = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces): state is index 0, utime 11.
        fields = text.rsplit(")", 1)[1].split()
        seconds[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    return seconds


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two :func:`cpu_seconds` samples; a process that appeared in
    between counts from zero, one that ended in between is lost (the bench's connections and
    pool processes live through a measurement)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


@dataclass(frozen=True)
class Counts:
    """What ``steps`` steps cost: statements (the worker's count), commits and rollbacks
    (the database's), minus the ones the benchmark's own process made in the window."""

    steps: int
    statements: int
    commits: int
    rollbacks: int

    @property
    def statements_per_step(self) -> float:
        return self.statements / self.steps

    @property
    def commits_per_step(self) -> float:
        return self.commits / self.steps


class ClientStatements:
    """Counts the statements this process sends on Django's connection while installed: the
    benchmark's own polls, each its own transaction (autocommit), to take out of the commits."""

    def __init__(self) -> None:
        self._start = 0
        self.count = 0

    def __enter__(self) -> ClientStatements:
        from django.db import connection

        self._start = _counted
        connection.ensure_connection()
        connection.execute_wrappers.append(_count)
        return self

    def __exit__(self, *exc: object) -> None:
        from django.db import connection

        connection.execute_wrappers.remove(_count)
        self.count = _counted - self._start
