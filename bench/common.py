"""What every benchmark shares: the services, the worker process, the Redis clock, the table.

The benchmarks run on their own services so they never mix with the tests: Redis database 5
for the broker, the results and the measurements, and the Postgres database ``djflow_bench``
(created and migrated on first use). ``DJFLOW_BENCH_DATABASE_URL``, ``DJFLOW_BENCH_REDIS_URL``
override them. The worker is the project's own ``celery -A config worker`` with its settings
(prefork, ``-c 2`` by default), started with the tests' process harness.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from tests.processes import CeleryProcess, purge_broker, service_env, wait_for, worker_process

DATABASE_URL = os.environ.get(
    "DJFLOW_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/djflow_bench"
)
REDIS_URL = os.environ.get("DJFLOW_BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")
KEY_PREFIX = "bench:"
MAX_DOCUMENT_STEPS = "5000"


def configure() -> None:
    """Point this process's Django and Celery app at the bench services, create the database
    if it is missing, and migrate it. Call it before anything reads Django's settings."""
    import django

    os.environ.update(
        DATABASE_URL=DATABASE_URL,
        CELERY_BROKER_URL=REDIS_URL,
        CELERY_RESULT_BACKEND=REDIS_URL,
        DJANGO_SETTINGS_MODULE="config.settings",
    )
    os.environ.pop("SENTRY_DSN", None)
    # The bench's flows include 2,000-step runs (bench_seq_2000), past the default document
    # size (500 steps): every bench that saves them, and its worker, which inherits this.
    os.environ.setdefault("DJFLOW_MAX_DOCUMENT_STEPS", MAX_DOCUMENT_STEPS)
    # Off the embedded default the settings refuse a missing or weak key; the bench's worker
    # processes inherit this one.
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    create_database(DATABASE_URL)
    django.setup()

    from django.conf import settings
    from django.core.management import call_command

    if settings.CELERY_BROKER_URL != REDIS_URL:  # settings were read before configure()
        raise RuntimeError("bench.common.configure() must run before Django's settings load")
    call_command("migrate", interactive=False, verbosity=0)


def vacuum() -> None:
    """``VACUUM ANALYZE`` the bench database, as autovacuum would between figures.

    This machine's Postgres runs with ``autovacuum = off`` (CI's configuration, in
    ``/etc/postgresql/15/main/conf.d/90-ci.conf``), so without it every figure inherits the
    dead rows of the figures before it, and tables never analysed keep no statistics: the
    planner then took the run-end ``DELETE`` of a run's timers through the partial index of
    every unfired timer and its 50,000 dead entries (1.5 ms a run, ``pg_stat_statements``),
    a cost a deployment's autovacuum never lets build up. Dead rows made *during* a figure
    stay, as they would under autovacuum's one-minute naptime.

    Empty tables are left alone, as autovacuum leaves them (a table nothing changed since its
    TRUNCATE is never due). Analysed empty, a table's statistics say 0 pages, and a worker's
    prepared statements, planned once per connection (``runs.engine.sql``), were planned for
    an empty table: sequential scans of ``runs_steprun`` for every claim and record of the
    figure that then filled it. bench.fanout and bench.timers empty their tables before each
    side: their 10,000 items claimed and recorded at 1 to 2 ms each, 0.1 ms once the ids
    passed 32,767 and psycopg prepared them again for int4 parameters (issue 17's ninth
    session; runs.engine.sql now prepares them again as the tables grow).
    """
    import psycopg
    from psycopg import sql

    # The database this process was configured for (bench.timers and bench.fanout have
    # their own).
    with psycopg.connect(os.environ.get("DATABASE_URL", DATABASE_URL), autocommit=True) as conn:
        tables = conn.execute(
            "SELECT schemaname, relname FROM pg_stat_user_tables ORDER BY schemaname, relname"
        ).fetchall()
        filled = [
            sql.Identifier(schema, name)
            for schema, name in tables
            if conn.execute(
                sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(sql.Identifier(schema, name))
            ).fetchone()[0]
        ]
        if filled:
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.SQL(", ").join(filled)))


