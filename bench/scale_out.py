"""Scale-out and what a step costs (issue 17), measured for ``bench.run_all``.

- :func:`scale_out`: the throughput of ``runs x steps`` concurrent runs with 1, 2 and 4 pool
  processes in one worker, and with two worker nodes (two ``celery worker`` processes with
  pools of their own), beside bare Celery's independent tasks on the same workers; and, for
  each, the CPU the worker processes, the Postgres backends of the bench database and the
  Redis server spent per step, so that the table shows which of them a further process
  would wait on.
- :func:`statement_counts`: the statements (counted in a worker, ``bench.pg_counts``) and
  commits (``pg_stat_database``) per step of the same shape.

Both run on the bench services of ``bench.common`` and time the engine from the journal.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

from bench import common, pg_counts
from tests.processes import CeleryProcess

# (nodes, pool processes per node): one node of 1, 2, 4, then two nodes of 2.
SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (1, 4), (2, 2))


@dataclass(frozen=True)
class ScalePoint:
    """One shape's figures (medians over the repeats; CPU in ms per engine step)."""

    nodes: int
    concurrency: int
    engine: float  # steps/s
    bare: float  # independent tasks/s
    worker_cpu_ms: float
    postgres_cpu_ms: float
    redis_cpu_ms: float
    load: float  # 1-minute load average when the shape began

    @property
    def processes(self) -> int:
        return self.nodes * self.concurrency

    @property
    def label(self) -> str:
        if self.nodes == 1:
            return f"{self.concurrency} pool process{'es' if self.concurrency > 1 else ''}"
        return f"{self.nodes} nodes x {self.concurrency} processes"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _redis_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _worker_pids(workers: list[CeleryProcess]) -> list[int]:
    return [pid for worker in workers for pid in worker.group_pids()]


def _engine_with_cpu(
    runs: int, steps: int, workers: list[CeleryProcess]
) -> tuple[float, float, float, float]:
    """(steps/s, worker, Postgres, Redis CPU ms per step) of one engine measurement."""
    from django.db import connection

    from bench import engine

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        own = cursor.fetchone()[0]

    def sample() -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        backends = [pid for pid in pg_counts.backend_pids(common.DATABASE_URL) if pid != own]
        return (
            pg_counts.cpu_seconds(_worker_pids(workers)),
            pg_counts.cpu_seconds(backends),
            pg_counts.cpu_seconds(_redis_pids()),
        )

    # The CPU is sampled around the whole measurement (starts aside: the worker does not
    # consume while they are made), so it includes the engine's waits on the journal.
    before = sample()
    rate = engine.engine_throughput(runs, steps, workers)
    after = sample()
    total = runs * steps
    worker, postgres, redis_ = (
        pg_counts.cpu_delta(b, a) * 1000 / total for b, a in zip(before, after, strict=True)
    )
    return rate, worker, postgres, redis_


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def scale_out(
    runs: int,
    steps: int,
    repeat: int,
    *,
    loglevel: str = "warning",
    shapes: tuple[tuple[int, int], ...] = SHAPES,
) -> list[ScalePoint]:
    from bench import bare_celery as bare
    from bench import engine

    points = []
    for nodes, concurrency in shapes:
        load = os.getloadavg()[0]
        with common.running_workers(
            nodes,
            concurrency=concurrency,
            loglevel=loglevel,
            workflow_modules=engine.WORKFLOW_MODULES,
        ) as workers:
            # Warm every pool process (imports, connections) before anything is timed.
            bare.throughput(50 * concurrency * nodes, 1, workers)
            engine.engine_throughput(4 * concurrency * nodes, 5, workers)
            bares, measured = [], []
            for _ in range(repeat):
                bares.append(bare.throughput(runs * steps, 1, workers))
                measured.append(_engine_with_cpu(runs, steps, workers))
        columns = list(zip(*measured, strict=True))
        points.append(
            ScalePoint(
                nodes=nodes,
                concurrency=concurrency,
                engine=_median(list(columns[0])),
                bare=_median(bares),
                worker_cpu_ms=_median(list(columns[1])),
                postgres_cpu_ms=_median(list(columns[2])),
                redis_cpu_ms=_median(list(columns[3])),
                load=load,
            )
        )
    return points


def statement_counts(
    runs: int, steps: int, *, concurrency: int = 2, loglevel: str = "warning"
) -> pg_counts.Counts:
    """Statements and commits per step of ``runs`` concurrent runs of ``steps`` steps, on a
    worker that counts its statements (not a timed worker: counting costs a Redis write per
    task)."""
    from bench import engine
    from config.celery import app
    from runs.models import StepRun

    with common.running_workers(
        1,
        concurrency=concurrency,
        loglevel=loglevel,
        include=("bench.bare_celery", "bench.pg_counts"),
        workflow_modules=engine.WORKFLOW_MODULES,
        env={"DJFLOW_BENCH_COUNT_STATEMENTS": "1"},
    ) as workers:
        engine.engine_throughput(4, 5, workers)  # warm: every count so far is flushed
        nodes = common.destinations(workers)
        app.control.cancel_consumer("default", destination=nodes, reply=True, timeout=5)
        try:
            run_ids = engine._start_runs(f"bench_seq_{steps}", runs)
            # Nothing runs now: the starts' commits are flushed and the count begins at zero.
            commits_before, rollbacks_before = pg_counts.settled_transactions(common.DATABASE_URL)
            common.bench_redis().set(pg_counts.STATEMENTS_KEY, 0)
        finally:
            app.control.add_consumer("default", destination=nodes, reply=True, timeout=5)
        with pg_counts.ClientStatements() as client:
            engine._wait(run_ids, timeout=120 + runs * steps * 0.05)
        commits_after, rollbacks_after = pg_counts.settled_transactions(common.DATABASE_URL)
        statements = int(common.bench_redis().get(pg_counts.STATEMENTS_KEY) or 0)
    executed = StepRun.objects.filter(run_id__in=run_ids).count()
    return pg_counts.Counts(
        steps=executed,
        statements=statements,
        # The benchmark's own polls while it waited: one autocommit transaction each.
        commits=commits_after - commits_before - client.count,
        rollbacks=rollbacks_after - rollbacks_before,
    )
