"""What the fan-out benchmark's worker loads (``bench.fanout``): the engine's workflow, through
``WORKFLOW_MODULES``, and the bare-Celery tasks, through ``--include``.

- ``bench_fan``: one ``foreach`` over ``${input.items}`` (up to 10,000) whose body is a no-op
  ``task``; the run's output is the list of the items' outputs. ``run_start`` plans the
  first items, and ``runs.advance`` tasks in the worker the rest.
- ``bench_fan_later``: a no-op ``task``, then the same ``foreach``: the fan-out is planned
  by the worker that records the first step, and sent from its pool process.
- ``bench.fan.noop``: the bare chord's header task (it keeps a result: a chord counts
  them); ``bench.fan.done``: the chord's body, a no-op that stamps when it ran;
  ``bench.fan.send``: a task sending such a chord from the worker.

The worker also notes, through Celery's ``task_prerun``/``task_postrun`` signals, how long
each ``runs.advance`` took (one Redis write per advance: the benchmark shows how many
advances a fan-out cost) and which other tasks took more than 0.1 s, with their arguments (to
find the one that fanned out).
Stamps and counters go to the results database of the bench (``CELERY_RESULT_BACKEND``);
every time is the worker's own clock.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import redis
from celery import chord, current_task, shared_task
from celery.signals import task_postrun, task_prerun
from django.conf import settings

from workflows.sdk import handler, task, workflow

NOOP = "bench.fan.noop"
KEY_PREFIX = "bench-fan:"
ADVANCE_TIMES = f"{KEY_PREFIX}advance-ms"
SLOW_TASKS = f"{KEY_PREFIX}slow-tasks"
SLOW_SECONDS = 0.1
MAX_ITEMS = 10_000


@handler(NOOP)
def noop_step(ctx: Any, input: Any, prior: Any) -> None:
    return None


# max_steps counts every attempt (default 1,000): room for the items and the first step.
LIMITS = {"run_timeout_ms": 3_600_000, "max_steps": MAX_ITEMS + 10}

workflow("bench_fan", limits=LIMITS).foreach(
    "fan", items="${input.items}", max_items=MAX_ITEMS, do=task("item", handler=NOOP)
)
# The task whose first step fans out: noted by the worker whatever it took (see _ended).
FIRST = "bench.fan.first"
_fanning_out: set[str] = set()


@handler(FIRST)
def first_step(ctx: Any, input: Any, prior: Any) -> None:
    request_id = getattr(getattr(current_task, "request", None), "id", None)
    if request_id:
        _fanning_out.add(request_id)
    return None


workflow("bench_fan_later", limits=LIMITS).task("first", handler=FIRST).foreach(
    "fan", items="${input.items}", max_items=MAX_ITEMS, do=task("item", handler=NOOP)
)


@functools.cache
def _redis() -> redis.Redis:
    # One client per process; redis-py's pool reconnects by itself after the pool's fork.
    return redis.Redis.from_url(settings.CELERY_RESULT_BACKEND)


def keys(measurement: str) -> tuple[str, str]:
    """(count, end) of one bare measurement: chord bodies run so far, the last one's stamp."""
    base = f"{KEY_PREFIX}{measurement}"
    return f"{base}:count", f"{base}:end"


# --- Bare Celery ---------------------------------------------------------------------------


@shared_task(name="bench.fan.noop")
def noop() -> None:
    return None


@shared_task(name="bench.fan.done", ignore_result=True)
def done(measurement: str, chords: int) -> None:
    """The body of one of ``chords`` chords: the last to run stamps the end."""
    count, end = keys(measurement)
    if _redis().incr(count) == chords:
        _redis().set(end, repr(time.time()))


@shared_task(name="bench.fan.send", ignore_result=True)
def send(measurement: str, items: int) -> None:
    """Send a chord of ``items`` no-op tasks from the worker (the bare side of a fan-out
    planned in the worker)."""
    chord([noop.si() for _ in range(items)])(done.si(measurement, 1))


# --- What the worker notes about its own tasks ---------------------------------------------

_started: dict[str, float] = {}


@task_prerun.connect
def _began(task_id: str = "", **_: Any) -> None:
    _started[task_id] = time.perf_counter()


@task_postrun.connect
def _ended(task_id: str = "", task: Any = None, args: Any = (), **_: Any) -> None:
    began = _started.pop(task_id, None)
    if began is None:
        return
    seconds = time.perf_counter() - began
    name = getattr(task, "name", "")
    if name == "runs.advance":
        _redis().rpush(ADVANCE_TIMES, f"{seconds * 1000:.3f}")
    elif seconds > SLOW_SECONDS or task_id in _fanning_out:
        # The task that fanned out is noted however quick it was (a fan-out sent in 0.1 s
        # once went unnoticed, and bench.fanout waited for it in vain).
        _fanning_out.discard(task_id)
        entry = {"name": name, "args": list(args or ()), "seconds": seconds}
        _redis().rpush(SLOW_TASKS, json.dumps(entry))
