"""The chaos suite: many runs of mixed workflows while a monkey kills workers and restarts
Redis and Postgres; at the end nothing is lost, stuck or done twice.

    .venv/bin/python -m bench.chaos                      # the full run: 1,000 runs
    .venv/bin/python -m bench.chaos --runs 100 --rate 2 --redis-restarts 1 \\
        --postgres-restarts 1 --min-kills 2 --timeout 240  # what .ci/run runs

The workflows (``bench/chaos_flows.py``) mix sequences, ``foreach``, ``parallel``, sleeps,
waits for events the script sends, approvals the script decides through the API, and
``at_most_once`` steps. They run on 3 ``celery worker`` processes and 2 ``celery beat``
processes (real ones, the tests' harness), and the script drives them through the REST API
served by gunicorn. Meanwhile the monkey SIGKILLs a random worker's whole process group every
5 to 20 s (one running a step when there is one: the journal says which) and starts it
again, and restarts Redis and Postgres at moments spread over the start phase.

Redis and Postgres are **private** to the run: a ``redis-server`` and a Postgres cluster
(``initdb`` into a temporary directory, the Debian binaries under /usr/lib/postgresql/*/bin)
on free loopback ports. The issue asks for ``pg_ctlcluster ... restart`` of the local cluster;
restarting the machine's shared cluster would break every other test and session using it,
so the private cluster is restarted with ``pg_ctl restart`` instead: the same outage for the
engine (every connection dropped, the server away for a moment), and nobody else's.
One Postgres restart is ``-m fast`` (a clean shutdown), the next ``-m immediate`` (a crash:
the next start replays the WAL), alternately. Redis runs without persistence and is restarted
with SIGKILL: every queued message, chord counter and result it held is gone, as in a crash.

At the end every run must have ended with the status and output computed from its input
(``chaos_flows.expected``). What proves the rest:

- *duplicated*: every body appends a line to a file with ``O_APPEND`` before it runs (see
  chaos_flows); two lines with one ``at_most_once`` idempotency key are a body run twice.
  Every completed run's ``at_most_once`` steps must also have exactly one line: an output
  without its body would be as wrong.
- *timers fired twice*: a trigger on the timer table (installed by the script on its private
  database) copies every committed claim of a timer into a side table in the claim's own
  transaction; the engine deletes a run's timers when it ends, the side table keeps them.
  Two claims of one (run, key) are a timer fired twice. Each sleep step has one attempt.
- *stuck*: a run not ended when the last check is due; *lost*: a run the API acknowledged
  that is not in the database, or that ended with another status or output than expected.

A worker killed while it runs an ``at_most_once`` body leaves an attempt that may have had its
effect: the engine never runs it again; it holds it ``in_doubt`` for an operator (contract
section 13), and here nobody resolves it, so its deadline (``DJFLOW_IN_DOUBT_SECONDS``, 5 s
here) fails it with class ``in_doubt`` and that run fails. Such runs are counted apart (*given
up*) and checked: the failed step is ``at_most_once``, its class is ``in_doubt`` (``lost``
before in_doubt existed) and its body ran at most once. Every other run must complete (or,
for a rejected approval, fail with class ``rejected``). Resolving by an operator is the
end-to-end tests' (tests/runs/test_recovery_e2e.py).

Exit status 0 only when lost, stuck, duplicated and timers fired twice are all 0. Never run it
on a busy machine: it starts nine processes of its own.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import chaos_flows as flows
from tests.processes import (
    BASE_DIR,
    CeleryProcess,
    beat_process,
    service_env,
    wait_for,
    worker_process,
)

FLOWS_MODULE = "bench.chaos_flows"
TERMINAL = ("completed", "failed", "cancelled", "timed_out")
# The classes of an at_most_once attempt given up under a lost worker (see the docstring).
GIVEN_UP = ("in_doubt", "lost")
# Recovery knobs shorter than the defaults, so an outage is recovered in seconds rather than
# the minute a deployment may take, yet long enough that a loaded 2-core machine's late
# heartbeat is not taken for a lost worker (which would give up at_most_once steps).
KNOBS = {
    "DJFLOW_LEASE_SECONDS": "10",
    "DJFLOW_RECONCILE_SECONDS": "5",
    "DJFLOW_LOST_MESSAGE_SECONDS": "5",
    "DJFLOW_DEADLINE_GRACE_SECONDS": "2",
    # Nobody resolves an attempt in doubt here: its deadline fails it (see the docstring).
    "DJFLOW_IN_DOUBT_SECONDS": "5",
    # The chaos is not a test of the API's throttles: a thousand starts, events and
    # decisions in a few minutes from one user would be refused.
    "DJFLOW_API_THROTTLE_USER": "1000000/min",
    "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
}
TIMER_FIRES_TABLE = "chaos_timer_fires"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- private services -------------------------------------------------------------------


class PrivateRedis:
    """A ``redis-server`` of this run alone on a free loopback port, without persistence:
    a restart (SIGKILL, then a new server on the same port) loses every message it held."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.log_path = workdir / "redis.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server is not installed")
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
        wait_for(self._answers, timeout=15, message="the private redis-server to answer")

    def _answers(self) -> bool:
        import redis

        with contextlib.suppress(redis.RedisError):
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        return False

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        self.popen = None

    def restart(self) -> None:
        self.stop()
        time.sleep(1)  # the outage: a second with no broker at all
        self.start()


