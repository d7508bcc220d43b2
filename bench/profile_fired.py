"""``python -m bench.profile_fired``: a fired timer's run on the engine's side alone, in process.

What ``bench.timers``' burst part times end to end (``sleep_until`` one instant, then one
no-op step), without beat, broker or Celery worker: ``--runs`` runs of ``bench_timers_at``
are started and parked on their sleep, their timers made due at once and claimed as the
tick claims them (``runs.engine.timers.claim_due``), then advanced in batches of
``TIMER_ADVANCE_BATCH`` through the worker's own ``workers.execution.advance_and_execute``
(close of the sleep, the step's claim, its body, its record, the run's end). Prints the CPU
and wall milliseconds per fired run, the statements of one batch per run, and with
``--profile`` pyinstrument's profile (``--cprofile``: cProfile's top functions).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

# Generous seconds to start and park one run (about 3 ms here).
PARK_SECONDS = 0.02


def _park(count: int) -> list[Any]:
    """``count`` runs asleep until one instant, past once this returns; returns their ids.
    (The planner reads the instant from the input: a timer made due sooner is re-armed.)"""
    from runs.services import run_start

    at = time.time() + 2 + count * PARK_SECONDS
    run_ids = [
        run_start(workflow="bench_timers_at", input={"at": int(at * 1000)}).run.id
        for _ in range(count)
    ]
    if time.time() >= at:
        raise RuntimeError(f"parking {count} runs took past their instant: a slower machine?")
    time.sleep(at - time.time() + 0.01)
    return run_ids


def _due(run_ids: list[Any]) -> list[list[Any]]:
    """The parked runs' timers due now and claimed as the tick claims them; returns the runs
    in the tick's batches."""
    from django.conf import settings
    from django.utils import timezone

    from runs.engine.timers import _runs_to_advance, claim_due
    from runs.models import Timer

    now = timezone.now()
    # Only the sleeps: the run's deadline timer stays an hour away.
    Timer.objects.filter(run_id__in=run_ids, purpose="sleep", fired_at__isnull=True).update(
        fire_at=now
    )
    ours = set(run_ids)
    # Everything due is claimed, as the tick would, oldest first: what other benches left due
    # in this database (run_all's runs past their deadline, an interrupted profile's sleeps)
    # too, and not advanced. A single bounded claim took only those, none of these runs.
    claimed: list[Any] = []
    batch = 10 * len(run_ids)
    while True:
        taken = claim_due(now, batch)
        claimed += taken
        if len(taken) < batch:
            break
    runs = [run for run in _runs_to_advance(claimed) if run in ours]
    size = settings.DJFLOW["TIMER_ADVANCE_BATCH"]
    return [runs[i : i + size] for i in range(0, len(runs), size)]


def _fire(batches: list[list[Any]]) -> int:
    from workers.execution import advance_and_execute

    return sum(
        advance_and_execute(batch, worker="profile@local", queues={"default", "engine"})
        for batch in batches
    )


def _check(run_ids: list[Any]) -> None:
    from runs.models import Run

    left = Run.objects.filter(id__in=run_ids).exclude(status="completed").count()
    if left:
        raise RuntimeError(f"{left} of {len(run_ids)} fired runs did not complete")


def _round(count: int, around: Callable[[Callable[[], int]], Any] | None = None) -> float:
    """One round of ``count`` fired runs; returns CPU ms per run (and prints it)."""
    from django.db import connection

    from bench.pg_counts import cpu_seconds

    run_ids = _park(count)
    batches = _due(run_ids)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = [int(cursor.fetchone()[0])]
    server = sum(cpu_seconds(backend).values())
    began, cpu = time.perf_counter(), time.process_time()
    if around is None:
        _fire(batches)
    else:
        around(lambda: _fire(batches))
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    server = sum(cpu_seconds(backend).values()) - server
    _check(run_ids)
    per_run = cpu * 1000 / count
    print(
        f"{count} fired runs: {per_run:.2f} ms CPU here, {server * 1000 / count:.2f} ms in"
        f" Postgres, {wall * 1000 / count:.2f} ms wall a run"
    )
    return per_run


def _statements() -> None:
    from django.conf import settings
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    size = settings.DJFLOW["TIMER_ADVANCE_BATCH"]
    run_ids = _park(size)
    batches = _due(run_ids)
    with CaptureQueriesContext(connection) as captured:
        _fire(batches)
    # Read before anything else runs on the connection (the log is read lazily).
    queries = [" ".join(q["sql"].split())[:120] for q in captured.captured_queries]
    _check(run_ids)
    kinds: dict[str, int] = {}
    for sql in queries:
        head = sql.split(" (")[0][:70]
        kinds[head] = kinds.get(head, 0) + 1
    for head, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{n / size:6.2f}  {head}")
    print(f"{len(queries) / size:.2f} statements a fired run (batch of {size})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_fired", description=__doc__)
    parser.add_argument("--runs", type=int, default=300, help="fired runs a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="pyinstrument one more round")
    parser.add_argument("--cprofile", action="store_true", help="cProfile one more round")
    parser.add_argument("--queries", action="store_true", help="one batch's statements")
    parser.add_argument("--sort", default="cumulative", help="cProfile's order (tottime: own time)")
    args = parser.parse_args(argv)
    # No worker process here: this process runs the steps itself.
    os.environ["DJFLOW_START_CHECKS_WORKERS"] = "false"
    from bench import common

    common.configure()
    from workflows.sync import sync_modules

    sync_modules(["bench.timer_flows"])
    _round(20)  # warm: imports, caches, connections
    figures = [_round(args.runs) for _ in range(args.rounds)]
    print(f"median {sorted(figures)[len(figures) // 2]:.2f} ms CPU a fired run")
    if args.queries:
        _statements()
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)

        def profiled(fire: Callable[[], int]) -> None:
            profiler.start()
            fire()
            profiler.stop()

        _round(args.runs, profiled)
        print(profiler.output_text(unicode=False, color=False, show_all=False))
    if args.cprofile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        _round(args.runs, lambda fire: profile.runcall(fire))
        pstats.Stats(profile).sort_stats(args.sort).print_stats(45)


if __name__ == "__main__":
    main()
