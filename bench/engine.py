"""The engine's half of issue 3's benchmark.

Each function runs against the worker ``bench.run_all`` started (the same worker, broker and
settings as the bare-Celery figures) and times the work from the journal in Postgres (the
first step's start to the last step's finish), never from a client waiting on results.
"""

from __future__ import annotations

import time
from typing import Any

from django.db.models import Max, Min

# Dotted modules defining the no-op workflows below; the bench worker saves their documents.
WORKFLOW_MODULES: list[str] = ["bench.flows"]


def _start_runs(workflow: str, count: int, account: str | None = None) -> list[Any]:
    """Start ``count`` runs as the API does (``run_start``: the run and its first attempt in
    one transaction, the attempt offered on commit), as fast as this process can."""
    from bench.common import vacuum
    from runs.services import run_start

    vacuum()
    named = {"account": account} if account else {}
    return [run_start(workflow=workflow, input={}, **named).run.id for _ in range(count)]


def _wait(run_ids: list[Any], timeout: float) -> None:
    from runs.models import Run

    deadline = time.monotonic() + timeout
    while Run.objects.filter(id__in=run_ids).exclude(status="completed").exists():
        failed = Run.objects.filter(id__in=run_ids, status__in=["failed", "timed_out"]).first()
        if failed is not None:
            raise RuntimeError(f"bench run {failed.id} ended {failed.status}: {failed.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench runs not done within {timeout:g}s")
        time.sleep(0.2)


def _span(run_ids: list[Any]) -> float:
    """Seconds from the first step's start to the last step's finish, from the journal."""
    from runs.models import StepRun

    bounds = StepRun.objects.filter(run_id__in=run_ids).aggregate(
        first=Min("started_at"), last=Max("finished_at")
    )
    return (bounds["last"] - bounds["first"]).total_seconds()


def engine_sequential(steps: int, runs: int = 1) -> float:
    """Milliseconds per step of ``runs`` runs of ``steps`` sequential no-op ``task`` steps,
    one after another: each timed from its first step's start to its last step's finish,
    the intervals of all of them averaged (see ``bench.common.runs_for``)."""
    total = 0.0
    for _ in range(runs):
        run_ids = _start_runs(f"bench_seq_{steps}", 1)
        _wait(run_ids, timeout=60 + steps * 0.1)
        total += _span(run_ids)
    return total * 1000 / (runs * (steps - 1))


def engine_throughput(runs: int, steps: int, worker: Any = None) -> float:
    """Steps per second of ``runs`` concurrent runs of ``steps`` no-op steps, first step's
    start to last step's finish, on ``worker`` (one ``CeleryProcess`` or a list of them).

    As for bare Celery, the worker stops consuming step bodies while this process starts the
    runs, so what is timed is the worker, not the client competing with it for the CPU.
    """
    from bench.common import destinations
    from config.celery import app

    # One worker or several (the scale-out figures): all of them stop, then all consume.
    destination = destinations(worker) if worker is not None else None
    if destination:
        app.control.cancel_consumer("default", destination=destination, reply=True, timeout=5)
    try:
        run_ids = _start_runs(f"bench_seq_{steps}", runs)
    finally:
        if destination:
            app.control.add_consumer("default", destination=destination, reply=True, timeout=5)
    _wait(run_ids, timeout=120 + runs * steps * 0.02)
    return runs * steps / _span(run_ids)