class PrivatePostgres:
    """A Postgres cluster of this run alone: ``initdb`` into a temporary directory, served on
    a free loopback port with its socket in that directory; never the machine's cluster."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / "pg"
        self.log_path = workdir / "postgres.log"
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not found and shutil.which("pg_ctl") is None:
            raise SystemExit("no pg_ctl: install PostgreSQL's server binaries")
        self.bin = Path(found[-1]).parent if found else Path(shutil.which("pg_ctl") or "").parent
        # initdb and postgres refuse to run as root: as root, run them as the postgres user.
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            self.as_user = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/djflow_chaos"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        result = subprocess.run(
            [*self.as_user, *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {result.stdout}\n{result.stderr}")

    def init(self) -> None:
        self.dir.mkdir(parents=True)
        if self.as_user:
            owner = pwd.getpwnam("postgres")
            for path in (self.dir.parent, self.dir):
                os.chown(path, owner.pw_uid, owner.pw_gid)
            self.log_path.touch()
            os.chown(self.log_path, owner.pw_uid, owner.pw_gid)
        self._run(
            str(self.bin / "initdb"),
            *("-D", str(self.dir), "-U", "postgres", "-A", "trust", "--no-sync"),
        )

    def _options(self) -> str:
        # fsync off: an operating-system crash is not what this run is about, and the
        # machine's disk is shared. A restart (fast or immediate) keeps what was committed
        # either way: the WAL is in the kernel's page cache.
        return f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"

    def start(self) -> None:
        self._run(
            str(self.bin / "pg_ctl"),
            *("-D", str(self.dir), "-l", str(self.log_path), "-o", self._options(), "-w"),
            "start",
        )

    def restart(self, mode: str) -> None:
        self._run(
            str(self.bin / "pg_ctl"),
            *("-D", str(self.dir), "-l", str(self.log_path), "-o", self._options()),
            *("-m", mode, "-w", "restart"),
        )

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir), "-m", "immediate", "stop")


# --- the processes ------------------------------------------------------------------------


class Fleet:
    """The workers, beats and API server, each restartable."""

    def __init__(self, workdir: Path, env: dict[str, str], workers: int, beats: int) -> None:
        self.workdir = workdir
        self.env = env
        self.workers = [self._worker(n) for n in range(workers)]
        self.beats = [
            beat_process(env=env, workdir=workdir, name=f"chaos-beat{n + 1}") for n in range(beats)
        ]
        self.api_port = free_port()
        self.api: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()

    def _worker(self, n: int) -> CeleryProcess:
        return worker_process(
            env=self.env,
            workdir=self.workdir,
            name=f"chaos-w{n + 1}",
            concurrency=2,
            loglevel="warning",
        )

    def start(self) -> None:
        for process in [*self.workers, *self.beats]:
            process.start()
        for process in self.beats:
            process.wait_ready(timeout=60)
        with (self.workdir / "api.log").open("ab") as out:
            self.api = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gunicorn", "config.wsgi:application"),
                    *("-b", f"127.0.0.1:{self.api_port}", "-w", "2", "--timeout", "60"),
                ],
                cwd=BASE_DIR,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def replace_worker(self, index: int) -> None:
        """SIGKILL the worker's whole group (main process and pool) and start a new one with
        the same node name, as a supervisor would after a machine's worker died."""
        with self.lock:
            old = self.workers[index]
            old.kill(signal.SIGKILL)
            fresh = self._worker(index)
            fresh.log_path = old.log_path
            self.workers[index] = fresh.start()

    def revive_dead(self) -> list[str]:
        """Start again any process that exited by itself (a supervisor's job); names them."""
        revived = []
        with self.lock:
            for group in (self.workers, self.beats):
                for index, process in enumerate(group):
                    if process.popen is not None and process.popen.poll() is not None:
                        revived.append(f"{process.kind} {process.hostname} ({process.returncode})")
                        fresh = (
                            self._worker(index)
                            if process.kind == "worker"
                            else beat_process(
                                env=self.env, workdir=self.workdir, name=process.hostname
                            )
                        )
                        fresh.log_path = process.log_path
                        group[index] = fresh.start()
        return revived

    def stop(self) -> None:
        with self.lock:
            for process in [*self.beats, *self.workers]:
                if process.popen is not None and process.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
            if self.api is not None and self.api.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.api.pid, signal.SIGKILL)
                self.api.wait(timeout=10)
            for process in [*self.beats, *self.workers]:
                if process.popen is not None:
                    with contextlib.suppress(Exception):
                        process.popen.wait(timeout=10)
                    for pid in process.group_pids():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)


