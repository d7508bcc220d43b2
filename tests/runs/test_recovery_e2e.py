"""Recovery end to end: the broker restarted, database connections killed, a worker killed.

Real Postgres, Redis, ``celery worker`` and ``celery beat`` processes, with short recovery
knobs (the reconciler every 2 s, a message lost after 2 s, a 3 s lease) so each outage is
recovered in seconds. Every handler writes its executions to the side table of
``tests.runs.flows``, which proves how many times a body really ran: whatever happens, an
``at_most_once`` body never runs twice, and no run is lost.

The broker test restarts a private ``redis-server`` of its own, never the machine's shared
one; the database test kills connections, never the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.db import connection

from runs import services
from runs.models import Run, StepRun
from tests.processes import queued_on_redis, wait_for
from workflows.sync import sync_modules

from .flows import effects, ensure_effects_table
from .flows_recovery import RELAY_EFFECTS
from .test_retry_e2e import Api

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_recovery"]
LEASE_SECONDS = 3
RECONCILE_SECONDS = 2
LOST_MESSAGE_SECONDS = 2
KNOBS = {
    "DJFLOW_LEASE_SECONDS": str(LEASE_SECONDS),
    "DJFLOW_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
    "DJFLOW_LOST_MESSAGE_SECONDS": str(LOST_MESSAGE_SECONDS),
    "DJFLOW_DEADLINE_GRACE_SECONDS": "2",
}
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def start(workflow: str, input=None) -> Run:
    return services.run_start(workflow=workflow, input=input).run


def all_finished(run_ids, timeout: float, logs) -> list[Run]:
    def ended():
        runs = list(Run.objects.filter(id__in=run_ids))
        assert len(runs) == len(run_ids), "a run is missing"
        return runs if all(r.status in TERMINAL for r in runs) else None

    return wait_for(ended, timeout=timeout, interval=0.2, message=logs)


def check_relay_ran_each_body_once(runs: list[Run]) -> None:
    """Every relay run completed, each step with one attempt that succeeded and whose body
    ran exactly once (an at_most_once body above all: never twice)."""
    assert Counter(r.status for r in runs) == {"completed": len(runs)}, [
        (r.id, r.status, r.error) for r in runs if r.status != "completed"
    ]
    for run in runs:
        assert run.output == {
            "n": run.input["n"],
            "last": {"step": "s4", "n": run.input["n"]},
        }
        attempts = Counter(run.steps.values_list("step_id", "status"))
        assert attempts == {(s, "succeeded"): 1 for s in [*RELAY_EFFECTS, "nap"]}, (
            run.id,
            attempts,
        )
        bodies = Counter(step for step, _, _, _, finished in effects(run.id) if finished)
        ran = Counter(step for step, *_ in effects(run.id))
        assert ran == bodies == {step: 1 for step in RELAY_EFFECTS}, (run.id, ran, bodies)


# --- a private Redis, restarted by the test ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A ``redis-server`` of this test alone, on a free loopback port, with no persistence:
    a SIGKILL loses every message it held, as a broker crash would."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.log_path = workdir / f"redis-{self.port}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def env(self) -> dict[str, str]:
        return {"CELERY_BROKER_URL": self.url(0), "CELERY_RESULT_BACKEND": self.url(1)}

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=2)

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("redis-server is not installed")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(
                [
                    *(server, "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def answers() -> bool:
            with contextlib.suppress(redis.RedisError):
                return bool(self.client().ping())
            return False

        wait_for(answers, timeout=10, message=lambda: self.log_path.read_text())

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        self.popen = None


@contextlib.contextmanager
def _this_process_on(broker_url: str, result_backend: str) -> Iterator[None]:
    """Point this process's Celery app (the one the engine sends with after commit, and
    that pings workers) at another broker, and back afterwards.

    Celery reads ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND`` from the environment
    before its configuration, so both are switched. The app caches its connection and
    producer pools (kombu keeps them in a registry by URL, so the old ones are found again
    on the way back): dropping the references makes the next send connect to the new URL.
    """
    from config.celery import app

    def point(broker: str, backend: str) -> None:
        os.environ["CELERY_BROKER_URL"] = broker
        os.environ["CELERY_RESULT_BACKEND"] = backend
        app.conf.broker_url = broker
        app.conf.result_backend = backend
        app._pool = None
        with contextlib.suppress(AttributeError, KeyError):
            app.__dict__["amqp"]._producer_pool = None
        app._backend_cache = None
        app._local.__dict__.pop("backend", None)

    saved_env = {k: os.environ.get(k) for k in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")}
    before = (app.conf.broker_url, app.conf.result_backend)
    point(broker_url, result_backend)
    try:
        yield
    finally:
        point(*before)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    """A private Redis this test's worker, beat and own process use as broker and result
    backend. Request it before ``celery_processes``: the processes are stopped first."""
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        with _this_process_on(server.url(0), server.url(1)):
            yield server
    finally:
        server.kill()


# --- 1. the broker restarted mid-run ----------------------------------------------------


def test_a_redis_restart_mid_run_loses_no_run_and_repeats_no_body(
    private_redis, celery_processes, celery_worker, celery_beat
) -> None:
    # Every step hop goes through the broker (no inline chaining): more messages to lose.
    env = {**private_redis.env, **KNOBS, "DJFLOW_INLINE_MAX_STEPS": "0"}
    sync_modules(FLOWS)
    workers = [celery_worker(workflow_modules=FLOWS, env=env, concurrency=4) for _ in range(2)]
    # A worker of its own for two long at_most_once bodies that run across the restart: it
    # has tasks unacknowledged and free slots polling the broker when the broker dies.
    patient = celery_worker(workflow_modules=FLOWS, env=env, concurrency=4, queues=["long"])
    beat = celery_beat(env=env)
    # Bodies of 0.1 to 0.4 s: the runs drift apart, so the restart finds them at every step.
    relays = [start("relay", {"n": n, "pause": 0.1 + 0.1 * (n % 4)}).id for n in range(48)]
    lingering = [start("lingering", {"n": n, "pause": 10.0}).id for n in range(2)]
    run_ids = relays + lingering
    bodies = len(relays) * len(RELAY_EFFECTS)

    # Mid-run: most first steps have run, and the workers are busy recording them and
    # offering the second ones when the broker dies; and the two long bodies have begun (on
    # a loaded machine the patient worker once took them up 21 ms after the kill).
    wait_for(
        lambda: (
            _executions(relays) >= bodies // 5
            and all(effects(run_id, "long") for run_id in lingering)
        ),
        timeout=30,
        message=celery_processes.logs,
    )
    queued = queued_on_redis(private_redis.client(), "default")
    private_redis.kill()
    killed_at = time.time()
    unfinished = Run.objects.filter(id__in=run_ids).exclude(status__in=TERMINAL).count()
    scheduled = StepRun.objects.filter(run_id__in=run_ids, status="scheduled").count()
    # The kill lost messages (the attempts they offered are still scheduled) and runs.
    assert queued > 0 and scheduled > 0 and unfinished >= 20, (queued, scheduled, unfinished)

    # An outage, not a blip; Celery's consumer tries to reconnect 2 s after the loss.
    time.sleep(1.5)
    private_redis.start()
    restarted_at = time.time()

    finished = all_finished(run_ids, timeout=60, logs=celery_processes.logs)
    check_relay_ran_each_body_once([r for r in finished if r.workflow_id == "relay"])
    for run in (r for r in finished if r.workflow_id == "lingering"):
        assert run.status == "completed", run.error
        # Ran once, across the whole outage, and was recorded once.
        [(_, attempt, _, started, ended)] = effects(run.id, "long")
        assert attempt == 1 and started < killed_at and ended > restarted_at
        assert len(effects(run.id, "after")) == 1
    last = max(r.finished_at.timestamp() for r in finished if r.workflow_id == "relay")
    unsent = sum(w.logs().count("could not offer attempt") for w in workers)
    print(
        f"\nredis restart: {queued} queued messages and {scheduled} scheduled attempts lost,"
        f" {unfinished} runs unfinished, {unsent} offers failed; down"
        f" {restarted_at - killed_at:.1f} s; the 48 short runs done"
        f" {last - restarted_at:.1f} s after the restart"
    )
    # Every process rode the restart out: none died, each worker reconnected.
    processes = [*workers, patient, beat]
    assert all(p.alive() for p in processes), celery_processes.logs()
    for worker in [*workers, patient]:
        assert worker.logs().count("Connected to redis") >= 2, worker.logs()
    # And no task failed for it: a step recorded while the broker was down has its next
    # attempt offered by the reconciler, not a failed task.
    failed = [
        line
        for w in [*workers, patient]
        for line in w.logs().splitlines()
        if "raised unexpected" in line or "Unrecoverable" in line
    ]
    assert failed == [], failed


def _executions(run_ids) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM djflow_test_effects WHERE run_id = ANY(%s)",
            [[str(r) for r in run_ids]],
        )
        return cursor.fetchone()[0]


# --- 2. every database connection killed, repeatedly -------------------------------------


def _kill_other_backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_workers_and_beat_ride_out_killed_database_connections(
    celery_processes, celery_worker, celery_beat
) -> None:
    sync_modules(FLOWS)
    workers = [celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=3) for _ in range(2)]
    beat = celery_beat(env=KNOBS)
    run_ids = [start("relay", {"n": n, "pause": 0.3}).id for n in range(20)]
    wait_for(lambda: _executions(run_ids) >= 4, timeout=30, message=celery_processes.logs)
    killed = []
    for _ in range(3):
        killed.append(_kill_other_backends())
        time.sleep(1.0)
    last_kill = time.time()
    # Each round found the processes' connections (the first found them all).
    assert all(k >= 1 for k in killed) and killed[0] >= 3, killed
    assert Run.objects.filter(id__in=run_ids).exclude(status__in=TERMINAL).exists()

    finished = all_finished(run_ids, timeout=60, logs=celery_processes.logs)
    check_relay_ran_each_body_once(finished)
    last = max(r.finished_at.timestamp() for r in finished)
    # Afterwards the timer tick (beat) and the workers still serve a new run end to end.
    late = start("relay", {"n": 99, "pause": 0.05})
    check_relay_ran_each_body_once(all_finished([late.id], 30, celery_processes.logs))
    print(f"\nkilled backends {killed}; all 20 done {last - last_kill:.1f} s after the last kill")
    assert all(p.alive() for p in [*workers, beat]), celery_processes.logs()


# --- 3. the only worker killed mid-step -------------------------------------------------

STEP_SECONDS = 2.0
# Scheduling slack on top of the engine's own bound: a worker starting (its pool forking),
# the beat tick's phase, the tail step.
SLACK_SECONDS = 3.0


@pytest.mark.parametrize(
    "workflow", ["doomed_at_least_once", "doomed_at_most_once", "doomed_at_most_once_continue"]
)
def test_the_only_worker_killed_mid_step_is_recovered_within_lease_and_period(
    workflow, celery_processes, celery_worker, celery_beat, live_server, user
) -> None:
    """An at_least_once attempt is offered again. An at_most_once one is never run twice: it
    becomes in_doubt (CONTRACT section 13; it failed, class lost, before) and the run waits
    until an operator resolves it over the API: as succeeded with an output (the run goes on
    with it) or as failed (never retried; on_error continue goes on without it)."""
    doomed = celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=2)
    celery_beat(env=KNOBS)
    run = start(workflow, {"seconds": STEP_SECONDS})
    wait_for(lambda: effects(run.id, "slow"), timeout=20, message=celery_processes.logs)
    doomed.kill(signal.SIGKILL)
    killed_at = time.time()
    assert not doomed.alive()
    celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=2)

    if workflow == "doomed_at_least_once":
        [run] = all_finished([run.id], timeout=30, logs=celery_processes.logs)
        elapsed = run.finished_at.timestamp() - killed_at
        slow = list(run.steps.filter(step_id="slow").order_by("attempt"))
        lost = slow[0]
        assert (lost.status, lost.error["class"]) == ("failed", "lost"), lost.error
        # Given up once its lease lapsed (it is renewed every LEASE/3 s), not before.
        given_up = lost.finished_at.timestamp() - killed_at
        assert given_up >= LEASE_SECONDS * 2 / 3 - 0.5, given_up
        bodies = effects(run.id, "slow")
        assert bodies[0][4] is None  # the killed execution never finished
        # Offered again and run to the end: the body ran twice, once killed.
        bound = LEASE_SECONDS + RECONCILE_SECONDS + STEP_SECONDS + SLACK_SECONDS
        assert run.status == "completed", run.error
        assert [(a.attempt, a.status) for a in slow] == [(1, "failed"), (2, "succeeded")]
        assert len(bodies) == 2 and bodies[1][4] is not None
        assert len(effects(run.id, "tail")) == 1
        print(f"\n{workflow}: given up {given_up:.1f} s, run ended {elapsed:.1f} s after the kill")
        assert elapsed < bound, (elapsed, bound)
        return

    def doubted() -> StepRun | None:
        row = StepRun.objects.filter(run_id=run.id, step_id="slow").order_by("attempt").first()
        return row if row is not None and row.status == "in_doubt" else None

    lost = wait_for(doubted, timeout=30, interval=0.1, message=celery_processes.logs)
    doubted_at = time.time() - killed_at
    # In doubt once its lease lapsed, not before, and within a lease and a reconcile period.
    assert doubted_at >= LEASE_SECONDS * 2 / 3 - 0.5, doubted_at
    assert doubted_at < LEASE_SECONDS + RECONCILE_SECONDS + SLACK_SECONDS, doubted_at
    assert lost.error["class"] == "lost" and lost.finished_at is None
    # The run waits, saying which step and which idempotency key to check.
    api = Api(live_server, user)
    shown = wait_for(
        lambda: (r := api.get(f"/api/v1/runs/{run.id}").json())["status"] == "waiting" and r,
        timeout=10,
        message=celery_processes.logs,
    )
    assert lost.idempotency_key in shown["reason"], shown["reason"]
    step = next(s for s in shown["steps"] if s["id"] == lost.id)
    assert (step["status"], step["idempotency_key"]) == ("in_doubt", lost.idempotency_key)
    # Nothing runs it again meanwhile: two reconciler periods later it is still one body.
    time.sleep(2 * RECONCILE_SECONDS)
    assert len(effects(run.id, "slow")) == 1
    assert StepRun.objects.get(id=lost.id).status == "in_doubt"

    if workflow == "doomed_at_most_once":
        body = {"outcome": "succeeded", "output": {"slept": "checked by hand"}}
    else:
        body = {"outcome": "failed"}
    answer = api.post(f"/api/v1/runs/{run.id}/steps/{lost.id}/resolve", body)
    assert answer.status_code == 200, answer.text
    resolved_at = time.time()
    [run] = all_finished([run.id], timeout=30, logs=celery_processes.logs)
    elapsed = run.finished_at.timestamp() - resolved_at
    slow = list(run.steps.filter(step_id="slow").order_by("attempt"))
    tail = run.steps.get(step_id="tail")
    assert run.status == "completed", run.error
    assert len(effects(run.id, "slow")) == 1  # never run twice
    assert len(effects(run.id, "tail")) == 1
    assert run.actions.get(action="resolve").actor == user
    if workflow == "doomed_at_most_once":
        # As if the attempt had succeeded with the operator's output.
        assert [(a.attempt, a.status, a.output) for a in slow] == [
            (1, "succeeded", {"slept": "checked by hand"})
        ]
        assert tail.input == {"slept": "checked by hand"}
    else:  # failed, not retried; on_error: continue goes on
        assert [(a.attempt, a.status, a.error["class"]) for a in slow] == [
            (1, "failed", "in_doubt")
        ]
    print(
        f"\n{workflow}: in doubt {doubted_at:.1f} s after the kill, run ended {elapsed:.1f} s "
        "after the operator resolved it"
    )
    assert elapsed < SLACK_SECONDS, elapsed
