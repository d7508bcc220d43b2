"""Real ``celery worker`` and ``celery beat`` processes for end-to-end and crash tests.

Nothing here imports pytest: the benchmarks in ``bench/`` start their worker with the same
code. The pytest side (fixtures that point the processes at the test database and stop them
at teardown) lives in ``tests/conftest.py``.

Each process runs in a session (and so a process group) of its own, so one ``killpg`` takes
the main process and its pool children together, as ``kill -9`` of a machine's worker would,
and nothing the test does with signals reaches them by accident.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent
CELERY = [sys.executable, "-m", "celery", "-A", "config"]
BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Variables of this process a child must not inherit: the services are set explicitly, and
# a test process must never report to a real Sentry.
_DROPPED_ENV = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SENTRY_DSN")
_names = itertools.count(1)

T = TypeVar("T")


class ProcessError(RuntimeError):
    """A process did not start, or died before it was ready; the message carries its log."""


class WaitTimeout(AssertionError):
    """``wait_for`` gave up. An ``AssertionError`` so pytest reports it as a failed check."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    ``message`` may be a callable (``worker.logs``, say): it is evaluated only on time-out, so
    a failing test shows the state of the world when it gave up.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise WaitTimeout(
                f"timed out after {timeout:g}s waiting for {text} (last value: {value!r})"
            )
        time.sleep(interval)


# --- Environment ---------------------------------------------------------------------------


def database_url(settings_dict: Mapping[str, Any]) -> str:
    """A ``DATABASE_URL`` that django-environ turns back into ``settings_dict``'s database.

    Pass ``django.db.connection.settings_dict`` inside a test: its NAME is then the test
    database pytest-django created, not the configured one.
    """
    engine = settings_dict["ENGINE"]
    name = str(settings_dict["NAME"])
    if engine.endswith("sqlite3"):
        return f"sqlite:///{name}"
    if not engine.endswith(("postgresql", "postgis")):
        raise ValueError(f"no DATABASE_URL for engine {engine!r}")
    user = quote(settings_dict.get("USER") or "", safe="")
    password = quote(settings_dict.get("PASSWORD") or "", safe="")
    credentials = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    options = {
        k: v
        for k, v in (settings_dict.get("OPTIONS") or {}).items()
        # prepare_threshold is psycopg's, not libpq's (pg_dump refuses it): the settings
        # of the process given the URL set it themselves.
        if isinstance(v, str | int) and not isinstance(v, bool) and k != "prepare_threshold"
    }
    query = f"?{urlencode(options)}" if options else ""
    return f"postgres://{credentials}{host}{port}/{quote(name, safe='')}{query}"


def xdist_services(worker: str | None) -> None:
    """Point this test process at Redis databases of its own when it is pytest-xdist's
    ``gwN`` for N > 0: broker and results move up by 2 * N (gw0 keeps the configured ones).
    Other brokers (RabbitMQ) are left as configured: .ci/run's RabbitMQ stage runs the
    worker tests in one process (``-n 0``)."""
    from django.conf import settings

    from config.celery import app

    if not worker or not worker.startswith("gw") or worker == "gw0":
        return
    shift = 2 * int(worker[2:])
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        url = getattr(settings, name)
        moved = _shifted_redis_db(url, shift)
        if moved != url:
            setattr(settings, name, moved)
            # Celery's broker_url and result_backend read these variables before its
            # configuration.
            os.environ[name] = moved
    app.conf.broker_url = settings.CELERY_BROKER_URL
    app.conf.result_backend = settings.CELERY_RESULT_BACKEND
    # The per-account model slots default to the broker's Redis: move them with it.
    slots = settings.DJFLOW.get("MODEL_SLOTS_REDIS_URL") or ""
    settings.DJFLOW = {**settings.DJFLOW, "MODEL_SLOTS_REDIS_URL": _shifted_redis_db(slots, shift)}


# The Redis a test reaches when the suite's broker is not Redis (the embedded default).
FALLBACK_REDIS_URL = "redis://127.0.0.1:6379/0"