# --- the monkey ---------------------------------------------------------------------------


@dataclass
class Tally:
    kills: int = 0
    kills_mid_step: int = 0
    redis_restarts: int = 0
    postgres_restarts: int = 0
    self_exits: list[str] = field(default_factory=list)
    api_retries: int = 0
    starts_refused: int = 0


class Monkey(threading.Thread):
    """Kills a random worker every ``kill_every`` seconds (a uniform draw) and restarts
    Redis and Postgres at the moments of ``outages`` (seconds from the start, ordered)."""

    def __init__(
        self,
        fleet: Fleet,
        redis_server: PrivateRedis,
        postgres: PrivatePostgres,
        tally: Tally,
        *,
        kill_every: tuple[float, float],
        outages: list[tuple[float, str]],
        seed: int,
    ) -> None:
        super().__init__(name="monkey", daemon=True)
        self.fleet = fleet
        self.redis = redis_server
        self.postgres = postgres
        self.tally = tally
        self.kill_every = kill_every
        self.outages = list(outages)
        self.random = random.Random(seed)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.t0 = time.monotonic()

    def pending_outages(self) -> int:
        return len(self.outages)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            from django.db import connection

            connection.close()

    def _run(self) -> None:
        next_kill = time.monotonic() + self.random.uniform(*self.kill_every)
        while not self.stopping.is_set():
            now = time.monotonic()
            if self.outages and now - self.t0 >= self.outages[0][0]:
                _, what = self.outages.pop(0)
                self._outage(what)
            if now >= next_kill:
                index, busy = self._victim()
                self.tally.kills_mid_step += busy
                log(
                    f"monkey: SIGKILL worker {index + 1} (kill {self.tally.kills + 1},"
                    f" {'running a step' if busy else 'idle'})"
                )
                self.fleet.replace_worker(index)
                self.tally.kills += 1
                next_kill = time.monotonic() + self.random.uniform(*self.kill_every)
            for name in self.fleet.revive_dead():
                log(f"monkey: {name} exited by itself; started again")
                self.tally.self_exits.append(name)
            self.stopping.wait(0.2)

    def _victim(self) -> tuple[int, bool]:
        """A random worker among those running an attempt now, else any: a kill that lands
        mid-step is the one that tests something, and with a few steps a second most draws
        among all three would hit an idle worker. True when it is running one."""
        from django.db import DatabaseError, connection

        from runs.models import StepRun

        names = [worker.hostname or "" for worker in self.fleet.workers]
        try:
            running = set(
                StepRun.objects.filter(status="running").values_list("worker", flat=True)[:100]
            )
        except DatabaseError:  # Postgres is restarting: any worker will do
            connection.close()
            running = set()
        busy = [i for i, name in enumerate(names) if any(w.startswith(f"{name}:") for w in running)]
        if busy:
            return self.random.choice(busy), True
        return self.random.randrange(len(names)), False

    def _outage(self, what: str) -> None:
        if what == "redis":
            log(f"monkey: restarting Redis (restart {self.tally.redis_restarts + 1})")
            self.redis.restart()
            self.tally.redis_restarts += 1
        else:
            mode = "fast" if self.tally.postgres_restarts % 2 == 0 else "immediate"
            log(f"monkey: restarting Postgres -m {mode} ({self.tally.postgres_restarts + 1})")
            self.postgres.restart(mode)
            self.tally.postgres_restarts += 1
        log(f"monkey: {what} is back")


