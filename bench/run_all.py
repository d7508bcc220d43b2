"""``python -m bench.run_all``: issue 3's benchmark, the engine beside bare Celery.

Starts one ``celery -A config worker`` (prefork, ``-c 2``, the project's settings) on the
bench services, measures bare Celery and the engine on it in one sitting, then issue 14's
recipe step beside a bare task making the same model call (``bench.recipe``, a worker of its
own; ``--recipe none`` skips it), and prints ``name | engine | bare | ratio``. Then issue 4's
timer benchmark (``bench.timers``) and issue 5's fan-out benchmark (``bench.fanout``) run,
each in a process of its own, on its own database and Redis databases (``--timers none``,
``--fanout none`` skip them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench import common


def _engine(measure: Callable[[], float]) -> float | None:
    try:
        return measure()
    except NotImplementedError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="hops of the sequential runs")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median")
    parser.add_argument("--concurrency", type=int, default=2, help="worker pool size")
    parser.add_argument("--loglevel", default="warning", help="the worker's log level")
    parser.add_argument(
        "--timers",
        choices=["all", "waiting", "precision", "burst", "none"],
        default="all",
        help="which part of bench.timers to run afterwards (several minutes for all)",
    )
    parser.add_argument(
        "--fanout",
        choices=["all", "one", "many", "none"],
        default="all",
        help="which part of bench.fanout to run last (about 8 minutes for all)",
    )
    parser.add_argument(
        "--recipe",
        choices=["all", "none"],
        default="all",
        help="the recipe step beside bare Celery's SDK call (bench.recipe, in this table)",
    )
    parser.add_argument("--recipe-steps", type=int, default=100, help="steps of the recipe run")
    parser.add_argument(
        "--starts",
        choices=["all", "none"],
        default="all",
        help="starts per second from 4 clients beside bare apply_async (bench.starts)",
    )
    args = parser.parse_args(argv)

    common.configure()
    # Imported after configure(): they read Django's settings.
    from bench import bare_celery as bare
    from bench import engine

    steps, repeat = args.steps, args.repeat
    shapes = [(16, 200), (1000, 5)]
    rows: list[common.Row] = []
    with common.running_worker(
        concurrency=args.concurrency,
        loglevel=args.loglevel,
        workflow_modules=engine.WORKFLOW_MODULES,
    ) as worker:
        # Warm the pool (imports, connections) before anything is timed.
        bare.relay(20, worker)
        bare.throughput(100, 1, worker)

        relay = common.median_of(repeat, lambda: bare.relay(steps, worker))
        chain = common.median_of(repeat, lambda: bare.chain(steps, worker))
        sequential = _engine(lambda: engine.engine_sequential(steps))
        rows += [
            common.Row(f"{steps} steps vs relay", "ms/step", sequential, relay, True),
            common.Row(f"{steps} steps vs chain", "ms/step", sequential, chain, True),
        ]
        for runs, hops in shapes:
            tasks = common.median_of(
                repeat, lambda r=runs, h=hops: bare.throughput(r * h, 1, worker)
            )
            relays = common.median_of(repeat, lambda r=runs, h=hops: bare.throughput(r, h, worker))
            concurrent = _engine(lambda r=runs, h=hops: engine.engine_throughput(r, h, worker))
            rows += [
                common.Row(
                    f"{runs}x{hops} vs independent tasks", "steps/s", concurrent, tasks, False
                ),
                common.Row(f"{runs}x{hops} vs {runs} relays", "steps/s", concurrent, relays, False),
            ]
        if args.starts != "none":
            from bench import starts

            rows += starts.measure(worker, repeat=repeat)

    if args.recipe != "none":
        # A worker of its own: it needs the local model server's address in its environment.
        from bench import recipe

        rounds = recipe.measure(
            args.recipe_steps, repeat, args.concurrency, args.loglevel, floor=False
        )
        rows += rounds.rows(args.recipe_steps)

    print(
        f"worker: celery -A config worker -P prefork -c {args.concurrency} -l {args.loglevel}, "
        f"broker {common.REDIS_URL}; median of {repeat}; ratio = engine / bare"
    )
    print(common.format_table(rows), flush=True)

    # Each in its own process: Django is configured once per process, on other services.
    for module, part in (("bench.timers", args.timers), ("bench.fanout", args.fanout)):
        if part != "none":
            print(flush=True)
            subprocess.run(
                [sys.executable, "-m", module, "--part", part],
                cwd=Path(__file__).resolve().parent.parent,
                check=True,
            )


if __name__ == "__main__":
    main()
