"""``python -m bench.profile_step``: a step's cost on the engine's side alone, in process.

Starts one run of ``bench_seq_N`` (``bench.flows``) on the bench database and runs every
step inline in this process through the worker's own ``workers.execution.execute`` (claim,
handler, record, plan, apply), with no broker hop and no Celery worker: what is timed is the
engine's CPU and database time per step, for runs of 10, 200 and 2,000 steps, and with
``--profile`` pyinstrument's profile of the 200-step run (the top of it in issue 17's note).
``--queries`` counts the statements one step issues (Django's ``CaptureQueriesContext``).
"""

from __future__ import annotations

import argparse
import os
import time


def _run_inline(steps: int) -> tuple[float, int]:
    """(ms per step, steps run) of one run of ``steps`` no-op steps, every step inline."""
    from runs.models import StepRun
    from runs.services import run_start
    from workers.execution import execute

    run = run_start(workflow=f"bench_seq_{steps}", input={}).run
    started = time.perf_counter()
    ran = 0
    while True:
        attempt = (
            StepRun.objects.filter(run_id=run.id, status="scheduled").values_list("id", flat=True)
        ).first()
        if attempt is None:
            break
        execute(attempt, worker="profile@local")
        ran = StepRun.objects.filter(run_id=run.id, status="succeeded").count()
    elapsed = time.perf_counter() - started
    run.refresh_from_db()
    if run.status != "completed":
        raise RuntimeError(f"run {run.id} ended {run.status}: {run.error}")
    return elapsed * 1000 / ran, ran


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__)
    parser.add_argument("--shapes", default="10,200,2000")
    parser.add_argument("--profile", action="store_true", help="pyinstrument the 200-step run")
    parser.add_argument("--queries", action="store_true", help="print one step's statements")
    args = parser.parse_args(argv)
    # Every step inline: one task chains the whole run (bounded only for this measurement).
    os.environ.update(DJFLOW_INLINE_MAX_STEPS="100000", DJFLOW_INLINE_SECONDS="100000")
    # No worker process here: this process runs the steps itself.
    os.environ["DJFLOW_START_CHECKS_WORKERS"] = "false"
    from bench import common

    common.configure()
    from workflows.sync import sync_modules

    sync_modules(["bench.flows"])
    _run_inline(10)  # warm: imports, caches, connections
    for steps in (int(s) for s in args.shapes.split(",")):
        per_step, ran = _run_inline(steps)
        print(f"{steps:>5} steps: {per_step:.3f} ms/step ({ran} steps)", flush=True)
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
        _run_inline(200)
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False, show_all=False))
    if args.queries:
        _print_queries()


def _print_queries() -> None:
    from django.conf import settings
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from runs.models import StepRun
    from runs.services import run_start
    from workers.execution import execute

    settings.DJFLOW["INLINE_MAX_STEPS"] = 0  # one step per execute()
    run = run_start(workflow="bench_seq_10", input={}).run
    first = StepRun.objects.get(run_id=run.id, status="scheduled").id
    execute(first, worker="profile@local")
    second = StepRun.objects.get(run_id=run.id, status="scheduled").id
    with CaptureQueriesContext(connection) as captured:
        execute(second, worker="profile@local")
    for query in captured.captured_queries:
        print(query["sql"][:300])
    print(f"{len(captured.captured_queries)} statements")


if __name__ == "__main__":
    main()