def outage_plan(start_phase: float, redis_restarts: int, postgres_restarts: int) -> list:
    """Redis and Postgres restarts spread evenly over the start phase, alternating."""
    order: list[str] = []
    for index in range(max(redis_restarts, postgres_restarts)):
        order += ["redis"] if index < redis_restarts else []
        order += ["postgres"] if index < postgres_restarts else []
    return [(start_phase * (i + 1) / (len(order) + 1), kind) for i, kind in enumerate(order)]


# --- the driver ---------------------------------------------------------------------------


@dataclass
class Planned:
    n: int
    workflow: str
    input: dict[str, Any]
    run_id: str | None = None
    event_at: float | None = None
    event_sent: bool = False


class Api:
    """The REST API over real HTTP, retrying what an outage refuses: connection errors, 5xx
    while Postgres restarts, 503. Starts carry an idempotency key, so a retried start whose
    first answer was lost returns the same run."""

    def __init__(self, base: str, token: str, tally: Tally) -> None:
        self.base = base
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Token {token}"
        self.tally = tally

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response | None:
        """One attempt: the response, or None when the service did not answer usefully."""
        try:
            response = self.session.request(method, self.base + path, timeout=15, **kwargs)
        except requests.RequestException:
            self.tally.api_retries += 1
            return None
        if response.status_code >= 500:
            self.tally.api_retries += 1
            return None
        return response


