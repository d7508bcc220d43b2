"""``python -m bench.fanout``: ``foreach`` fan-out and fan-in (issue 5) beside a bare Celery chord.

Two parts, each runnable on its own (``--part one|many``, default all):

- ``one``: one run of a ``foreach`` over 10,000 no-op items against one bare chord of 10,000
  no-op tasks whose body is a no-op. Seconds from the start (just before ``run_start`` /
  the chord's call) until the run completed (its ``finished_at``) / the chord's body ran (its
  stamp); how long the start itself took; the peak RSS of the worker (main process + pool,
  sampled from ``/proc`` every 50 ms) and its growth; the RSS growth of the process that
  started the run / sent the chord; how many ``runs.advance`` tasks the run cost. Then the
  same fan-out planned and sent by the worker (``bench_fan_later``: a first step's
  completion plans the items; bare: a task sending the chord): how long that task took and
  the worker's RSS growth until it ended.
- ``many``: 100 runs of 100 items against 100 chords of 100 tasks, started one after the
  other by one process: seconds from the first start to the last run completed / body ran.

The engine's run is started as the API starts one: ``run_start`` writes the run and plans
its first actions (``advance.REQUEST_ACTIONS``), then hands the rest of the fan-out to
``runs.advance`` tasks in the worker (rounds of ``advance.ADVANCE_ACTIONS`` attempts, inserted
in multi-row statements and sent on commit as one chord per round, its header the attempts'
messages through one publish batch, its body an advance of the run). An item's success asks
for an advance only when nothing else of the run is in flight after its commit
(``workers.execution._record_inside``). Each engine measurement runs twice: with the chords
(side ``engine``) and, at the same commit, without them (side ``plain``,
``DJFLOW_FAN_OUT_CHORDS=false``); the rows "chords / no chord" compare the two.

Each side of each part gets a fresh broker and one ``celery -A config worker -P prefork -c 2
-l warning`` with the project's settings (no beat: nothing here waits on time), started with
the tests' process harness and warmed up (both paths taken once) before anything is
measured. An engine run still unfinished ``--budget`` seconds (240) after its start is given
up, and its figures are marked as lower bounds. The run or chords are started by a process of
their own (``--dispatch``, started by this one), so its memory is that start's alone. The
services are the bench's own: the Postgres database ``djflow_bench_fan`` (created and
migrated on first use, emptied before each side), Redis database 8 for the broker and 9 for
the results, the stamps and the worker's notes on its tasks. ``DJFLOW_BENCH_FAN_DATABASE_URL``,
``DJFLOW_BENCH_FAN_BROKER_URL`` and ``DJFLOW_BENCH_FAN_RESULTS_URL`` override them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from bench import common
from tests.processes import (
    CeleryProcess,
    WaitTimeout,
    purge_broker,
    service_env,
    wait_for,
    worker_process,
)

DATABASE_URL = os.environ.get(
    "DJFLOW_BENCH_FAN_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/djflow_bench_fan"
)
BROKER_URL = os.environ.get("DJFLOW_BENCH_FAN_BROKER_URL", "redis://127.0.0.1:6379/8")
RESULTS_URL = os.environ.get("DJFLOW_BENCH_FAN_RESULTS_URL", "redis://127.0.0.1:6379/9")
FLOWS = "bench.fan_flows"
WORKFLOW = "bench_fan"
CONCURRENCY = 2
PARTS = ("one", "many")
SIDES = ("engine", "plain", "bare")
# The engine's sides: its fan-outs as chords (the design card's), and the same messages
# without the chord (DJFLOW_FAN_OUT_CHORDS=false), measured at the same commit.
ENGINE_SIDES = ("engine", "plain")


def side_env(side: str) -> dict[str, str]:
    """What a side's processes (the worker and the dispatcher) run with."""
    return {"DJFLOW_FAN_OUT_CHORDS": "false" if side == "plain" else "true"}


ITEMS = 10_000
MANY_RUNS = 100
MANY_ITEMS = 100
SAMPLE_SECONDS = 0.05


