"""``python -m bench.standalone``: the embedded default's runs per second, broker beside broker.

Each measurement starts ``manage.py standalone`` (web, worker, beat) on a fresh temporary
``DJFLOW_VAR_DIR`` with ``DATABASE_URL`` and every ``CELERY_*`` variable unset (SQLite, and
the broker under test), on a free port; creates a user and its API token with ``manage.py``;
starts one example run and waits for it (the warm-up: the worker's first heartbeat, imports,
SQLite's first pages); then starts ``--runs`` runs of ``support_ticket`` (input
``{"ticket": "Q: where is my invoice?"}``, which completes in three steps with no wait) through
the API from ``--clients`` threads, each with its own HTTP session, and reads the database
until every run is terminal. runs/s = runs / (seconds from the first request until the last
run was seen terminal); the database is read every 0.1 s, the client never waits on a run.

Candidates (``--brokers``, comma-separated, run back to back ``--repeat`` times, interleaved):

- ``filesystem``: the project's default, ``config.broker`` on ``filesystem://``;
- ``kombu-filesystem``: kombu's own file-system transport, the broker before issue 11;
- ``sqlalchemy``: kombu's SQLAlchemy transport on a SQLite file under the var dir;
- any URL (``redis://127.0.0.1:6379/8``): given to the standalone as ``CELERY_BROKER_URL``.

The non-default candidates are set by ``bench.standalone_settings``. A measurement counts as
crashed when a child of the standalone exited or was restarted, or its output holds an
``Unrecoverable error``; its figure is printed with the crash.

``running_standalone``, ``create_token``, ``start_runs`` and ``wait_until_terminal`` are what
``tests/test_standalone_soak.py`` drives the soak with.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests.test_standalone import RUN_TERMINAL, _children, _embedded_env, _free_port

BASE_DIR = Path(__file__).resolve().parent.parent
EXAMPLE = {"workflow": "support_ticket", "input": {"ticket": "Q: where is my invoice?"}}
NAMED_BROKERS = ("filesystem", "kombu-filesystem", "sqlalchemy")
# What the standalone prints when a child died (its supervisor's words), and Celery's words
# for a dead worker or a lost pool process.
CRASH_MARKERS = (
    "Unrecoverable error",
    "Restarted ",
    "restarting ",
    "exited with code",
    "was killed by",
    "WorkerLostError",
    "exited with 'signal",
)
USERNAME = "bench"
# A run started right after the web server answers may find no worker heartbeat yet: the
# start is refused (400) until the worker's first beat.
FIRST_START_SECONDS = 30.0


@dataclass
class Standalone:
    """A running ``manage.py standalone`` and where to reach it."""

    process: subprocess.Popen[bytes]
    base_url: str
    var_dir: Path
    log: Path
    env: dict[str, str]
    children: list[int] = field(default_factory=list)

    @property
    def database(self) -> Path:
        return self.var_dir / "db.sqlite3"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def crashes(self) -> list[str]:
        """Why this standalone counts as crashed: children gone or replaced, crash lines."""
        found = [
            line for line in self.output().splitlines() if any(m in line for m in CRASH_MARKERS)
        ]
        if self.process.poll() is not None:
            found.append(f"standalone exited with {self.process.returncode}")
        elif sorted(_children(self.process.pid)) != sorted(self.children):
            found.append(f"children {self.children} are now {_children(self.process.pid)}")
        return found

    def manage(self, *args: str, timeout: float = 60) -> str:
        """``manage.py <args>`` against this standalone's settings and database; its stdout."""
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=BASE_DIR,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stderr}")
        return done.stdout


def broker_env(broker: str) -> dict[str, str]:
    """The environment that selects ``broker`` (a candidate's name or a URL)."""
    if "://" in broker:
        return {"CELERY_BROKER_URL": broker}
    if broker not in NAMED_BROKERS:
        raise ValueError(f"unknown broker {broker!r}: one of {', '.join(NAMED_BROKERS)} or a URL")
    if broker == "filesystem":
        return {}
    return {"DJANGO_SETTINGS_MODULE": "bench.standalone_settings", "DJFLOW_BENCH_BROKER": broker}


@contextlib.contextmanager
def running_standalone(
    var_dir: Path,
    log: Path,
    *,
    broker: str = "filesystem",
    up_seconds: float = 90,
    env: Mapping[str, str] | None = None,
) -> Iterator[Standalone]:
    """Start ``manage.py standalone`` on the embedded default under ``var_dir`` (``env`` added
    to its environment); stop it after."""
    # The benchmark measures the engine, not the API's throttle: 4 clients start well over
    # its default 600 runs a minute (DJFLOW_API_THROTTLE_USER, kept when already set).
    unthrottled = {"DJFLOW_API_THROTTLE_USER": "1000000/min"}
    env = {**unthrottled, **_embedded_env(var_dir), **broker_env(broker), **(env or {})}
    port = _free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", f"--addr=127.0.0.1:{port}"],
            cwd=BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    standalone = Standalone(process, f"http://127.0.0.1:{port}", var_dir, log, env)
    try:
        _wait_until_up(standalone, up_seconds)
        standalone.children = _children(process.pid)
        yield standalone
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()  # its children die with it (PR_SET_PDEATHSIG)
                process.wait()


