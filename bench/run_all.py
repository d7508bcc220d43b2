"""``python -m bench.run_all``: the engine beside bare Celery, and issue 17's table.

Starts one ``celery -A config worker`` (prefork, ``-c 2``, the project's settings) on the
bench services, measures bare Celery and the engine on it in one sitting, then issue 14's
recipe step beside a bare task making the same model call (``bench.recipe``, a worker of its
own; ``--recipe none`` skips it), and prints ``name | engine | bare | ratio``. Then, for
issue 17: the scale-out figures (1, 2 and 4 pool processes and two worker nodes, with the CPU
each part spent per step), the statements and commits per step (``bench.scale_out``,
``bench.pg_counts``) and Postgres's one-row commit ceiling (``bench.pg_ceiling``). Then issue
4's timer benchmark (``bench.timers``) and issue 5's fan-out benchmark (``bench.fanout``) run,
each in a process of its own, on its own database and Redis databases (``--timers none``,
``--fanout none`` skip them), and hand their rows back through a JSON file. Last, issue 17's
table: one row per figure of its Goal, with the goal, DBOS's figure and the issue's starting
figure beside each (``bench.goals``), and the scale model's prediction beside the scale-out
figures (``bench.scale_model``). ``--quick`` runs every part at a small scale, to check that
it works; its figures are not the issue's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common, goals


def _engine(measure: Callable[[], float]) -> float | None:
    try:
        return measure()
    except NotImplementedError:
        return None


@dataclass
class Sitting:
    """Everything one run of this benchmark measured, for the tables and ``--json``."""

    sequential: dict[int, tuple[float | None, float]] = field(default_factory=dict)
    shapes: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    scale_out: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, dict[str, float]] = field(default_factory=dict)
    ceiling: dict[str, float] | None = None
    timers: list[common.Row] = field(default_factory=list)
    fanout: list[common.Row] = field(default_factory=list)
    starts: list[common.Row] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        import dataclasses

        counts = self.counts.get("many") or next(iter(self.counts.values()), {})
        return {
            "cores": os.cpu_count(),
            "load_averages": self.loads,
            "sequential": {str(k): v for k, v in self.sequential.items()},
            "shapes": self.shapes,
            "scale_out": self.scale_out,
            "counts": counts,
            "counts_by_shape": self.counts,
            "ceiling": self.ceiling,
            "timers": [dataclasses.asdict(r) for r in self.timers],
            "fanout": [dataclasses.asdict(r) for r in self.fanout],
            "starts": [dataclasses.asdict(r) for r in self.starts],
        }


def _find(rows: Sequence[common.Row], *words: str) -> common.Row | None:
    """The first sub-benchmark row whose name holds every one of ``words`` (their names
    carry the counts, which ``--scale`` changes)."""
    return next((row for row in rows if all(word in row.name for word in words)), None)


def _from_row(
    name: str, unit: str, row: common.Row | None, goal: goals.Goal, quoted: tuple[str, str]
) -> goals.GoalRow:
    return goals.GoalRow(
        name=row.name if row is not None else name,
        unit=unit,
        engine=row.engine if row is not None else None,
        bare=row.bare if row is not None else None,
        goal=goal,
        dbos=quoted[0],
        start=quoted[1],
    )


def goal_rows(
    sitting: Sitting, steps: int, shapes: Sequence[tuple[int, int]]
) -> list[goals.GoalRow]:
    """Issue 17's Goal, figure by figure, from what this sitting measured."""
    rows: list[goals.GoalRow] = []
    engine, relay = sitting.sequential.get(steps, (None, 0.0))
    rows.append(
        goals.GoalRow(
            f"{steps} sequential steps vs relay",
            "ms/step",
            engine,
            relay,
            goals.Goal("ratio", 1.5, at_most=True),
            *goals.SEQUENTIAL,
        )
    )
    lengths = sorted(sitting.sequential)
    for length in lengths:
        engine, relay = sitting.sequential[length]
        rows.append(
            goals.GoalRow(
                f"per-step cost, runs of {length:,} steps, vs relay", "ms/step", engine, relay
            )
        )
    if len(lengths) >= 2:
        (short_engine, short_relay), (long_engine, long_relay) = (
            sitting.sequential[lengths[0]],
            sitting.sequential[lengths[-1]],
        )
        rows.append(
            goals.GoalRow(
                f"per-step cost, {lengths[-1]:,} steps / {lengths[0]:,} steps",
                "x",
                long_engine / short_engine if long_engine and short_engine else None,
                long_relay / short_relay if short_relay else None,
                goals.Goal("engine", 1.2, at_most=True),
                *goals.LENGTH,
            )
        )
    for (runs, hops), quoted in zip(shapes, (goals.MANY_LONG, goals.MANY_SHORT), strict=False):
        engine, tasks = sitting.shapes.get(f"{runs}x{hops}", (None, 0.0))
        rows.append(
            goals.GoalRow(
                f"{runs:,}x{hops} vs independent tasks",
                "steps/s",
                engine,
                tasks,
                goals.Goal("ratio", 0.6, at_most=False),
                *quoted,
            )
        )
    rows.append(
        _from_row(
            "foreach over 10,000 items vs one chord (not run)",
            "s",
            _find(sitting.fanout, "start to run completed"),
            goals.Goal("ratio", 1.2, at_most=True),
            goals.FOREACH,
        )
    )
    rows.append(
        _from_row(
            "10,000 due at once: all runs completed (not run)",
            "s",
            _find(sitting.timers, "due at once: all runs completed"),
            goals.Goal("ratio", 2.0, at_most=True),
            goals.BURST,
        )
    )
    rows.append(
        _from_row(
            "timer lateness of the firing, p99 (not run)",
            "ms",
            _find(sitting.timers, "lateness of the timer's firing, p99"),
            goals.Goal("engine", 1000.0, at_most=True),
            goals.LATENESS,
        )
    )
    rows.append(
        _from_row(
            "starts per second, POST /runs from 4 clients vs apply_async",
            "starts/s",
            sitting.starts[0] if sitting.starts else None,
            goals.Goal("ratio", 0.5, at_most=False),
            goals.STARTS,
        )
    )
    for point in sitting.scale_out:
        processes = point["nodes"] * point["concurrency"]
        label = (
            f"{point['concurrency']} pool process{'es' if point['concurrency'] > 1 else ''}"
            if point["nodes"] == 1
            else f"{point['nodes']} worker nodes x {point['concurrency']} processes"
        )
        rows.append(
            goals.GoalRow(
                f"scale-out {point['runs']}x{point['steps']}, {label} (CPU ms/step: worker "
                f"{point['worker_cpu_ms']:.2f}, Postgres {point['postgres_cpu_ms']:.2f}, Redis "
                f"{point['redis_cpu_ms']:.2f})",
                "steps/s",
                point["engine"],
                point["bare"],
                start=goals.SCALE_OUT.get(processes, "") if point["nodes"] == 1 else "",
            )
        )
    for counts in sitting.counts.values():
        label = counts["label"]
        rows += [
            goals.GoalRow(
                f"Postgres statements per step ({label})",
                "statements",
                counts["statements_per_step"],
                None,
                start=goals.STATEMENTS[1],
            ),
            goals.GoalRow(
                f"Postgres commits per step ({label}; rollbacks {counts['rollbacks']:,.0f})",
                "commits",
                counts["commits_per_step"],
                None,
            ),
        ]
    return rows