class Driver:
    def __init__(self, api: Api, plan: list[Planned], rate: float, seed: int) -> None:
        self.api = api
        self.plan = plan
        self.rate = rate
        self.random = random.Random(seed)
        self.by_run: dict[str, Planned] = {}
        self.decided: set[str] = set()
        self.t0 = time.monotonic()

    def started(self) -> int:
        return sum(1 for p in self.plan if p.run_id is not None)

    def step(self) -> None:
        """One round: start the runs now due, send the events now due, decide approvals."""
        due = int((time.monotonic() - self.t0) * self.rate) + 1
        for planned in self.plan[:due]:
            if planned.run_id is None and not self._start(planned):
                break  # the API is down: try again next round, in order
        now = time.monotonic()
        for planned in self.plan[:due]:
            if (
                planned.event_at is not None
                and not planned.event_sent
                and planned.run_id is not None
                and now >= planned.event_at
            ):
                self._send_event(planned)
        self._decide()

    def _start(self, planned: Planned) -> bool:
        response = self.api.call(
            "POST",
            "/api/v1/runs",
            json={
                "workflow": planned.workflow,
                "input": planned.input,
                "idempotency_key": f"chaos-{planned.n}",
            },
        )
        if response is None:
            return False
        if response.status_code == 400 and "no live worker" in response.text:
            # The start check found no worker's heartbeat fresh enough (they pause while
            # Postgres is away): a refusal the engine reports, to be tried again.
            self.api.tally.starts_refused += 1
            return False
        if response.status_code not in (200, 201):
            raise RuntimeError(f"starting run {planned.n}: {response.status_code} {response.text}")
        planned.run_id = response.json()["id"]
        self.by_run[planned.run_id] = planned
        if planned.workflow == "chaos_event":
            # Some events arrive before the run waits (kept until it does), most after.
            planned.event_at = time.monotonic() + self.random.uniform(0.0, 5.0)
        return True

    def _send_event(self, planned: Planned) -> None:
        response = self.api.call(
            "POST",
            "/api/v1/events",
            json={
                "name": flows.EVENT,
                "key": planned.input["key"],
                "payload": {"value": flows.event_value(planned.n)},
            },
        )
        if response is None:
            return
        if response.status_code not in (200, 201, 202):
            raise RuntimeError(f"event of run {planned.n}: {response.status_code} {response.text}")
        # A send whose answer was lost may be sent again: the second event stays unconsumed.
        planned.event_sent = True

    def _decide(self) -> None:
        response = self.api.call("GET", "/api/v1/approvals", params={"status": "pending"})
        if response is None or response.status_code != 200:
            return
        for approval in response.json()["results"]:
            if approval["id"] in self.decided:
                continue
            planned = self.by_run.get(str(approval["run"]))
            if planned is None:
                continue
            verb = "reject" if flows.rejected(planned.n) else "approve"
            answer = self.api.call(
                "POST",
                f"/api/v1/approvals/{approval['id']}/{verb}",
                json={"comment": f"chaos {planned.n}"},
            )
            if answer is None:
                continue
            if answer.status_code in (200, 201, 409):
                # 409: decided already (the first answer was lost on the way back).
                self.decided.add(approval["id"])
            else:
                raise RuntimeError(f"deciding {approval['id']}: {answer.status_code} {answer.text}")


# --- database side ----------------------------------------------------------------------


def configure_django(database_url: str, redis_server: PrivateRedis, env: dict[str, str]) -> None:
    import django

    os.environ.update(
        DATABASE_URL=database_url,
        CELERY_BROKER_URL=redis_server.url(0),
        CELERY_RESULT_BACKEND=redis_server.url(1),
        DJANGO_SETTINGS_MODULE="config.settings",
        SECRET_KEY=env["SECRET_KEY"],
    )
    os.environ.pop("SENTRY_DSN", None)
    django.setup()