def _wait_until_up(standalone: Standalone, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if standalone.process.poll() is not None:
            raise RuntimeError(f"standalone exited at start:\n{standalone.output()}")
        if "djflow is up" in standalone.output():
            return
        time.sleep(0.2)
    raise RuntimeError(f"standalone not up within {seconds:g} s:\n{standalone.output()}")


def create_token(standalone: Standalone, username: str = USERNAME) -> str:
    """A superuser ``username`` and its API token, made with ``manage.py`` as a user would."""
    standalone.env["DJANGO_SUPERUSER_PASSWORD"] = "bench-password-not-secret"
    standalone.manage(
        "createsuperuser", "--noinput", f"--username={username}", f"--email={username}@example.com"
    )
    # "Generated token <key> for user <username>"
    return standalone.manage("drf_create_token", username).split()[2]


def start_first_run(base_url: str, token: str) -> str:
    """Start one example run, retrying while no live worker serves its handlers yet."""
    deadline = time.monotonic() + FIRST_START_SECONDS
    with requests.Session() as session:
        session.headers["Authorization"] = f"Token {token}"
        while True:
            response = session.post(f"{base_url}/api/v1/runs", json=EXAMPLE, timeout=30)
            if response.status_code == 201:
                return str(response.json()["id"])
            if (
                response.status_code != 400
                or "worker" not in response.text
                or time.monotonic() > deadline
            ):
                raise RuntimeError(
                    f"the first run was refused: {response.status_code} {response.text}"
                )
            time.sleep(0.5)


@dataclass
class Starts:
    """What the clients got back: the started runs' ids and every refused request."""

    ids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def start_runs(base_url: str, token: str, *, runs: int, clients: int) -> Starts:
    """Start ``runs`` example runs through the API from ``clients`` threads at once."""
    starts = Starts()
    lock = threading.Lock()

    def client(count: int) -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Token {token}"
            for _ in range(count):
                try:
                    response = session.post(f"{base_url}/api/v1/runs", json=EXAMPLE, timeout=60)
                except requests.RequestException as exc:
                    with lock:
                        starts.errors.append(repr(exc))
                    continue
                with lock:
                    if response.status_code == 201:
                        starts.ids.append(str(response.json()["id"]))
                    else:
                        starts.errors.append(f"{response.status_code} {response.text[:200]}")

    shares = [runs // clients + (1 if i < runs % clients else 0) for i in range(clients)]
    threads = [threading.Thread(target=client, args=(share,)) for share in shares]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    starts.seconds = time.monotonic() - began
    return starts


def run_statuses(database: Path) -> Counter[str]:
    """Every run's status, counted, read from the standalone's SQLite file."""
    with contextlib.closing(sqlite3.connect(database, timeout=20)) as db:
        return Counter(dict(db.execute("SELECT status, COUNT(*) FROM runs_run GROUP BY status")))


def wait_until_terminal(database: Path, *, total: int, seconds: float) -> Counter[str]:
    """Read the database until ``total`` runs exist and all are terminal, or ``seconds``
    pass; the last counts."""
    deadline = time.monotonic() + seconds
    while True:
        statuses = run_statuses(database)
        done = sum(n for status, n in statuses.items() if status in RUN_TERMINAL)
        if (done == sum(statuses.values()) >= total) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


@dataclass
class Measurement:
    broker: str
    runs: int
    seconds: float
    start_seconds: float
    statuses: Counter[str]
    refused: list[str]
    crashes: list[str]

    @property
    def runs_per_second(self) -> float:
        return self.runs / self.seconds


def measure(broker: str, *, runs: int, clients: int, budget: float) -> Measurement:
    """One standalone on ``broker``, warmed up, then ``runs`` runs from ``clients`` clients."""
    with tempfile.TemporaryDirectory(prefix="djflow-bench-standalone-") as tmp:
        var_dir = Path(tmp) / "var"
        with running_standalone(var_dir, Path(tmp) / "standalone.log", broker=broker) as one:
            token = create_token(one)
            start_first_run(one.base_url, token)
            wait_until_terminal(one.database, total=1, seconds=60)
            began = time.monotonic()
            starts = start_runs(one.base_url, token, runs=runs, clients=clients)
            statuses = wait_until_terminal(one.database, total=1 + len(starts.ids), seconds=budget)
            seconds = time.monotonic() - began
            crashes = one.crashes()
        return Measurement(
            broker, len(starts.ids), seconds, starts.seconds, statuses, starts.errors, crashes
        )


def _describe(m: Measurement) -> str:
    statuses = ", ".join(f"{n} {status}" for status, n in sorted(m.statuses.items()))
    line = (
        f"{m.broker:>18} | {m.runs_per_second:7.1f} runs/s | {m.runs} runs in {m.seconds:6.1f} s "
        f"(started in {m.start_seconds:.1f} s) | {statuses}"
    )
    if m.refused:
        line += f" | {len(m.refused)} refused, first: {m.refused[0]}"
    if m.crashes:
        line += f" | CRASHED: {m.crashes[:3]}"
    return line


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.standalone", description=__doc__)
    parser.add_argument("--brokers", default=",".join(NAMED_BROKERS))
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--budget", type=float, default=600, help="seconds the runs get to finish (default 600)"
    )
    args = parser.parse_args(argv)
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    for broker in brokers:
        broker_env(broker)  # an unknown name fails before anything starts
    results: dict[str, list[Measurement]] = {broker: [] for broker in brokers}
    for round_ in range(1, args.repeat + 1):
        for broker in brokers:
            result = measure(broker, runs=args.runs, clients=args.clients, budget=args.budget)
            results[broker].append(result)
            print(f"round {round_}: {_describe(result)}", flush=True)
    print(
        f"\n{args.runs} runs of support_ticket from {args.clients} clients, "
        f"median of {args.repeat}:"
    )
    print(f"{'broker':>18} | runs/s (median) | each | crashed")
    for broker, measured in results.items():
        rates = [m.runs_per_second for m in measured]
        crashed = sum(1 for m in measured if m.crashes or m.refused)
        each = ", ".join(f"{r:.1f}" for r in rates)
        print(
            f"{broker:>18} | {statistics.median(rates):15.1f} | {each} | {crashed}/{len(measured)}"
        )


if __name__ == "__main__":
    main()
