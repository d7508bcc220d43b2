"""Starts survive a worker restart (CONTRACT section 14), on real processes: the only worker
killed (SIGKILL: it never writes its stop), its heartbeats left to lapse, then a burst of
``POST /api/v1/runs``. Every start is accepted, and says it waits for a worker that serves
its handler; once a worker is back, every run completes, each body run exactly once.

Short heartbeats (a worker is live for a second after its last beat) keep the gap short; the
window (``UNSERVABLE_SECONDS``) is long enough that no wait ends in a failure meanwhile.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from runs.models import Run
from tests.processes import wait_for
from workflows import heartbeats
from workflows.models import WorkerHeartbeat
from workflows.sync import sync_modules

from .flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_restart"]
HEARTBEAT_SECONDS = 0.5
LIVE_BEATS = 2
WINDOW = 60
KNOBS = {
    "DJFLOW_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
    "DJFLOW_WORKER_LIVE_BEATS": str(LIVE_BEATS),
    "DJFLOW_UNSERVABLE_SECONDS": str(WINDOW),
}
STARTS = 20
WAITS = "waiting for a worker that serves restarting.one (step 'one', queue 'default')"


@pytest.fixture(autouse=True)
def _knobs(transactional_db, settings) -> None:
    """The test process (the API's start check) judges heartbeats as the workers beat. One
    start a second is planned in the request, the rest of the burst past that pace."""
    settings.DJFLOW = {
        **settings.DJFLOW,
        "WORKER_HEARTBEAT_SECONDS": HEARTBEAT_SECONDS,
        "WORKER_LIVE_BEATS": LIVE_BEATS,
        "UNSERVABLE_SECONDS": float(WINDOW),
        "START_INLINE_PER_SECOND": 1.0,
    }
    ensure_effects_table()
    sync_modules(FLOWS)


def test_starts_while_the_only_worker_restarts_are_accepted_and_each_runs_once(
    api, celery_worker, celery_processes
) -> None:
    doomed = celery_worker(workflow_modules=FLOWS, env=KNOBS)
    first = post_run(api)
    wait_for(
        lambda: Run.objects.get(id=first["id"]).status == "completed",
        timeout=30,
        message=celery_processes.logs,
    )
    doomed.kill(signal.SIGKILL)
    killed = time.monotonic()
    # Killed, not stopped: only the lapse of its beats says it is gone.
    assert WorkerHeartbeat.objects.get(hostname=doomed.hostname).stopped_at is None
    wait_for(lambda: not heartbeats.workers_live(), timeout=10, message="its beats to lapse")
    heartbeats.forget_live_read()

    started = [post_run(api) for _ in range(STARTS)]
    gap = time.monotonic() - killed
    for run in started:
        assert (run["status"], run["reason"][: len(WAITS)]) == ("running", WAITS), run
    # What a client reading a run later sees, too.
    again = api.get(f"/api/v1/runs/{started[-1]['id']}").json()
    assert again["reason"].startswith(WAITS), again

    celery_worker(workflow_modules=FLOWS, env=KNOBS)

    def all_ended() -> list[Run] | None:
        runs = list(Run.objects.filter(id__in=[r["id"] for r in started]))
        return runs if all(r.status in ("completed", "failed") for r in runs) else None

    runs = wait_for(all_ended, timeout=60, interval=0.2, message=celery_processes.logs)
    assert Counter(r.status for r in runs) == {"completed": STARTS}, [
        (r.id, r.status, r.error) for r in runs
    ]
    for run in runs:
        ran = [(step, attempt) for step, attempt, *_ in effects(run.id)]
        assert sorted(ran) == [("one", 1), ("two", 1)], (run.id, ran)
        assert [(s.step_id, s.attempt) for s in run.steps.order_by("id")] == [
            ("one", 1),
            ("two", 1),
        ]
    print(f"{STARTS} starts {gap:.1f} s after the kill: every one accepted, run once")


def post_run(api) -> dict:
    response = api.post("/api/v1/runs", {"workflow": "restarting", "input": {}}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()
