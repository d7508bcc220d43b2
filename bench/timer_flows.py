"""What the timer benchmark's worker loads (``bench.timers``): the engine's workflows, through
``WORKFLOW_MODULES``, and the bare-Celery tasks, through ``--include``.

- ``bench_timers_wait``: a ``wait_event`` on ``bench.go`` with the run's own key, timing out
  in an hour: a run parked on an event.
- ``bench_timers_nap``: a one-hour ``sleep``: a run parked on time.
- ``bench_timers_at``: ``sleep_until`` the input's ``at`` (epoch ms), then one no-op step:
  its ``started_at`` is when user code runs again, what a bare ETA task's start is.

The bare tasks stamp ``time.time()`` where the figure needs it, into Redis (the results
database of the bench, ``CELERY_RESULT_BACKEND``): the timing is the worker's, never a
client's wait on results.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import redis
from celery import shared_task
from django.conf import settings

from workflows.sdk import handler, workflow

NOOP = "bench.timers.noop"
EVENT = "bench.go"
HOUR_MS = 3_600_000
KEY_PREFIX = "bench-timers:"
# Generous: a run's deadline (and its timer) must never be what a figure sees.
LIMITS = {"run_timeout_ms": 2 * HOUR_MS}


@handler(NOOP)
def noop(ctx: Any, input: Any, prior: Any) -> None:
    return None


workflow("bench_timers_wait", limits=LIMITS).wait_for(
    "go", event=EVENT, key="${input.key}", timeout_ms=HOUR_MS
)
workflow("bench_timers_nap", limits=LIMITS).sleep("nap", ms=HOUR_MS)
workflow("bench_timers_at", limits=LIMITS).sleep_until("at", until="${input.at}").task(
    "after", handler=NOOP
)


# --- Bare Celery ---------------------------------------------------------------------------


@functools.cache
def _redis() -> redis.Redis:
    # One client per process; redis-py's pool reconnects by itself after the pool's fork.
    return redis.Redis.from_url(settings.CELERY_RESULT_BACKEND)


def keys(run: str) -> tuple[str, str, str]:
    """(starts, count, end) of one measurement: a list of "due started" stamps, a counter,
    the last task's end stamp."""
    base = f"{KEY_PREFIX}{run}"
    return f"{base}:starts", f"{base}:count", f"{base}:end"


@shared_task(name="bench.timers.eta", ignore_result=True)
def eta_task(run: str, total: int, due: float) -> None:
    """One of ``total`` ETA tasks due at ``due`` (epoch seconds, the message's ``eta``): note
    when it started; the last one to finish notes when it ended."""
    started = time.time()
    starts, count, end = keys(run)
    pipe = _redis().pipeline(transaction=False)
    pipe.rpush(starts, f"{due!r} {started!r}")
    pipe.incr(count)
    _, done = pipe.execute()
    if done == total:
        _redis().set(end, repr(time.time()))