def own_redis_url(shift: int = 0) -> str:
    """A Redis database of this test process: the configured broker's (CELERY_BROKER_URL, as
    :func:`xdist_services` left it), ``shift`` databases on. Tests named databases 8, 3 and 4
    of 127.0.0.1:6379 whatever the environment said, so a suite given a Redis of its own
    still wrote to the machine's shared one, and two xdist workers met in it (issue 37)."""
    from django.conf import settings

    url = settings.CELERY_BROKER_URL
    if urlsplit(url).scheme not in ("redis", "rediss"):
        url = FALLBACK_REDIS_URL
    return _shifted_redis_db(url, shift)


def _shifted_redis_db(url: str, shift: int) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return url
    db = int(parts.path.strip("/") or 0) + shift
    return urlunsplit(parts._replace(path=f"/{db}"))


def service_env(
    *,
    database_url: str,
    broker_url: str,
    result_backend: str,
    workflow_modules: Iterable[str] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a child process: this one's, with the services set explicitly.

    The repository root is put on ``PYTHONPATH`` so ``--include tests.<module>`` and
    ``bench.<module>`` import in the child.
    """
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    path = [str(BASE_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        DATABASE_URL=database_url,
        CELERY_BROKER_URL=broker_url,
        CELERY_RESULT_BACKEND=result_backend,
        DJANGO_SETTINGS_MODULE="config.settings",
        WORKFLOW_MODULES=",".join(workflow_modules),
        PYTHONPATH=os.pathsep.join(dict.fromkeys(path)),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


# --- /proc ---------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for its reaper counts as gone."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def children_of(pid: int) -> list[int]:
    """Live direct children of ``pid``."""
    found = []
    for candidate in _all_pids():
        stat = _stat(candidate)
        if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
            found.append(candidate)
    return sorted(found)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded)."""
    found = []
    for candidate in _all_pids():
        stat = _stat(candidate)
        if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
            found.append(candidate)
    return sorted(found)


# --- Processes -----------------------------------------------------------------------------


class CeleryProcess:
    """One ``celery worker`` or ``celery beat`` subprocess, its own process-group leader.

    Output (stdout and stderr) goes to ``log_path``; ``logs()`` reads it back.
    """

    def __init__(
        self,
        *,
        kind: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        hostname: str | None = None,
        ready_marker: str | None = None,
        cwd: Path = BASE_DIR,
    ) -> None:
        self.kind = kind
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.hostname = hostname
        self.ready_marker = ready_marker
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "not started" if self.popen is None else f"pid {self.pid}"
        return f"<CeleryProcess {self.kind} {self.hostname or ''} {state}>"

    # lifecycle -------------------------------------------------------------------------

    def start(self) -> CeleryProcess:
        if self.popen is not None:
            raise ProcessError(f"{self!r} was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = 30.0) -> CeleryProcess:
        """Wait until the process serves: its ready line is logged, then (a worker) it
        answers a ping by its node name. Raises ``ProcessError`` with the log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessError(
                    f"{self.kind} exited with code {self.returncode} before it was ready:\n"
                    f"{self.logs()}"
                )
            if self.ready_marker is not None and self.ready_marker not in self.logs():
                time.sleep(0.05)
                continue
            if self.kind != "worker" or self.ping(timeout=0.5):
                return self
        raise ProcessError(f"{self.kind} was not ready within {timeout:g}s:\n{self.logs()}")

    def ping(self, timeout: float = 0.5) -> bool:
        """True when this worker answers a broadcast ping within ``timeout`` seconds."""
        from config.celery import app

        replies = app.control.ping(destination=[self.hostname], timeout=timeout)
        return any(self.hostname in reply for reply in replies)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (a worker's warm shutdown), wait, then SIGKILL the whole group.

        Returns the main process's exit code (negative: killed by that signal).
        """
        self.terminate()
        return self.wait_stopped(timeout)

    def terminate(self) -> None:
        """Send SIGTERM to the main process only; ``wait_stopped`` finishes the stop."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float) -> int | None:
        if self.popen is None:
            return None
        try:
            self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
        # Pool children outliving their parent would keep database connections open.
        self._kill_leftovers()
        return self.popen.returncode

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
        """Send ``sig`` to the whole process group: the main process and its pool children.

        With SIGKILL, waits until every one of them is gone (raises ``ProcessError`` if not)
        and returns their pids.
        """
        if self.popen is None:
            return []
        pids = self.group_pids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout)
            try:
                wait_for(
                    lambda: not any(pid_alive(p) for p in pids),
                    timeout=timeout,
                    message=f"{self.kind} group {pids} to die",
                )
            except WaitTimeout as exc:
                raise ProcessError(str(exc)) from None
        return pids

    def _kill_leftovers(self) -> None:
        if self.popen is not None and self.group_pids():
            self.kill(signal.SIGKILL)

    # inspection ------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise ProcessError(f"{self!r} was not started")
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def child_pids(self) -> list[int]:
        """The main process's live children: a prefork worker's pool processes."""
        return children_of(self.pid) if self.alive() else []

    def group_pids(self) -> list[int]:
        """Every live process of this process's group, the main one included."""
        return group_members(self.pid) if self.popen is not None else []

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def gunicorn_argv(port: int, workers: int = 2) -> list[str]:
    """gunicorn as deployed (``config.gunicorn``'s hooks) on a loopback ``port``."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        "python:config.gunicorn",
        "config.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
    ]


def worker_process(
    *,
    env: Mapping[str, str],
    workdir: Path,
    name: str | None = None,
    concurrency: int = 2,
    pool: str = "prefork",
    queues: Sequence[str] | None = None,
    include: Sequence[str] = (),
    loglevel: str = "info",
    extra_args: Sequence[str] = (),
) -> CeleryProcess:
    """A ``celery -A config worker`` (not started). ``queues=None`` consumes what the app's
    configuration declares (no ``-Q``); ``name`` is the node's name before the ``@``."""
    name = name or f"w{next(_names)}-{os.getpid()}"
    hostname = f"{name}@{socket.gethostname()}"
    argv = [
        *CELERY,
        "worker",
        "-n",
        hostname,
        "-c",
        str(concurrency),
        "-P",
        pool,
        "-l",
        loglevel,
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    if queues:
        argv += ["-Q", ",".join(queues)]
    if include:
        argv += ["-I", ",".join(include)]
    argv += list(extra_args)
    verbose = loglevel.lower() in ("debug", "info")
    return CeleryProcess(
        kind="worker",
        argv=argv,
        env=env,
        log_path=workdir / f"{name}.log",
        hostname=hostname,
        # "<hostname> ready." is logged at INFO once the consumer runs; quieter levels
        # fall back on pinging.
        ready_marker=f"{hostname} ready." if verbose else None,
    )


def beat_process(
    *,
    env: Mapping[str, str],
    workdir: Path,
    name: str | None = None,
    loglevel: str = "info",
    extra_args: Sequence[str] = (),
) -> CeleryProcess:
    """A ``celery -A config beat`` on django-celery-beat's DatabaseScheduler (not started).

    Its schedule and pid files live in ``workdir``, never in the checkout. It counts as ready
    when it logs "beat: Starting...", just before it loads the schedule from the database.
    """
    name = name or f"beat{next(_names)}-{os.getpid()}"
    argv = [
        *CELERY,
        "beat",
        "-l",
        loglevel,
        "--scheduler",
        BEAT_SCHEDULER,
        "-s",
        str(workdir / f"{name}-schedule"),
        "--pidfile",
        str(workdir / f"{name}.pid"),
        *extra_args,
    ]
    return CeleryProcess(
        kind="beat",
        argv=argv,
        env=env,
        log_path=workdir / f"{name}.log",
        hostname=name,
        ready_marker="beat: Starting..." if loglevel.lower() in ("debug", "info") else None,
    )


def stop_all(processes: Iterable[CeleryProcess], timeout: float = 10.0) -> None:
    """Stop several processes at once: SIGTERM to all, then one shared deadline."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.wait_stopped(deadline - time.monotonic())


class CeleryProcesses:
    """The worker and beat processes of one test, on its database and broker.

    Tests reach it through the ``celery_worker`` and ``celery_beat`` factories, or as the
    ``celery_processes`` fixture to start both kinds and read all their logs at once. The
    environment is read from Django when a process starts: the test database's real name is
    known only once pytest-django has set it up.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[CeleryProcess] = []

    def env(
        self, *, workflow_modules: Iterable[str] = (), env: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        from django.conf import settings
        from django.db import connection

        return service_env(
            # The test database pytest-django created, not the configured one.
            database_url=database_url(connection.settings_dict),
            broker_url=settings.CELERY_BROKER_URL,
            result_backend=settings.CELERY_RESULT_BACKEND,
            workflow_modules=workflow_modules,
            extra=env,
        )

    def worker(
        self,
        *,
        workflow_modules: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        queues: Sequence[str] | None = None,
        concurrency: int = 2,
        pool: str = "prefork",
        include: Sequence[str] = (),
        name: str | None = None,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        ready_timeout: float = 30.0,
    ) -> CeleryProcess:
        process = worker_process(
            env=self.env(workflow_modules=workflow_modules, env=env),
            workdir=self.workdir,
            name=name,
            concurrency=concurrency,
            pool=pool,
            queues=queues,
            include=include,
            extra_args=extra_args,
        )
        return self._start(process, wait, ready_timeout)

    def beat(
        self,
        *,
        workflow_modules: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        ready_timeout: float = 30.0,
    ) -> CeleryProcess:
        process = beat_process(
            env=self.env(workflow_modules=workflow_modules, env=env),
            workdir=self.workdir,
            name=name,
            extra_args=extra_args,
        )
        return self._start(process, wait, ready_timeout)

    def _start(self, process: CeleryProcess, wait: bool, ready_timeout: float) -> CeleryProcess:
        self.processes.append(process.start())
        if wait:
            process.wait_ready(ready_timeout)
        return process

    def logs(self, tail: int | None = None) -> str:
        """Every process's log under a header, the last ``tail`` lines of each if given."""
        parts = []
        for process in self.processes:
            lines = process.logs().splitlines()[-tail:] if tail else process.logs().splitlines()
            parts.append(f"----- {process.kind} {process.hostname} ({process.log_path}) -----")
            parts.extend(lines)
        return "\n".join(parts)

    def stop_all(self, timeout: float = 10.0) -> None:
        # Beat first, so it sends nothing to workers that are going away.
        stop_all([p for p in self.processes if p.kind == "beat"], timeout=timeout)
        stop_all([p for p in self.processes if p.kind != "beat"], timeout=timeout)

    def kill_all(self) -> None:
        """The end of a test: SIGKILL every process group still running, at once. A warm
        shutdown takes 1.5 to 5 s a worker (the pool's children are joined) and proves
        nothing here: tests about stopping stop their processes themselves. What a killed
        worker leaves (unacknowledged messages, heartbeat rows) the next test's set-up
        purges and flushes."""
        for process in self.processes:
            if process.popen is not None and process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process._kill_leftovers()


# --- Broker --------------------------------------------------------------------------------


def purge_broker(app: Any = None) -> int:
    """Drop every message waiting in the broker the app points at; returns how many.

    Celery's own purge only empties the queues this process knows of; the engine routes steps
    to queues named in documents, so on Redis every queue that was ever bound is found from
    kombu's binding sets. Unacknowledged messages of killed workers are dropped too: a test
    lowering the visibility timeout would otherwise see them redelivered.
    """
    if app is None:
        from config.celery import app
    names = set(app.amqp.queues) | {app.conf.task_default_queue}
    purged = 0
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        if conn.transport.driver_type == "redis":
            client = channel.client
            prefix = channel.keyprefix_queue.replace("%s", "")
            for key in client.scan_iter(match=f"{prefix}*"):
                for member in client.smembers(key):
                    text = member.decode() if isinstance(member, bytes) else member
                    names.add(text.split(channel.sep)[-1])
            client.delete(channel.unacked_key, channel.unacked_index_key, channel.unacked_mutex_key)
        for name in sorted(n for n in names if n):
            try:
                purged += channel.queue_purge(name) or 0
            except conn.channel_errors:
                # AMQP: a queue never declared is 404, which closes the channel; there is
                # nothing in it to drop.
                channel = conn.channel()
    return purged


def queued_on_redis(client: Any, queue: str) -> int:
    """The messages waiting on a Redis ``queue``, every priority's list counted: kombu's
    Redis transport keeps one list per priority step, the queue's own name for step 0 and
    ``<queue>\\x06\\x16<step>`` for the others (``Channel._q_for_pri``), and the engine sends
    at a run's priority (CELERY_TASK_DEFAULT_PRIORITY 4 on Redis), so ``LLEN queue`` alone
    sees none of them."""
    from kombu.transport.redis import Channel

    keys = [queue, *(f"{queue}{Channel.sep}{step}" for step in range(1, 10))]
    return sum(client.llen(key) for key in keys)