def create_database(url: str) -> None:
    """``CREATE DATABASE`` the Postgres database of ``url`` unless it exists."""
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    maintenance = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(maintenance, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def bench_redis() -> redis.Redis:
    """Where the tasks write their timestamps and counters (in the broker's database)."""
    return redis.Redis.from_url(REDIS_URL)


@contextlib.contextmanager
def running_worker(
    *,
    concurrency: int = 2,
    pool: str = "prefork",
    loglevel: str = "warning",
    include: Sequence[str] = ("bench.bare_celery",),
    workflow_modules: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[CeleryProcess]:
    """A ``celery -A config worker`` on the bench services, stopped on exit.

    The broker is purged first, so a backlog from an interrupted run cannot skew the figures.
    ``loglevel`` defaults to ``warning``: at ``info`` the worker writes two log lines per task,
    which is a cost of the configuration, not of the engine or of Celery.
    """
    with running_workers(
        1,
        concurrency=concurrency,
        pool=pool,
        loglevel=loglevel,
        include=include,
        workflow_modules=workflow_modules,
        env=env,
    ) as (worker,):
        yield worker


@contextlib.contextmanager
def running_workers(
    count: int,
    *,
    concurrency: int = 2,
    pool: str = "prefork",
    loglevel: str = "warning",
    include: Sequence[str] = ("bench.bare_celery",),
    workflow_modules: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[list[CeleryProcess]]:
    """``count`` workers like :func:`running_worker`'s, each a node of its own (``bench1@``,
    ``bench2@``...) with its own pool of ``concurrency`` processes: the shape of a deployment
    on several machines, on this one."""
    purge_broker()
    with tempfile.TemporaryDirectory(prefix="djflow-bench-") as workdir:
        workers = [
            worker_process(
                env=service_env(
                    database_url=DATABASE_URL,
                    broker_url=REDIS_URL,
                    result_backend=REDIS_URL,
                    workflow_modules=workflow_modules,
                    extra=env,
                ),
                workdir=Path(workdir),
                name=f"bench{n + 1}",
                concurrency=concurrency,
                pool=pool,
                loglevel=loglevel,
                include=include,
            )
            for n in range(count)
        ]
        try:
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.wait_ready(timeout=60)
            yield workers
        except BaseException:
            for worker in workers:
                print(worker.logs()[-3000:])
            raise
        finally:
            for worker in workers:
                worker.stop(timeout=30)


def destinations(workers: CeleryProcess | Sequence[CeleryProcess]) -> list[str]:
    """The node names of one worker or several (remote control's ``destination``)."""
    if isinstance(workers, CeleryProcess):
        return [workers.hostname or ""]
    return [worker.hostname or "" for worker in workers]


def write_rows(path: str, rows: Sequence[Row]) -> None:
    """Hand a sub-benchmark's rows back to ``bench.run_all`` (which runs it in a process of
    its own) as JSON."""
    import dataclasses
    import json

    Path(path).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))


def read_rows(path: str) -> list[Row]:
    import json

    return [Row(**fields) for fields in json.loads(Path(path).read_text())]


def wait_for_key(key: str, timeout: float, worker: CeleryProcess | None = None) -> bytes:
    """Poll Redis for ``key``: the client only watches, the timing is the worker's."""
    client = bench_redis()
    return wait_for(
        lambda: client.get(key),
        timeout=timeout,
        interval=0.005,
        message=(lambda: f"{key}\n{worker.logs()[-5000:]}") if worker else key,
    )


def runs_for(length: int, intervals: int = 199) -> int:
    """How many runs of ``length`` steps a per-step figure averages: enough for ``intervals``
    intervals between steps, as many as one 200-step run has.

    One 10-step run is nine intervals, about 25 ms: one pause of the scheduler there moved
    its per-step figure by a third, and the 2,000-step / 10-step ratio with it (0.83 at one
    sitting, 1.39 at the next with the 2,000-step figure unchanged; issue 17's twelfth
    session). Averaged over 23 runs, the short runs are timed over as many intervals as the
    200-step run, and a pause weighs on each length alike.
    """
    return max(1, -(-intervals // max(1, length - 1)))


def median_of(repeat: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeat))


# --- The table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One comparison. ``unit`` names the figure; ``lower_is_better`` reads the ratio."""

    name: str
    unit: str
    engine: float | None
    bare: float | None
    lower_is_better: bool

    @property
    def ratio(self) -> float | None:
        if self.engine is None or not self.bare:
            return None
        return self.engine / self.bare


def _figure(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def format_table(rows: Sequence[Row]) -> str:
    """``name | engine | bare | ratio`` (ratio = engine / bare), aligned for a terminal."""
    header = ("name", "engine", "bare", "ratio")
    cells = [header]
    for row in rows:
        ratio = "n/a" if row.ratio is None else f"{row.ratio:.2f}x"
        better = "lower is better" if row.lower_is_better else "higher is better"
        cells.append(
            (f"{row.name} ({row.unit}, {better})", _figure(row.engine), _figure(row.bare), ratio)
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [
        " | ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        )
        for line in cells
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
