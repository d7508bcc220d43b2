"""``python -m bench.starts``: starts per second from concurrent clients (issue 17).

``clients`` processes (4 by default; processes, so one interpreter's lock does not cap them)
each start ``count / clients`` runs of a one-step no-op workflow (``bench_seq_1``) as fast as
they can; the same number of processes send as many bare ``apply_async`` of a no-op task
(``bench.noop``) on the same broker. Starts per second = total / wall time, from the moment
every client is warmed up and told to go to the moment the last one is done.

The engine is measured two ways:

- **service**: each client calls ``runs.services.run_start`` as the API's view calls it, in
  its own process (no HTTP);
- **HTTP**: each client ``POST``s ``/api/v1/runs`` with a token (a user holding only the
  ``starter`` role on the workflow) to the project's gunicorn
  (``gunicorn -c python:config.gunicorn config.wsgi:application``, ``--web-workers`` sync
  workers, 4 by default), one new connection per request (gunicorn's sync workers close
  each), closed by the client once it has read the answer.
  This is the figure issue 17's goal names.

A ``celery -A config worker`` runs on the same services (it saves the workflow and its
heartbeat is what the start's pre-flight asks for), but consumes nothing while a side is
timed (``cancel_consumer``), as bare Celery's queued tasks are never run either: what is
timed is the client and whatever answers it (gunicorn, Postgres, the broker), not the steps.
The broker is purged after each side.

Importable: ``measure(worker, count=..., clients=..., repeat=...)`` returns the rows
``bench.run_all`` prints (``bench.common.Row``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from bench import common

WORKFLOW = "bench_seq_1"
USERNAME = "bench_starter"
ENGINE_QUEUES = ("default", "engine")
# Starts each client makes before it is timed: imports, connections and caches warmed.
WARM_UP = 20


# --- The clients (each in a process of its own, spawned: no Django state inherited) ---------


def _setup_client() -> None:
    """This process on the bench's services (the parent's environment, set by configure)."""
    import django

    django.setup()


def _service_client(count: int) -> None:
    from runs.services import run_start

    for _ in range(count):
        # As POST /runs calls it: a worker plans the first step.
        run_start(workflow=WORKFLOW, input={}, plan_now=False)


def _bare_client(count: int) -> None:
    from bench.bare_celery import noop

    for _ in range(count):
        noop.apply_async()


def _http_sender(base_url: str, token: str) -> Callable[[int], None]:
    """POST /api/v1/runs, one connection per request, closed by the client once it has read
    the answer, as curl does. (A pooling client such as a ``requests.Session`` keeps the
    socket after gunicorn's ``Connection: close``, and gunicorn 27's sync worker lingers on
    close until the client closes, up to 2 s: measured here, that held the workers and gave
    23 starts/s with the server mostly idle.)"""
    parts = urlsplit(base_url)
    body = json.dumps({"workflow": WORKFLOW, "input": {}})
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}

    def send(count: int) -> None:
        for _ in range(count):
            _request(parts, "POST", "/api/v1/runs", 201, body, headers)

    return send


def _request(
    parts: Any,
    method: str,
    path: str,
    expected: int,
    body: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """One request on a connection of its own, closed once the answer is read."""
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        answer = response.read()
    finally:
        connection.close()
    if response.status != expected:
        raise RuntimeError(f"{method} {path}: {response.status} {answer[:500]!r}")


def _floor_sender(base_url: str) -> Callable[[int], None]:
    """GET /, anonymous, one connection per request as above: every middleware and a
    redirect to the sign-in page, no statement, no message. The most Django's request path
    on this gunicorn answers: the ceiling of any view."""
    parts = urlsplit(base_url)

    def send(count: int) -> None:
        for _ in range(count):
            _request(parts, "GET", "/", 302)

    return send


def _client(side: str, count: int, arg: Any, ready: Any, go: Any, results: Any) -> None:
    """Warm up, say so, wait for the go, then ``count`` starts; report (began, ended)."""
    try:
        _setup_client()
        if side == "http":
            send = _http_sender(*arg)
        elif side == "floor":
            send = _floor_sender(arg)
        elif side == "service":
            send = _service_client
        else:
            send = _bare_client
        send(WARM_UP)
        ready.release()
        go.wait()
        began = time.time()
        send(count)
        results.put((began, time.time(), None))
    except BaseException as error:  # reported to the parent, which raises it
        ready.release()
        results.put((0.0, 0.0, f"{type(error).__name__}: {error}"))


def clients_rate(side: str, total: int, clients: int, args: list[Any] | None = None) -> float:
    """Starts (or bare sends) per second of ``clients`` processes making ``total`` together;
    client ``i`` gets ``args[i]``."""
    context = multiprocessing.get_context("spawn")
    ready, go, results = context.Semaphore(0), context.Event(), context.Queue()
    share = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    args = args or [None] * clients
    processes = [
        context.Process(target=_client, args=(side, n, arg, ready, go, results))
        for n, arg in zip(share, args, strict=True)
    ]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            if not ready.acquire(timeout=120):
                raise TimeoutError(f"{side} clients not ready within 120 s")
        go.set()
        spans = [results.get(timeout=600) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [error for _, _, error in spans if error]
    if errors:
        raise RuntimeError(f"{side} client failed: {errors[0]}")
    began = min(b for b, _, _ in spans)
    ended = max(e for _, e, _ in spans)
    return total / (ended - began)


# --- The web server ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_gunicorn(workers: int, cache_url: str | None = None) -> Iterator[str]:
    """The project's gunicorn on the bench services (``CACHE_URL``, where the API's throttle
    counts, as given: the deployment's default, the database, when None); yields its base
    URL."""
    from tests.processes import gunicorn_argv, service_env, wait_for

    port = _free_port()
    env = service_env(
        database_url=common.DATABASE_URL,
        broker_url=common.REDIS_URL,
        result_backend=common.REDIS_URL,
        # The API's throttle still counts every request (in the deployment's default cache,
        # the database), at a rate the bench does not reach.
        extra={
            "DJFLOW_API_THROTTLE_USER": "100000000/min",
            **({"CACHE_URL": cache_url} if cache_url else {}),
        },
    )
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="djflow-bench-web-") as workdir:
        log = Path(workdir) / "gunicorn.log"
        with log.open("wb") as out:
            web = subprocess.Popen(
                [*gunicorn_argv(port, workers), "--log-level", "warning"],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _answers(url) or web.poll() is not None, timeout=60, interval=0.2)
            if web.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {log.read_text()[-3000:]}")
            yield url
        finally:
            web.terminate()
            try:
                web.wait(timeout=30)
            except subprocess.TimeoutExpired:
                web.kill()


def _answers(url: str) -> bool:
    import requests

    try:
        requests.get(f"{url}/api/v1/runs", timeout=5)
    except requests.RequestException:  # not listening yet, or still loading
        return False
    return True


def starter_tokens(count: int) -> list[str]:
    """API tokens of ``count`` users (one per client) who may start runs of the workflow and
    do nothing more."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from workflows import access

    tokens = []
    for number in range(count):
        user, _ = get_user_model().objects.get_or_create(username=f"{USERNAME}_{number}")
        access.grant(access.STARTER, WORKFLOW, user=user)
        tokens.append(str(Token.objects.get_or_create(user=user)[0].key))
    return tokens


