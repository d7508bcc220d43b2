"""The harness for real worker and beat processes (tests/processes.py) works as promised."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django_celery_beat.models import PeriodicTask

from config.celery import app
from tests import celery_probe
from tests.processes import (
    FALLBACK_REDIS_URL,
    WaitTimeout,
    own_redis_url,
    pid_alive,
    purge_broker,
    queued_on_redis,
    wait_for,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _key() -> str:
    return f"probe:{uuid.uuid4().hex}"


def test_wait_for_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", 7])
    assert wait_for(lambda: next(values), timeout=1, interval=0) == 7


def test_wait_for_fails_with_its_message_evaluated_late() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the log said no .*last value: 0"):
        wait_for(lambda: 0, timeout=0.1, interval=0.01, message=lambda: "the log said no")


def test_tests_reach_redis_through_the_configured_broker_url(settings) -> None:
    """Tests named Redis databases 8, 3 and 4 of 127.0.0.1:6379 whatever CELERY_BROKER_URL
    said (issue 37): a suite given a Redis of its own still wrote to the shared one."""
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:6383/2"
    assert own_redis_url() == "redis://127.0.0.1:6383/2"
    assert own_redis_url(1) == "redis://127.0.0.1:6383/3"
    settings.CELERY_BROKER_URL = "filesystem://"
    assert own_redis_url() == FALLBACK_REDIS_URL
    fixed = re.compile(r"redis://(?:127\.0\.0\.1|localhost):6379/[1-9]")
    tests = Path(__file__).resolve().parent
    written = {
        str(path.relative_to(tests)): fixed.findall(path.read_text())
        for path in tests.rglob("*.py")
    }
    assert {name: found for name, found in written.items() if found} == {}


PYTEST = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # DROP DATABASE, below, runs in no transaction
def test_a_session_that_leaves_a_connection_open_still_drops_its_test_database() -> None:
    """pytest-django could not drop a test database a connection was still open to, and left
    it behind (issue 37): the suite's session ends the other sessions on it first."""
    name = f"djflow_leak_{uuid.uuid4().hex[:8]}"
    url = urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{name}").geturl()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["DATABASE_URL"] = url
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [*PYTEST, str(tests / "leaky_session.py")],
        cwd=tests.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [f"test_{name}"])
        (left,) = cursor.fetchone()
        if left:
            cursor.execute(f'DROP DATABASE "test_{name}" WITH (FORCE)')
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert left == 0


def test_purge_drops_waiting_messages() -> None:
    # Route to a queue no configuration names: purge finds it through kombu's bindings.
    queue = f"probe-{uuid.uuid4().hex[:8]}"
    celery_probe.report.apply_async((_key(),), queue=queue)
    client = celery_probe.probe_redis()
    assert queued_on_redis(client, queue) == 1
    # As if another process had sent it: this one's app forgets the queue it declared.
    app.amqp.queues.pop(queue)
    assert purge_broker() >= 1
    assert queued_on_redis(client, queue) == 0


@pytest.mark.slow
def test_worker_runs_a_task_on_the_test_database(celery_worker, user) -> None:
    worker = celery_worker(include=["tests.celery_probe"])
    assert worker.ping()
    assert len(worker.child_pids()) == 2  # -c 2 prefork

    key = _key()
    celery_probe.report.delay(key)  # through the real broker
    raw = wait_for(lambda: celery_probe.probe_redis().get(key), timeout=10, message=worker.logs)
    seen = json.loads(raw)
    assert seen["pid"] in worker.child_pids()
    # The worker reads the database pytest-django made, and the test's committed rows.
    assert seen["database"] == connection.settings_dict["NAME"]
    assert seen["database"].startswith("test_")
    assert seen["users"] == [user.username]

    assert worker.stop() == 0
    assert not worker.alive()
    assert worker.group_pids() == []


@pytest.mark.slow
def test_kill_9_takes_the_pool_children_with_the_worker(celery_worker) -> None:
    worker = celery_worker(include=["tests.celery_probe"])
    key = _key()
    celery_probe.hold.delay(key, 60)
    busy = int(wait_for(lambda: celery_probe.probe_redis().get(key), message=worker.logs))
    pids = [worker.pid, *worker.child_pids()]
    assert busy in pids and len(pids) == 3

    killed = worker.kill(signal.SIGKILL)

    assert sorted(killed) == sorted(pids)
    assert worker.returncode == -signal.SIGKILL
    assert not any(pid_alive(pid) for pid in pids)
    assert worker.group_pids() == []
    assert worker.ping(timeout=0.2) is False


@pytest.mark.slow
def test_two_workers_start_side_by_side_with_their_own_names(celery_worker) -> None:
    first = celery_worker(concurrency=1, wait=False)
    second = celery_worker(concurrency=1, pool="solo", wait=False)
    first.wait_ready()
    second.wait_ready()
    assert first.hostname != second.hostname
    replies = app.control.ping(destination=[first.hostname, second.hostname], timeout=1)
    assert {name for reply in replies for name in reply} == {first.hostname, second.hostname}
    assert second.child_pids() == []  # the solo pool runs tasks in the main process


@pytest.mark.slow
def test_beat_starts_on_the_test_database_and_stops(celery_beat, tmp_path) -> None:
    beat = celery_beat()
    # On start-up the DatabaseScheduler stores its default entries in the test database.
    wait_for(
        lambda: PeriodicTask.objects.filter(name="celery.backend_cleanup").exists(),
        timeout=10,
        message=beat.logs,
    )
    pidfile = next((tmp_path / "celery").glob("*.pid"))
    assert int(pidfile.read_text()) == beat.pid

    assert beat.stop() == 0
    assert not pid_alive(beat.pid)
    assert beat.group_pids() == []
