"""``python -m bench.run_bytes``: what one request makes a run store, and what reading that
run costs the web process (issue 36, deliver 5).

A ``POST /api/v1/runs`` of about ``--bytes`` (934 KB by default) starts a workflow whose
``foreach`` over ``--items`` items gives each item the whole run input and answers it back
(the amplification of the issue). The run is driven in this process (``runs.engine.advance``
and the worker's ``execute``, no broker), then the figures:

- ``db growth``: ``pg_database_size`` after the run minus before it (the journal's values are
  TOASTed: compressed, so a value of repeated characters counts less than its bytes; the
  body is random letters so it does not compress much);
- ``stored``: the bytes of values in the run's journal as Postgres stores them (text);
- in a fresh process, for ``GET /api/v1/runs/{id}`` and ``GET /api/v1/runs?limit=500`` (with
  ``--list-runs`` more runs whose output is their input of the same size): the answer's size
  and how much the process's peak RSS grew while answering it.

It runs on the bench's Postgres database (``DJFLOW_BENCH_DATABASE_URL``, see
``bench.common``) and leaves the run there. Run it at two commits to compare (the script
needs nothing of the newer code)::

    .venv/bin/python -m bench.run_bytes            # --bytes 934000 --items 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import time
from typing import Any

from bench import common

WORKFLOW = "bench_run_bytes"
USERNAME = "bench_run_bytes"


def _echo(ctx: Any, input: Any, prior: Any) -> Any:
    return input


def _client() -> Any:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    user, _ = get_user_model().objects.get_or_create(
        username=USERNAME, defaults={"is_superuser": True, "is_staff": True}
    )
    token, _ = Token.objects.get_or_create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def _database_size() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")
        cursor.execute("SELECT pg_database_size(current_database())")
        return int(cursor.fetchone()[0])


def _stored(run_id: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(octet_length(input::text), 0)"
            " + coalesce(octet_length(output::text), 0)"
            " + coalesce(octet_length(error::text), 0)), 0) FROM runs_steprun WHERE run_id = %s",
            [run_id],
        )
        return int(cursor.fetchone()[0])


def _drive(run_id: str, timeout: float = 900) -> str:
    from runs.engine.advance import run_advance
    from runs.models import Run, StepRun
    from workers.execution import execute

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = Run.objects.get(id=run_id)
        if run.status in ("completed", "failed", "cancelled", "timed_out"):
            return f"{run.status} ({(run.error or {}).get('class', '')})"
        run_advance(run_id=run.id)
        scheduled = StepRun.objects.filter(run_id=run.id, status="scheduled")
        for step_run_id in scheduled.values_list("id", flat=True):
            execute(step_run_id, worker="bench")
    raise SystemExit(f"run {run_id} did not end in {timeout} s")


def start(size: int, items: int, list_runs: int) -> None:
    from workflows import registry
    from workflows.services import definition_save

    definition_save(
        document={
            "id": WORKFLOW,
            "limits": {"run_timeout_ms": 3_600_000, "max_steps": 10_000},
            "steps": [
                {
                    "id": "fan",
                    "kind": "foreach",
                    "items": "${input.items}",
                    "max_items": 10_000,
                    "do": {"id": "item", "kind": "task", "input": "${input}"},
                }
            ],
        }
    )
    registry.register(WORKFLOW, "item", _echo)
    client = _client()
    letters = random.Random(36).choices(string.ascii_letters, k=size)
    body = {"workflow": WORKFLOW, "input": {"blob": "".join(letters), "items": list(range(items))}}
    raw = json.dumps(body).encode()
    before = _database_size()
    response = client.generic("POST", "/api/v1/runs", raw, content_type="application/json")
    if response.status_code != 201:
        raise SystemExit(f"{response.status_code}: {response.content[:500]!r}")
    run_id = response.json()["id"]
    ended = _drive(run_id)
    growth = _database_size() - before
    # Runs that answer their input back as their output: what GET /runs lists of each.
    definition_save(
        document={
            "id": f"{WORKFLOW}_list",
            "steps": [{"id": "nap", "kind": "sleep", "ms": 0}],
            "output": "${input}",
        }
    )
    for _ in range(list_runs):
        listed = {"workflow": f"{WORKFLOW}_list", "input": body["input"]}
        listed_raw = json.dumps(listed).encode()
        started = client.generic(
            "POST", "/api/v1/runs", listed_raw, content_type="application/json"
        )
        _drive(started.json()["id"])
    print(f"POST /runs body      | {len(raw):>13,} bytes")
    print(f"run                  | {run_id} {ended}")
    print(f"stored (journal)     | {_stored(run_id):>13,} bytes")
    print(f"db growth            | {growth:>13,} bytes")
    for path in (f"/api/v1/runs/{run_id}", "/api/v1/runs?limit=500"):
        # A fresh process, as a web worker answering its first big request.
        subprocess.run([sys.executable, "-m", "bench.run_bytes", "--answer", path], check=True)


def _status_kb(name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/self/status")


def answer(path: str) -> None:
    client = _client()
    client.get("/api/v1/runs?limit=1")  # imports and caches, before the baseline
    # The peak so far is reset (Linux: clear_refs 5), so the growth is this request's own.
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    rss = _status_kb("VmRSS")
    started = time.perf_counter()
    response = client.get(path)
    seconds = time.perf_counter() - started
    grown = _status_kb("VmHWM") - rss
    name = "GET /runs?limit=500" if "?" in path else "GET /runs/{id}"
    print(
        f"{name:<20} | {len(response.content):>13,} bytes | {response.status_code}"
        f" | peak RSS +{grown / 1024:,.0f} MB | {seconds:.2f} s"
    )


def main() -> None:
    # The items run in this process: no worker's heartbeat is there to check at the start.
    os.environ.setdefault("DJFLOW_START_CHECKS_WORKERS", "false")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=934_000, help="the input's blob, in bytes")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--list-runs", type=int, default=20, help="runs echoing it, for GET /runs")
    parser.add_argument("--answer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.configure()
    if args.answer:
        answer(args.answer)
    else:
        start(args.bytes, args.items, args.list_runs)


if __name__ == "__main__":
    main()