# --- The figures ------------------------------------------------------------------------------


@contextlib.contextmanager
def _not_consuming(worker: Any) -> Iterator[None]:
    """The worker consumes none of the queues the two sides send to while a side is timed;
    what they queued is purged afterwards."""
    from config.celery import app
    from tests.processes import purge_broker

    destination = [worker.hostname]
    for queue in ENGINE_QUEUES:
        app.control.cancel_consumer(queue, destination=destination, reply=True, timeout=5)
    try:
        yield
    finally:
        purge_broker()
        for queue in ENGINE_QUEUES:
            app.control.add_consumer(queue, destination=destination, reply=True, timeout=5)


def _wait_until_served(timeout: float = 60) -> None:
    """The worker saved the workflow and its heartbeat says it serves the step's handler."""
    from tests.processes import wait_for
    from workflows.heartbeats import unserved_steps
    from workflows.models import WorkflowVersion

    def served() -> bool:
        version = WorkflowVersion.objects.filter(workflow_id=WORKFLOW).first()
        return version is not None and not unserved_steps(document=version.document)

    wait_for(served, timeout=timeout, interval=0.5, message=f"{WORKFLOW} served by the worker")


def measure(
    worker: Any,
    *,
    count: int = 2000,
    clients: int = 4,
    repeat: int = 3,
    web_workers: int = 4,
    cache_url: str | None = None,
    log: Callable[[str], None] = print,
) -> list[common.Row]:
    """Median starts per second over ``repeat`` rounds, each side in turn in every round;
    with ``cache_url``, POST /runs also to a second gunicorn whose throttle counts there."""

    _wait_until_served()
    tokens = starter_tokens(clients)
    rates: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(running_gunicorn(web_workers))
        sides: list[tuple[str, Any]] = [
            ("bare", None),
            ("service", None),
            ("http", [(url, token) for token in tokens]),
            ("floor", [url] * clients),
        ]
        if cache_url:
            other = stack.enter_context(running_gunicorn(web_workers, cache_url))
            sides.append(("http_cache", [(other, token) for token in tokens]))
        stack.enter_context(_not_consuming(worker))
        for round_ in range(repeat):
            for side, args in sides:
                # Each round starts with the API's throttle counts empty, as after a quiet
                # minute: DRF's throttle keeps every request time of the last minute, so
                # rounds back to back would each pay for the ones before.
                _clear_throttle_counts(cache_url)
                rate = clients_rate(side.partition("_")[0], count, clients, args)
                rates.setdefault(side, []).append(rate)
                log(f"round {round_ + 1}: {side} {rate:,.0f}/s (load {_load()})")
    bare = statistics.median(rates["bare"])
    label = f"{clients} clients x {count // clients} starts"
    http = f"{label}: POST /runs (gunicorn -w {web_workers}"
    named = [
        ("service", f"{label}: run_start vs apply_async"),
        ("http", f"{http}) vs apply_async"),
        ("http_cache", f"{http}, CACHE_URL={cache_url}) vs apply_async"),
        ("floor", f"{label}: GET / (anonymous redirect, no view: Django's ceiling) vs apply_async"),
    ]
    return [
        common.Row(name, "starts/s", statistics.median(rates[side]), bare, False)
        for side, name in named
        if side in rates
    ]