def _sub_benchmark(module: str, part: str, scale: float) -> list[common.Row]:
    """Run ``module`` (its own services, its own Django) in a process of its own; its rows."""
    with tempfile.TemporaryDirectory(prefix="djflow-bench-rows-") as folder:
        path = str(Path(folder) / "rows.json")
        argv = [
            sys.executable,
            "-m",
            module,
            "--part",
            part,
            "--scale",
            f"{scale:g}",
            "--json",
            path,
        ]
        done = subprocess.run(argv, cwd=Path(__file__).resolve().parent.parent, check=False)
        if done.returncode != 0 or not Path(path).exists():
            print(f"{module} --part {part} failed (exit {done.returncode}): its rows are n/a")
            return []
        return common.read_rows(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="hops of the sequential runs")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median")
    parser.add_argument("--concurrency", type=int, default=2, help="worker pool size")
    parser.add_argument("--loglevel", default="warning", help="the worker's log level")
    parser.add_argument(
        "--lengths",
        default="10,200,2000",
        help="run lengths whose per-step cost is compared (issue 17: within 1.2x)",
    )
    parser.add_argument(
        "--timers",
        choices=["all", "waiting", "precision", "burst", "none"],
        default="all",
        help="which part of bench.timers to run afterwards (several minutes for all)",
    )
    parser.add_argument("--timers-scale", type=float, default=1.0, help="bench.timers --scale")
    parser.add_argument(
        "--fanout",
        choices=["all", "one", "many", "none"],
        default="all",
        help="which part of bench.fanout to run last (about 8 minutes for all)",
    )
    parser.add_argument("--fanout-scale", type=float, default=1.0, help="bench.fanout --scale")
    parser.add_argument(
        "--recipe",
        choices=["all", "none"],
        default="all",
        help="the recipe step beside bare Celery's SDK call (bench.recipe, in this table)",
    )
    parser.add_argument("--recipe-steps", type=int, default=100, help="steps of the recipe run")
    parser.add_argument(
        "--scale-out",
        choices=["all", "none"],
        default="all",
        help="16x200 on 1, 2 and 4 pool processes and two worker nodes (about 4 minutes)",
    )
    parser.add_argument(
        "--counts",
        choices=["all", "none"],
        default="all",
        help="Postgres statements and commits per step, and the commit ceiling (about 2 min)",
    )
    parser.add_argument("--json", help="write every figure of the sitting to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every part at a small scale, once: checks that it works (not the issue's figures)",
    )
    parser.add_argument(
        "--starts",
        choices=["all", "none"],
        default="all",
        help="starts per second from 4 clients beside bare apply_async (bench.starts)",
    )
    args = parser.parse_args(argv)

    shapes = [(16, 200), (1000, 5)]
    many = (16, 200)
    lengths = [int(n) for n in args.lengths.split(",")]
    if min(lengths) < 2:
        # A per-step figure is timed between the first step's start and the last's finish.
        parser.error("--lengths: every run length must be at least 2 steps")
    if args.quick:
        # Only the shapes bench.flows defines (5, 10, 200 and 2,000 steps).
        args.repeat, args.recipe = 1, "none"
        shapes, many, lengths = [(4, 200), (100, 5)], (4, 200), [10, 200]
        args.timers_scale, args.fanout_scale = (
            min(args.timers_scale, 0.05),
            min(args.fanout_scale, 0.02),
        )

    common.configure()
    # Imported after configure(): they read Django's settings.
    from bench import bare_celery as bare
    from bench import engine

    steps, repeat = args.steps, args.repeat
    sitting = Sitting(loads=[os.getloadavg()[0]])
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
        # The engine's figures are medians too, as the table says: one run of each was
        # 0.53x to 0.88x for 1,000x5 within an hour on a quiet machine (issue 17's tenth session).
        sequential = _engine(
            lambda: common.median_of(repeat, lambda: engine.engine_sequential(steps))
        )
        sitting.sequential[steps] = (sequential, relay)
        rows += [
            common.Row(f"{steps} steps vs relay", "ms/step", sequential, relay, True),
            common.Row(f"{steps} steps vs chain", "ms/step", sequential, chain, True),
        ]
        # The same per-step cost however long the run (issue 17): each length beside a relay
        # of as many hops.
        for length in (n for n in lengths if n != steps):
            count = common.runs_for(length)
            length_relay = common.median_of(
                repeat, lambda n=length, k=count: bare.relay(n, worker, runs=k)
            )
            per_step = _engine(
                lambda n=length, k=count: common.median_of(
                    repeat, lambda: engine.engine_sequential(n, runs=k)
                )
            )
            sitting.sequential[length] = (per_step, length_relay)
            rows.append(
                common.Row(
                    f"{length} steps vs relay" + (f" ({count} runs each)" if count > 1 else ""),
                    "ms/step",
                    per_step,
                    length_relay,
                    True,
                )
            )
        for runs, hops in shapes:
            tasks = common.median_of(
                repeat, lambda r=runs, h=hops: bare.throughput(r * h, 1, worker)
            )
            relays = common.median_of(repeat, lambda r=runs, h=hops: bare.throughput(r, h, worker))
            concurrent = _engine(
                lambda r=runs, h=hops: common.median_of(
                    repeat, lambda: engine.engine_throughput(r, h, worker)
                )
            )
            sitting.shapes[f"{runs}x{hops}"] = (concurrent, tasks)
            rows += [
                common.Row(
                    f"{runs}x{hops} vs independent tasks", "steps/s", concurrent, tasks, False
                ),
                common.Row(f"{runs}x{hops} vs {runs} relays", "steps/s", concurrent, relays, False),
            ]
        if args.starts != "none":
            from bench import starts

            # Over HTTP first: the goal names API clients (bench.starts).
            sitting.starts = sorted(
                starts.measure(worker, repeat=repeat), key=lambda row: "POST" not in row.name
            )
            rows += sitting.starts

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

    if args.scale_out != "none":
        from bench import scale_out

        sitting.loads.append(os.getloadavg()[0])
        points = scale_out.scale_out(*many, repeat, loglevel=args.loglevel)
        for point in points:
            sitting.scale_out.append({**point.as_dict(), "runs": many[0], "steps": many[1]})
            print(
                f"scale-out {many[0]}x{many[1]}, {point.label}: engine {point.engine:,.0f} "
                f"steps/s, bare {point.bare:,.0f} tasks/s; CPU ms/step worker "
                f"{point.worker_cpu_ms:.2f}, Postgres {point.postgres_cpu_ms:.2f}, Redis "
                f"{point.redis_cpu_ms:.2f}; cores busy: worker "
                f"{point.engine * point.worker_cpu_ms / 1000:.2f}, Postgres "
                f"{point.engine * point.postgres_cpu_ms / 1000:.2f} of {os.cpu_count()} "
                f"(load {point.load:.1f})",
                flush=True,
            )
    if args.counts != "none":
        from bench import pg_ceiling, scale_out

        for key, (runs, hops) in (("sequential", (1, steps)), ("many", many)):
            counted = scale_out.statement_counts(runs, hops, loglevel=args.loglevel)
            sitting.counts[key] = {
                "label": f"{runs}x{hops}",
                "steps": counted.steps,
                "statements_per_step": counted.statements_per_step,
                "commits_per_step": counted.commits_per_step,
                "rollbacks": counted.rollbacks,
            }
            print(
                f"{runs}x{hops}: {counted.steps:,} steps, {counted.statements:,} statements "
                f"({counted.statements_per_step:.2f}/step), {counted.commits:,} commits "
                f"({counted.commits_per_step:.2f}/step), {counted.rollbacks:,} rollbacks",
                flush=True,
            )
        sitting.ceiling = pg_ceiling.measure(seconds=5 if args.quick else 10)

    # Each in its own process: Django is configured once per process, on other services.
    if args.timers != "none":
        print(flush=True)
        sitting.timers = _sub_benchmark("bench.timers", args.timers, args.timers_scale)
    if args.fanout != "none":
        print(flush=True)
        sitting.fanout = _sub_benchmark("bench.fanout", args.fanout, args.fanout_scale)
    sitting.loads.append(os.getloadavg()[0])

    quick = "--quick: small scales, not the issue's figures; " if args.quick else ""
    print(
        f"\nissue 17's table ({quick}"
        f"1-minute load average {', '.join(f'{n:.1f}' for n in sitting.loads)} as the parts "
        "began; ratio = engine / bare)"
    )
    print(goals.format_goal_table(goal_rows(sitting, steps, shapes)), flush=True)

    data = sitting.as_json()
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    if sitting.scale_out and sitting.counts and sitting.ceiling:
        from bench import scale_model

        params, measured = scale_model.from_measurements(data)
        print("\nscale model (bench.scale_model):")
        print(scale_model.report(params, measured, scale_model.shape_of(data)))


if __name__ == "__main__":
    main()