def configure(*, migrate: bool = True) -> None:
    """Point this process's Django and Celery app at the fan-out bench's services, create the
    database if it is missing, and migrate it. Call it before anything reads Django's
    settings (``bench.run_all`` runs this module in a process of its own)."""
    import django

    os.environ.update(
        DATABASE_URL=DATABASE_URL,
        CELERY_BROKER_URL=BROKER_URL,
        CELERY_RESULT_BACKEND=RESULTS_URL,
        DJANGO_SETTINGS_MODULE="config.settings",
    )
    os.environ.pop("SENTRY_DSN", None)
    if migrate:
        common.create_database(DATABASE_URL)
    django.setup()

    from django.conf import settings
    from django.core.management import call_command

    if settings.CELERY_BROKER_URL != BROKER_URL:  # settings were read before configure()
        raise RuntimeError("bench.fanout.configure() must run before Django's settings load")
    if migrate:
        call_command("migrate", interactive=False, verbosity=0)


def _results() -> redis.Redis:
    return redis.Redis.from_url(RESULTS_URL)


def _empty_database() -> None:
    """Each side starts from empty run tables: its journal is its own."""
    from django.db import connection

    from runs.models import AdvanceRequest, Event, Run, StepRun, Timer

    tables = ", ".join(m._meta.db_table for m in (Timer, AdvanceRequest, StepRun, Event, Run))
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {tables} CASCADE")


@contextlib.contextmanager
def running(side: str) -> Iterator[CeleryProcess]:
    """One worker (prefork, ``-c 2``, logging at ``warning``) on the bench services, on an
    empty broker, empty run tables and no stamps left over, with ``side``'s settings;
    stopped on exit."""
    _empty_database()
    purge_broker()
    results = _results()
    stale = list(results.scan_iter(match="bench-fan:*"))
    if stale:
        results.delete(*stale)
    with tempfile.TemporaryDirectory(prefix="djflow-bench-fan-") as workdir:
        worker = worker_process(
            env=service_env(
                database_url=DATABASE_URL,
                broker_url=BROKER_URL,
                result_backend=RESULTS_URL,
                workflow_modules=[FLOWS],
                extra=side_env(side),
            ),
            workdir=Path(workdir),
            name="bench-fan",
            concurrency=CONCURRENCY,
            loglevel="warning",
            include=[FLOWS],
        )
        try:
            worker.start().wait_ready(timeout=60)
            yield worker
        except BaseException:
            print(f"----- worker log (tail) -----\n{worker.logs()[-5000:]}")
            raise
        finally:
            worker.stop(timeout=30)


# --- Memory ---------------------------------------------------------------------------------


def _status_mb(pid: int | str, field: str) -> float:
    """A ``/proc/<pid>/status`` size field (VmRSS, VmHWM) in MB; 0 when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    """Children of every thread of ``pid``, from ``/proc`` (cheaper than scanning all pids:
    this runs every 50 ms beside the processes it measures)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def worker_rss(pid: int) -> float:
    """RSS of a worker's main process plus its pool processes, in MB."""
    return _status_mb(pid, "VmRSS") + sum(_status_mb(c, "VmRSS") for c in _children(pid))