def _clear_throttle_counts(cache_url: str | None) -> None:
    """Empty the caches the API's throttles count in (the bench's own: nothing else in the
    database's; only the throttle's keys in Redis, ``cache_url``, a ``redis://`` URL)."""
    from django.core.cache import cache

    cache.clear()
    if cache_url:
        client = redis.Redis.from_url(cache_url)
        keys = list(client.scan_iter(match="*throttle_*"))
        if keys:
            client.delete(*keys)


def profile(side: str, count: int, *, plan_now: bool) -> None:
    """One process, no worker: ``count`` starts (``side`` "service": ``run_start``; "http":
    ``POST /api/v1/runs`` through Django's test client, every middleware, no gunicorn), then
    prints the statements of one start, the CPU and wall milliseconds per start, and
    pyinstrument's profile. A heartbeat row stands in for the worker the pre-flight asks for.
    ``plan_now`` false: the first step handed to a worker, as POST /runs does past its pace."""
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone
    from pyinstrument import Profiler

    from runs.services import run_start
    from workflows.heartbeats import heartbeat_record

    # The heartbeat below stays live however long the profile takes.
    settings.DJFLOW = {
        **settings.DJFLOW,
        "START_INLINE_PER_SECOND": 1e9 if plan_now else 0,
        "WORKER_LIVE_BEATS": 10**6,
    }
    heartbeat_record(
        hostname="bench-profile@here",
        handlers=["bench.noop"],
        queues=["default"],
        pid=0,
        started_at=timezone.now(),
    )
    # The bench's flows, as a worker saves them at start-up (there is no worker here).
    from bench import engine
    from workflows.sync import sync_modules

    sync_modules(engine.WORKFLOW_MODULES)
    client = Client(HTTP_AUTHORIZATION=f"Token {starter_tokens(1)[0]}")

    def http() -> None:
        answer = client.post(
            "/api/v1/runs", {"workflow": WORKFLOW, "input": {}}, content_type="application/json"
        )
        if answer.status_code != 201:
            raise RuntimeError(answer.content)

    def service() -> None:
        run_start(workflow=WORKFLOW, input={}, plan_now=plan_now)

    start = http if side == "http" else service
    for _ in range(WARM_UP):
        start()
    with CaptureQueriesContext(connection) as queries:
        start()
    print(f"{side}, plan_now={plan_now}: {len(queries.captured_queries)} statements per start")
    for query in queries.captured_queries:
        print("   ", " ".join(query["sql"].split())[:110])
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        start()
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    print(f"{cpu * 1000 / count:.2f} ms CPU, {wall * 1000 / count:.2f} ms wall per start")
    profiler = Profiler(interval=0.0005)
    profiler.start()
    for _ in range(count):
        start()
    profiler.stop()
    print(profiler.output_text(unicode=False, color=False))


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.starts", description=__doc__)
    parser.add_argument("--count", type=int, default=2000, help="starts per side and round")
    parser.add_argument("--clients", type=int, default=4, help="client processes per side")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median")
    parser.add_argument("--web-workers", type=int, default=4, help="gunicorn's sync workers")
    parser.add_argument(
        "--profile",
        choices=["service", "http", "service-inline", "http-inline"],
        help="instead: profile starts in this process (no worker, no gunicorn)",
    )
    parser.add_argument(
        "--cache-url",
        help="also POST /runs to a gunicorn whose throttle counts in this redis:// cache",
    )
    args = parser.parse_args(argv)

    if args.profile:
        # Before the settings load: the API's throttle must not refuse the profile's starts.
        os.environ.setdefault("DJFLOW_API_THROTTLE_USER", "100000000/min")
    common.configure()
    if args.profile:
        side, _, inline = args.profile.partition("-")
        profile(side, args.count, plan_now=bool(inline))
        return
    from bench import engine

    with common.running_worker(workflow_modules=engine.WORKFLOW_MODULES) as worker:
        rows = measure(
            worker,
            count=args.count,
            clients=args.clients,
            repeat=args.repeat,
            web_workers=args.web_workers,
            cache_url=args.cache_url,
        )
    print(f"broker {common.REDIS_URL}; median of {args.repeat}; load {_load()}")
    print(common.format_table(rows), flush=True)


if __name__ == "__main__":
    main()