def prepare_database(database_url: str) -> str:
    """Create and migrate the database, install the timer trigger, save the workflows and
    make the script's user; returns its API token."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from rest_framework.authtoken.models import Token

    from bench.common import create_database
    from workflows.sync import sync_modules

    create_database(database_url)
    call_command("migrate", interactive=False, verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {TIMER_FIRES_TABLE} ("
            " id bigserial PRIMARY KEY, timer_id bigint NOT NULL, run_id uuid NOT NULL,"
            " key text NOT NULL, purpose text NOT NULL, fired_at timestamptz NOT NULL)"
        )
        cursor.execute(
            "CREATE OR REPLACE FUNCTION chaos_timer_fired() RETURNS trigger AS $$ BEGIN"
            f" INSERT INTO {TIMER_FIRES_TABLE} (timer_id, run_id, key, purpose, fired_at)"
            " VALUES (NEW.id, NEW.run_id, NEW.key, NEW.purpose, NEW.fired_at);"
            " RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            "CREATE TRIGGER chaos_timer_fired AFTER UPDATE OF fired_at ON runs_timer"
            " FOR EACH ROW WHEN (OLD.fired_at IS NULL AND NEW.fired_at IS NOT NULL)"
            " EXECUTE FUNCTION chaos_timer_fired()"
        )
    user = get_user_model().objects.create_superuser(
        username=flows.APPROVER, email="chaos@example.com", password=secrets.token_urlsafe(20)
    )
    sync_modules([FLOWS_MODULE], user=user)
    return Token.objects.get_or_create(user=user)[0].key


def resilient(read: Callable[[], Any]) -> Any:
    """A read from the script's own connection, through Postgres restarts."""
    from django.db import InterfaceError, OperationalError, connection

    for pause in (0.5, 1, 2, 4, 8, 8, 8):
        try:
            return read()
        except (OperationalError, InterfaceError):
            connection.close()
            time.sleep(pause)
    return read()


def status_counts(run_ids: list[str]) -> collections.Counter[str]:
    from runs.models import Run

    return collections.Counter(
        resilient(lambda: list(Run.objects.filter(id__in=run_ids).values_list("status", flat=True)))
    )


