"""Bare Celery, the floor the engine is measured against (issue 3's benchmark).

The tasks do nothing but note the time in Redis, and every figure is timed on the worker
side (the first task's start to the last task's end, both stamped by the worker), never by a
client waiting on results: Celery's result reader makes such a wait far longer than the work.
The worker includes this module with ``--include bench.bare_celery``.

- ``relay(hops)``: one no-op task that enqueues the next hop itself: the cost of one broker
  round trip plus a task's execution, in ms per hop.
- ``chain(hops)``: a canvas ``chain`` of no-op tasks, in ms per hop.
- ``throughput(runs, hops)``: ``runs`` relays of ``hops`` tasks each, all at once, in tasks
  per second; ``hops=1`` is that many independent tasks. The first hops are queued before the
  worker is told to consume them, so the client's publishing is not what is measured.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence

import redis
from celery import chain as celery_chain
from celery import shared_task
from django.conf import settings

from bench.common import KEY_PREFIX, bench_redis, destinations, wait_for_key
from tests.processes import CeleryProcess


@functools.cache
def _redis() -> redis.Redis:
    # One client per process; redis-py's pool reconnects by itself after the pool's fork.
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def _keys(run: str) -> tuple[str, str, str]:
    base = f"{KEY_PREFIX}{run}"
    return f"{base}:start", f"{base}:end", f"{base}:count"


# --- Tasks (run in the worker) -------------------------------------------------------------


@shared_task(name="bench.relay", ignore_result=True)
def relay_hop(run: str, hop: int, hops: int) -> None:
    start_key, end_key, _ = _keys(run)
    if hop == 1:
        _redis().set(start_key, repr(time.time()))
    if hop < hops:
        relay_hop.delay(run, hop + 1, hops)
    else:
        _redis().set(end_key, repr(time.time()))


@shared_task(name="bench.chain_first", ignore_result=True)
def chain_first(run: str) -> None:
    _redis().set(_keys(run)[0], repr(time.time()))


@shared_task(name="bench.noop", ignore_result=True)
def noop() -> None:
    return None


@shared_task(name="bench.chain_last", ignore_result=True)
def chain_last(run: str) -> None:
    _redis().set(_keys(run)[1], repr(time.time()))


@shared_task(name="bench.tick", ignore_result=True)
def tick(run: str, hop: int, hops: int, total: int, queue: str) -> None:
    """One of ``total`` tasks: stamp the first start, count, stamp the last end."""
    start_key, end_key, count_key = _keys(run)
    pipe = _redis().pipeline(transaction=False)
    pipe.set(start_key, repr(time.time()), nx=True)
    pipe.incr(count_key)
    _, done = pipe.execute()
    if hop < hops:
        tick.apply_async((run, hop + 1, hops, total, queue), queue=queue)
    if done == total:
        _redis().set(end_key, repr(time.time()))


# --- Measurements (run in the client) ------------------------------------------------------


def _elapsed(run: str, timeout: float, worker: CeleryProcess | None) -> float:
    """Seconds from the worker's first stamp to its last; the run's keys are deleted."""
    start_key, end_key, count_key = _keys(run)
    end = float(wait_for_key(end_key, timeout, worker))
    client = bench_redis()
    start = float(client.get(start_key))
    client.delete(start_key, end_key, count_key)
    return end - start


def relay(hops: int, worker: CeleryProcess | None = None, runs: int = 1) -> float:
    """Milliseconds per hop of ``runs`` relays of ``hops`` tasks, each enqueuing the next,
    one after another, their hops averaged (see ``bench.common.runs_for``)."""
    total = 0.0
    for _ in range(runs):
        run = uuid.uuid4().hex
        relay_hop.delay(run, 1, hops)
        total += _elapsed(run, timeout=30 + hops * 0.05, worker=worker)
    return total * 1000 / (runs * (hops - 1))


def chain(hops: int, worker: CeleryProcess | None = None) -> float:
    """Milliseconds per hop of a canvas ``chain`` of ``hops`` immutable no-op signatures."""
    run = uuid.uuid4().hex
    middle = [noop.si() for _ in range(hops - 2)]
    celery_chain(chain_first.si(run), *middle, chain_last.si(run)).apply_async()
    return _elapsed(run, timeout=30 + hops * 0.05, worker=worker) * 1000 / (hops - 1)


def throughput(runs: int, hops: int, worker: CeleryProcess | Sequence[CeleryProcess]) -> float:
    """Tasks per second of ``runs`` concurrent relays of ``hops`` tasks (``hops=1``:
    independent tasks), from the first task's start to the last task's end, on ``worker``
    (one or several nodes)."""
    from config.celery import app

    nodes = destinations(worker)
    run = uuid.uuid4().hex
    queue = f"bench-{run[:12]}"
    total = runs * hops
    with app.producer_or_acquire() as producer:
        for _ in range(runs):
            tick.apply_async((run, 1, hops, total, queue), queue=queue, producer=producer)
    # Only now does the worker see them: what is timed is the worker, not this loop.
    app.control.add_consumer(queue, destination=nodes, reply=True, timeout=5)
    try:
        first = worker if isinstance(worker, CeleryProcess) else worker[0]
        seconds = _elapsed(run, timeout=60 + total * 0.01, worker=first)
    finally:
        app.control.cancel_consumer(queue, destination=nodes, reply=True, timeout=5)
        # The queue was for this measurement only: leave no binding behind in the broker.
        bench_redis().delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    return total / seconds