class PeakRss(threading.Thread):
    """Samples a worker's RSS (main + pool) every ``SAMPLE_SECONDS`` until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.before = worker_rss(pid)
        self.peak = self.before
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, worker_rss(self.pid))
            self.samples += 1

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, worker_rss(self.pid))
        return self.peak


# --- The dispatcher: a process of its own, so its memory is the start's alone ----------------


def _reset_peak() -> None:
    """Make VmHWM (the peak RSS) start again from the current RSS (Linux ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _engine_start(items: int, runs: int) -> list[str]:
    from runs.services import run_start

    common.vacuum()
    return [
        str(run_start(workflow=WORKFLOW, input={"items": list(range(items))}).run.id)
        for _ in range(runs)
    ]


def _bare_send(items: int, chords: int, measurement: str) -> None:
    from celery import chord

    from .fan_flows import done, noop

    for _ in range(chords):
        chord([noop.si() for _ in range(items)])(done.si(measurement, chords))


def _wait_engine(run_ids: list[str], timeout: float, worker: CeleryProcess | None = None) -> bool:
    """Until every run completed (True) or ``timeout`` passed (False); raises if a run ended
    otherwise. Polled by id twice a second: the client must not compete with the worker for
    the CPU."""
    from runs.models import Run

    def completed() -> bool:
        runs = Run.objects.filter(id__in=run_ids)
        ended = runs.exclude(status__in=["pending", "running", "waiting", "completed"]).first()
        if ended is not None:
            raise RuntimeError(f"run {ended.id} ended {ended.status}: {ended.error}")
        return not runs.exclude(status="completed").exists()

    try:
        wait_for(completed, timeout=timeout, interval=0.5)
    except WaitTimeout:
        if worker is not None and not worker.alive():
            raise RuntimeError(f"the worker died:\n{worker.logs()[-5000:]}") from None
        return False
    return True


def _wait_bare(measurement: str, timeout: float, worker: CeleryProcess | None = None) -> float:
    """Until the last chord body of ``measurement`` ran; returns its stamp (epoch s)."""
    end_key = _keys(measurement)[1]
    results = _results()
    return float(
        wait_for(
            lambda: results.get(end_key),
            timeout=timeout,
            interval=0.05,
            message=(lambda: worker.logs()[-5000:]) if worker else end_key,
        )
    )


def _keys(measurement: str) -> tuple[str, str]:
    from .fan_flows import keys

    return keys(measurement)


def dispatcher(side: str, items: int, runs: int, measurement: str) -> dict[str, Any]:
    """The body of ``--dispatch``: warm up (one item through the worker), then start
    ``runs`` runs of ``items`` items (engine) or send as many chords (bare), noting the
    times and this process's RSS before and at its peak."""
    if side in ENGINE_SIDES:
        if not _wait_engine(_engine_start(1, 1), timeout=60):
            raise RuntimeError("the dispatcher's warm-up run did not complete within 60 s")
    else:
        warm = uuid.uuid4().hex
        _bare_send(1, 1, warm)
        _wait_bare(warm, timeout=60)
    _reset_peak()
    before = _status_mb("self", "VmRSS")
    began = time.time()
    run_ids = _engine_start(items, runs) if side in ENGINE_SIDES else []
    if side == "bare":
        _bare_send(items, runs, measurement)
    sent = time.time()
    return {
        "began": began,
        "sent": sent,
        "rss_before": before,
        "rss_peak": _status_mb("self", "VmHWM"),
        "run_ids": run_ids,
    }


def dispatch(side: str, items: int, runs: int, measurement: str) -> dict[str, Any]:
    """Run :func:`dispatcher` in a new process (``--dispatch``); its JSON answer."""
    argv = [sys.executable, "-m", "bench.fanout", "--dispatch", side]
    argv += ["--items", str(items), "--runs", str(runs), "--measurement", measurement]
    done = subprocess.run(
        argv,
        env={**os.environ, **side_env(side)},
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- One side ------------------------------------------------------------------------------


def _warm_up(side: str, worker: CeleryProcess) -> None:
    """Both paths once through the fresh worker (imports, connections, the chord's
    counters) before anything is timed."""
    if side in ENGINE_SIDES:
        if not _wait_engine(_engine_start(100, 1), timeout=120, worker=worker):
            raise RuntimeError(f"the warm-up run did not complete:\n{worker.logs()[-5000:]}")
    else:
        warm = uuid.uuid4().hex
        _bare_send(100, 1, warm)
        _wait_bare(warm, timeout=120, worker=worker)
    _results().delete(_fan_flows().ADVANCE_TIMES)


def _fan_flows() -> Any:
    from bench import fan_flows

    return fan_flows


def measure(side: str, items: int, runs: int, budget: float) -> dict[str, Any]:
    """One side of a part on a fresh worker: ``runs`` runs (or chords) of ``items`` items
    started by a dispatcher process while the worker's RSS is sampled. The engine's runs get
    ``budget`` seconds after the start; should they not complete by then, what they did is
    measured (``complete`` false) and the worker is stopped."""
    from django.db.models import Count, Max, Min

    from runs.models import Run, StepRun

    measurement = uuid.uuid4().hex
    with running(side) as worker:
        _warm_up(side, worker)
        sampler = PeakRss(worker.pid)
        sampler.start()
        try:
            sent = dispatch(side, items, runs, measurement)
            left = budget - (time.time() - sent["began"])
            if side in ENGINE_SIDES:
                complete = _wait_engine(sent["run_ids"], timeout=max(left, 1.0), worker=worker)
            else:
                end, complete = _wait_bare(measurement, timeout=600, worker=worker), True
        finally:
            peak = sampler.stop()
        advance_ms = [float(x) for x in _results().lrange(_fan_flows().ADVANCE_TIMES, 0, -1)]
        given_up = time.time()
    result = {
        "complete": complete,
        "began": sent["began"],
        "start_seconds": sent["sent"] - sent["began"],
        "dispatcher_before": sent["rss_before"],
        "dispatcher_growth": sent["rss_peak"] - sent["rss_before"],
        "worker_before": sampler.before,
        "worker_peak": peak,
        "worker_samples": sampler.samples,
        "advance_ms": advance_ms,
    }
    if side == "bare":
        result["end"] = end
        return result
    run_ids = sent["run_ids"]
    runs_done = Run.objects.filter(id__in=run_ids)
    if complete:
        result["end"] = runs_done.aggregate(last=Max("finished_at"))["last"].timestamp()
        outputs = runs_done.values_list("output", flat=True)
        if any(not isinstance(o, list) or len(o) != items for o in outputs):
            raise RuntimeError(f"a run's output is not a list of {items} items")
    else:
        result["end"] = given_up
    inside = StepRun.objects.filter(run_id__in=run_ids, kind="task", status="succeeded").aggregate(
        first=Min("started_at"), last=Max("finished_at"), count=Count("id")
    )
    result["items_first_start"] = _epoch(inside["first"])
    result["items_last_finish"] = _epoch(inside["last"])
    result["items_done"] = inside["count"]
    return result


def measure_worker_fanout(side: str, items: int) -> dict[str, Any]:
    """The fan-out planned and sent by the worker on a fresh worker: ``bench_fan_later``
    (its first step's completion plans ``items`` items and sends their chord from the pool
    process) or ``bench.fan.send`` (a task sending a chord of ``items`` no-op tasks). The
    worker's RSS is sampled until that task has ended; the items are left undone."""
    from runs.models import StepRun
    from runs.services import run_start

    flows = _fan_flows()
    with running(side) as worker:
        _warm_up(side, worker)
        sampler = PeakRss(worker.pid)
        sampler.start()
        results = _results()
        try:
            if side == "engine":
                run = run_start(workflow="bench_fan_later", input={"items": list(range(items))})
                first = StepRun.objects.get(run_id=run.run.id, step_id="first").id
                expected = ("workers.execute_step", [first])
            else:
                measurement = uuid.uuid4().hex
                flows.send.delay(measurement, items)
                expected = ("bench.fan.send", [measurement, items])

            def fanned_out() -> dict[str, Any] | None:
                for entry in results.lrange(flows.SLOW_TASKS, 0, -1):
                    slow = json.loads(entry)
                    if (slow["name"], slow["args"]) == expected:
                        return dict(slow)
                return None

            slow = wait_for(
                fanned_out,
                timeout=120 + items * 0.02,
                interval=0.2,
                message=lambda: f"{expected} fanning out\n{worker.logs()[-5000:]}",
            )
        finally:
            peak = sampler.stop()
    return {"seconds": slow["seconds"], "before": sampler.before, "peak": peak}


def _epoch(moment: datetime | None) -> float:
    if moment is None:
        raise RuntimeError("no item ran")
    return moment.timestamp()


# --- Parts ---------------------------------------------------------------------------------


def _advance_note(engine: dict[str, Any], runs: int, items: int) -> str:
    times = engine["advance_ms"]
    if not times:
        return "engine: no runs.advance task ran"
    return (
        f"engine: {len(times):,} runs.advance tasks for {runs:,} run(s) of {items:,} items "
        f"({engine['items_done']:,} items done): {sum(times) / 1000:.1f} s of the pool's time, "
        f"median {statistics.median(times):.0f} ms, max {max(times):.0f} ms"
    )


def _elapsed(result: dict[str, Any]) -> float:
    return float(result["end"] - result["began"])


def _unfinished(engine: dict[str, Any], total: int) -> str:
    """A label's suffix when the engine ran out of its budget: its figure is a lower bound."""
    if engine["complete"]:
        return ""
    return f" [engine: NOT completed, {engine['items_done']:,}/{total:,} items; a lower bound]"


def _against_plain(
    label: str, engine: dict[str, Any], plain: dict[str, Any], total: int
) -> list[common.Row]:
    """The engine with its fan-outs as chords (the "engine" column) against the same engine
    without the chord (DJFLOW_FAN_OUT_CHORDS=false, in the "bare" column), at one commit."""
    unfinished = _unfinished(engine, total) or _unfinished(plain, total)
    return [
        common.Row(
            f"{label}: chords / no chord (bare column), start to last run completed{unfinished}",
            "s",
            _elapsed(engine),
            _elapsed(plain),
            True,
        ),
        common.Row(
            f"{label}: chords / no chord (bare column), runs.advance executed",
            "tasks",
            len(engine["advance_ms"]),
            len(plain["advance_ms"]),
            True,
        ),
        common.Row(
            f"{label}: chords / no chord (bare column), worker peak RSS",
            "MB",
            engine["worker_peak"],
            plain["worker_peak"],
            True,
        ),
    ]


def part_one(items: int = ITEMS, budget: float = 240.0) -> tuple[list[common.Row], list[str]]:
    engine = measure("engine", items, 1, budget)
    plain = measure("plain", items, 1, budget)
    bare = measure("bare", items, 1, budget)
    engine_later = measure_worker_fanout("engine", items)
    bare_later = measure_worker_fanout("bare", items)
    label = f"{items:,} items"
    rows = [
        common.Row(
            f"{label}: start to run completed / chord body ran{_unfinished(engine, items)}",
            "s",
            _elapsed(engine),
            _elapsed(bare),
            True,
        ),
        common.Row(
            f"{label}: the start (run_start / chord call returned)",
            "s",
            engine["start_seconds"],
            bare["start_seconds"],
            True,
        ),
        common.Row(
            f"{label}: worker peak RSS (main + pool)",
            "MB",
            engine["worker_peak"],
            bare["worker_peak"],
            True,
        ),
        common.Row(
            f"{label}: worker RSS growth to the peak",
            "MB",
            engine["worker_peak"] - engine["worker_before"],
            bare["worker_peak"] - bare["worker_before"],
            True,
        ),
        common.Row(
            f"{label}: dispatcher RSS growth to the peak",
            "MB",
            engine["dispatcher_growth"],
            bare["dispatcher_growth"],
            True,
        ),
        common.Row(
            f"{label} fanned out by the worker: the task that did it",
            "s",
            engine_later["seconds"],
            bare_later["seconds"],
            True,
        ),
        common.Row(
            f"{label} fanned out by the worker: worker RSS growth to the peak",
            "MB",
            engine_later["peak"] - engine_later["before"],
            bare_later["peak"] - bare_later["before"],
            True,
        ),
        common.Row(
            f"{label}: runs.advance executed (bare: chord bodies){_unfinished(engine, items)}",
            "tasks",
            len(engine["advance_ms"]),
            1,
            True,
        ),
        *_against_plain(label, engine, plain, items),
    ]
    began = engine["began"]
    state = "completed" if engine["complete"] else "was given up (still running)"
    notes = [
        _advance_note(engine, 1, items),
        f"engine: the first item started {engine['items_first_start'] - began:.1f} s after "
        f"the start, the last one done finished at {engine['items_last_finish'] - began:.1f} s; "
        f"the run {state} at {_elapsed(engine):.1f} s",
        f"worker RSS before: engine {engine['worker_before']:.0f} MB, bare "
        f"{bare['worker_before']:.0f} MB ({engine['worker_samples']} and "
        f"{bare['worker_samples']} samples); dispatcher RSS before: engine "
        f"{engine['dispatcher_before']:.0f} MB, bare {bare['dispatcher_before']:.0f} MB",
    ]
    return rows, notes


def part_many(
    runs: int = MANY_RUNS, items: int = MANY_ITEMS, budget: float = 240.0
) -> tuple[list[common.Row], list[str]]:
    engine = measure("engine", items, runs, budget)
    plain = measure("plain", items, runs, budget)
    bare = measure("bare", items, runs, budget)
    label = f"{runs:,} x {items:,} items"
    unfinished = _unfinished(engine, runs * items)
    rows = [
        common.Row(
            f"{label}: first start to last run completed / body ran{unfinished}",
            "s",
            _elapsed(engine),
            _elapsed(bare),
            True,
        ),
        common.Row(
            f"{label}: the starts (all run_start / chord calls returned)",
            "s",
            engine["start_seconds"],
            bare["start_seconds"],
            True,
        ),
        common.Row(
            f"{label}: runs.advance executed (bare: chord bodies){unfinished}",
            "tasks",
            len(engine["advance_ms"]),
            runs,
            True,
        ),
        *_against_plain(label, engine, plain, runs * items),
    ]
    notes = [
        _advance_note(engine, runs, items),
        f"engine: the last item done finished at "
        f"{engine['items_last_finish'] - engine['began']:.1f} s, the last run "
        f"{'completed' if engine['complete'] else 'was given up'} at {_elapsed(engine):.1f} s",
    ]
    return rows, notes


# --- Main ----------------------------------------------------------------------------------

MEASURES: dict[str, Callable[[float, float], tuple[list[common.Row], list[str]]]] = {
    "one": lambda scale, budget: part_one(max(2, round(ITEMS * scale)), budget),
    "many": lambda scale, budget: part_many(max(2, round(MANY_RUNS * scale)), MANY_ITEMS, budget),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__)
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the counts (0.1 for a quick check)"
    )
    parser.add_argument(
        "--json", help="also write the rows to this file (bench.run_all reads them back)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds the engine's runs get from their start; past it the figure is a lower bound",
    )
    # The dispatcher's own process (started by this module, not meant to be run by hand).
    parser.add_argument("--dispatch", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--measurement", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.dispatch:
        configure(migrate=False)
        answer = dispatcher(args.dispatch, args.items, args.runs, args.measurement)
        print(json.dumps(answer), flush=True)
        return

    configure()
    rows: list[common.Row] = []
    for part in PARTS if args.part == "all" else (args.part,):
        began, load = time.monotonic(), os.getloadavg()[0]
        part_rows, notes = MEASURES[part](args.scale, args.budget)
        rows += part_rows
        # Others' work on the machine moves these figures: say how busy it was.
        print(
            f"--- {part} ({time.monotonic() - began:.0f} s; 1-min load average "
            f"{load:.1f} before, {os.getloadavg()[0]:.1f} after) ---"
        )
        print("\n".join(notes))
        print(common.format_table(part_rows), flush=True)
    print(
        f"\nworker: celery -A config worker -P prefork -c {CONCURRENCY} -l warning; broker "
        f"{BROKER_URL}, results {RESULTS_URL}, database {DATABASE_URL}; ratio = engine / bare"
    )
    print(common.format_table(rows))
    if args.json:
        common.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