def read_effects(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Verdict:
    completed: int = 0
    failed_as_expected: int = 0
    given_up: int = 0
    lost: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    timers_fired_twice: list[str] = field(default_factory=list)
    timers_fired: int = 0
    at_least_once_reruns: int = 0


def check(plan: list[Planned], effects_path: Path) -> Verdict:
    """Every run against what its input says it must end with; the effects file and the
    timer side table against doing anything twice."""
    from django.db import connection

    from runs.models import Run, StepRun

    verdict = Verdict()
    effects = read_effects(effects_path)
    lines_by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in effects:
        lines_by_key[line["key"]].append(line)
    for key, lines in lines_by_key.items():
        if lines[0]["effect"] == "at_most_once" and len(lines) > 1:
            verdict.duplicated.append(f"{key}: ran {len(lines)} times")
        elif lines[0]["effect"] == "at_least_once" and len(lines) > 1:
            verdict.at_least_once_reruns += len(lines) - 1

    ids = [p.run_id for p in plan if p.run_id]
    runs = {str(r.id): r for r in Run.objects.filter(id__in=ids)}
    steps: dict[str, list[StepRun]] = collections.defaultdict(list)
    for step in StepRun.objects.filter(run_id__in=ids).order_by("id"):
        steps[str(step.run_id)].append(step)

    for planned in plan:
        label = f"run {planned.n} ({planned.workflow}, {planned.run_id})"
        if planned.run_id is None:
            verdict.stuck.append(f"{label}: never started (the API did not accept it)")
            continue
        run = runs.get(planned.run_id)
        if run is None:
            verdict.lost.append(f"{label}: acknowledged by the API, missing from the database")
            continue
        if run.status not in TERMINAL:
            verdict.stuck.append(f"{label}: {run.status}")
            continue
        status, output = flows.expected(planned.workflow, planned.n)
        journal = steps[planned.run_id]
        for sleep in ("nap", "settle"):
            attempts = [s for s in journal if s.step_id == sleep]
            if len(attempts) > 1:
                verdict.timers_fired_twice.append(f"{label}: {len(attempts)} attempts of {sleep}")
        if status == "completed" and run.status == "completed" and run.output == output:
            missing = [
                s.idempotency_key
                for s in journal
                if s.effect == "at_most_once"
                and s.status == "succeeded"
                and len(lines_by_key.get(s.idempotency_key, [])) != 1
            ]
            if missing:
                verdict.lost.append(f"{label}: at_most_once output without one body: {missing}")
            else:
                verdict.completed += 1
            continue
        error_class = (run.error or {}).get("class")
        if status == "failed" and run.status == "failed" and error_class == output:
            verdict.failed_as_expected += 1
            continue
        if run.status == "failed" and error_class in GIVEN_UP and _gave_up_once(journal, run):
            verdict.given_up += 1
            continue
        verdict.lost.append(
            f"{label}: ended {run.status} {run.output!r} {run.error!r};"
            f" expected {status} {output!r}"
        )

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {TIMER_FIRES_TABLE}")
        verdict.timers_fired = cursor.fetchone()[0]
        cursor.execute(
            f"SELECT run_id, key, count(*) FROM {TIMER_FIRES_TABLE}"
            " GROUP BY run_id, key HAVING count(*) > 1"
        )
        for run_id, key, count in cursor.fetchall():
            verdict.timers_fired_twice.append(f"timer {key} of run {run_id}: claimed {count} times")
    return verdict


def _gave_up_once(journal: list[Any], run: Any) -> bool:
    """The run failed because a worker was lost under an at_most_once attempt, which the
    engine then refused to run again: the step is at_most_once and was tried once. The
    parallel (or foreach) holding it fails with its class too: that row is not an attempt,
    and is not asked to be at_most_once."""
    from runs.engine.plan import HOLDERS
    from workflows import kinds

    holders = kinds.names(*HOLDERS)
    failed = [
        s
        for s in journal
        if s.kind not in holders
        and s.status == "failed"
        and (s.error or {}).get("class") in GIVEN_UP
    ]
    return bool(failed) and all(
        s.effect == "at_most_once" and sum(1 for t in journal if t.step_id == s.step_id) == 1
        for s in failed
    )


# --- main ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=4.0, help="runs started a second")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--beats", type=int, default=2)
    parser.add_argument("--kill-min", type=float, default=5.0)
    parser.add_argument("--kill-max", type=float, default=20.0)
    parser.add_argument(
        "--min-kills", type=int, default=0, help="keep the monkey at work until it killed this many"
    )
    parser.add_argument("--redis-restarts", type=int, default=2)
    parser.add_argument("--postgres-restarts", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds until what is left is stuck"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    return parser.parse_args(argv)


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="djflow-chaos-"))
    try:
        yield path
    finally:
        if keep:
            log(f"logs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    log(f"chaos: {args.runs} runs, seed {seed}")
    with workdir(args.keep) as work:
        redis_server = PrivateRedis(work)
        postgres = PrivatePostgres(work)
        fleet: Fleet | None = None
        try:
            redis_server.start()
            postgres.init()
            postgres.start()
            env = service_env(
                database_url=postgres.url,
                broker_url=redis_server.url(0),
                result_backend=redis_server.url(1),
                workflow_modules=[FLOWS_MODULE],
                extra={
                    **KNOBS,
                    "SECRET_KEY": secrets.token_urlsafe(50),
                    "DJFLOW_CHAOS_EFFECTS": str(work / "effects.jsonl"),
                },
            )
            configure_django(postgres.url, redis_server, env)
            token = prepare_database(postgres.url)
            fleet = Fleet(work, env, args.workers, args.beats)
            fleet.start()
            return drive(args, rng, work, fleet, redis_server, postgres, token)
        finally:
            if fleet is not None:
                fleet.stop()
            redis_server.stop()
            postgres.stop()


def drive(
    args: argparse.Namespace,
    rng: random.Random,
    work: Path,
    fleet: Fleet,
    redis_server: PrivateRedis,
    postgres: PrivatePostgres,
    token: str,
) -> int:
    tally = Tally()
    api = Api(f"http://127.0.0.1:{fleet.api_port}", token, tally)
    wait_for(
        lambda: (r := api.call("GET", "/api/v1/definitions")) is not None and r.status_code == 200,
        timeout=60,
        message=lambda: (work / "api.log").read_text()[-3000:],
    )
    # The start check refuses runs until a live worker serves the handlers.
    wait_for(
        lambda: all(w.ping(timeout=1) for w in fleet.workers),
        timeout=90,
        interval=1,
        message="the workers to answer",
    )
    plan = []
    for n in range(args.runs):
        workflow = flows.WORKFLOWS[n % len(flows.WORKFLOWS)]
        plan.append(Planned(n, workflow, flows.make_input(workflow, n)))
    start_phase = args.runs / args.rate
    monkey = Monkey(
        fleet,
        redis_server,
        postgres,
        tally,
        kill_every=(args.kill_min, args.kill_max),
        outages=outage_plan(start_phase, args.redis_restarts, args.postgres_restarts),
        seed=rng.randrange(1 << 30),
    )
    driver = Driver(api, plan, args.rate, rng.randrange(1 << 30))
    t0 = time.monotonic()
    monkey.start()
    deadline = t0 + args.timeout
    last_report = 0.0
    try:
        while time.monotonic() < deadline:
            if monkey.error is not None:
                raise monkey.error
            driver.step()
            counts = status_counts([p.run_id for p in plan if p.run_id])
            ended = sum(counts[s] for s in TERMINAL)
            if time.monotonic() - last_report > 10:
                log(
                    f"started {driver.started()}/{len(plan)}, ended {ended}, "
                    f"{dict(counts)}, kills {tally.kills}"
                )
                last_report = time.monotonic()
            if (
                driver.started() == len(plan)
                and ended == len(plan)
                and monkey.pending_outages() == 0
                and tally.kills >= args.min_kills
            ):
                break
            time.sleep(0.5)
    finally:
        monkey.stopping.set()
        monkey.join(timeout=60)
    elapsed = time.monotonic() - t0
    verdict = resilient(lambda: check(plan, work / "effects.jsonl"))
    return report(args, tally, verdict, elapsed, len(plan))


def report(
    args: argparse.Namespace, tally: Tally, verdict: Verdict, elapsed: float, runs: int
) -> int:
    figures = {
        "runs": runs,
        "kills": tally.kills,
        "kills of a worker running a step": tally.kills_mid_step,
        "redis restarts": tally.redis_restarts,
        "postgres restarts": tally.postgres_restarts,
        "time (s)": round(elapsed, 1),
        "completed as expected": verdict.completed,
        "failed as expected (rejected)": verdict.failed_as_expected,
        "given up (at_most_once in doubt under a lost worker)": verdict.given_up,
        "lost": len(verdict.lost),
        "stuck": len(verdict.stuck),
        "duplicated": len(verdict.duplicated),
        "timers fired twice": len(verdict.timers_fired_twice),
        "timers fired": verdict.timers_fired,
        "at_least_once bodies run again": verdict.at_least_once_reruns,
        "API calls retried": tally.api_retries,
        "starts refused for want of a live worker": tally.starts_refused,
        "processes that exited by themselves": len(tally.self_exits),
    }
    width = max(map(len, figures))
    print()
    for name, value in figures.items():
        print(f"{name:<{width}}  {value}")
    for title, items in (
        ("lost", verdict.lost),
        ("stuck", verdict.stuck),
        ("duplicated", verdict.duplicated),
        ("timers fired twice", verdict.timers_fired_twice),
        ("exited by themselves", tally.self_exits),
    ):
        for item in items[:20]:
            print(f"{title}: {item}")
    print(json.dumps({"chaos": figures}))
    bad = verdict.lost or verdict.stuck or verdict.duplicated or verdict.timers_fired_twice
    if (
        tally.redis_restarts < args.redis_restarts
        or tally.postgres_restarts < args.postgres_restarts
    ):
        print("the planned restarts did not all happen before the time-out")
        return 1
    if tally.kills < args.min_kills:
        print(f"only {tally.kills} kills, {args.min_kills} asked")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
