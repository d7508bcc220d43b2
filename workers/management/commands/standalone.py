"""``manage.py standalone``: the whole engine on one machine, in one command.

It checks that it can listen on ``--addr`` (``DJFLOW_ADDR``, else ``127.0.0.1:8000``),
migrates, makes sure a superuser exists, saves the documents of the workflow modules
(``WORKFLOW_MODULES``; when that is not set at all, the contract's ``support_ticket``
example), then starts and supervises three child processes: the web server, a Celery worker
and celery beat. With nothing configured they share the embedded default (SQLite and a
broker under ``DJFLOW_VAR_DIR``); with ``DATABASE_URL`` and the ``CELERY_*`` variables set
they run against Postgres and Redis just the same.

First start: when no superuser exists, one is created with the model manager (no e-mail
needed): ``DJANGO_SUPERUSER_USERNAME`` (default ``admin``), ``DJANGO_SUPERUSER_PASSWORD`` or,
when that is not set, a password generated with :mod:`secrets`. A generated password is
printed once, with the address to sign in at, beside "djflow is up" (or on the way out when
the command stops before that, so it is never lost); a password the user supplied is never
printed. When a superuser exists nothing is said. ``--create-superuser`` (kept from earlier
versions) creates the named user even when another superuser exists.

Links: unless ``SITE_URL`` is set, the children get ``SITE_URL=http://<host>:<port>`` from
``--addr`` (``0.0.0.0`` and ``::`` become loopback), so e-mailed approval links point here.

Supervision rules:

- "djflow is up" is said once the web server answers and the worker has sent its first
  heartbeat (``workflows.heartbeats``), so a run started then is not refused for want of a
  live worker; after ``WORKER_READY_SECONDS`` without one it is said anyway, with a warning.
- A busy ``--addr`` is an error before anything starts, and so is a web server that exits
  before it first answered (a port taken in between, or any other start-up failure).
- A child that exits on its own afterwards (a crash, a SIGKILL, the OOM killer) is reported
  on stderr with its pid and exit code or signal, and restarted after a back-off: 1 s,
  doubling to 30 s for each crash in a row; a child that stayed up 60 s starts over at 1 s.
  Nothing is lost while a child is down: the journal is in the database, and the worker or
  beat that comes back picks up where the other left (the reconciler re-offers lost work).
- A child that keeps crashing is retried every 30 s for as long as the command runs, loudly
  (each crash is reported, with its count). Giving up would take the web server and the
  other children down with it for what is often passing (a database restart, a full disk,
  a broker blip), and a person running this is watching the terminal: the output above the
  report says why, and Ctrl-C stops it all.
- SIGINT and SIGTERM are forwarded to every child and stop them all, with no restart;
  children run in process groups of their own, so a Ctrl-C in the terminal reaches them
  through this command only, once (a second SIGINT turns the worker's warm shutdown into a
  cold one: a second Ctrl-C does just that).
- A child still alive ``--stop-timeout`` seconds after the signal is killed with its group.
- On Linux each child gets SIGTERM if this command dies without cleaning up (even SIGKILL),
  so no orphan keeps the port or the broker.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction
from django.urls import reverse
from django.utils import timezone

from config import metrics_files
from workflows.heartbeats import workers_seen

POLL_SECONDS = 0.2
# "Up" waits for the worker's first heartbeat (a start before it is refused: no live worker
# serves the handlers) for at most this long, then says up anyway, with a warning.
WORKER_READY_SECONDS = 60.0
DEFAULT_ADDR = "127.0.0.1:8000"
DEFAULT_SUPERUSER = "admin"
# Loaded when the user names no modules of their own (WORKFLOW_MODULES unset): the contract's
# example and the AI ones, so a first run has workflows to start.
EXAMPLE_MODULES = [
    "workflows.examples.support_ticket",
    "workflows.examples.ticket_triage",
    "workflows.examples.ticket_tools",
    "workflows.examples.kb_support",
]
# The MCP server ticket_tools calls, when DJFLOW_MCP_SERVERS is not set: the bundled example
# server over stdio, started by whichever process calls it first (this Python, so the same
# installation).
EXAMPLE_MCP_SERVERS = {
    "tickets": {"command": [sys.executable, "-m", "workflows.examples.mcp_server"]},
}
# The model recipe steps that name none use when no provider is configured: offline, and
# labelled in every answer ("[stand-in model] ...").
STANDIN_MODEL = "standin:echo"
# The variables that configure a model provider (the SDKs' own).
PROVIDER_KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Address:
    """Where the web server listens (``host`` as runserver binds it) and how to link to it."""

    host: str
    port: int

    @classmethod
    def parse(cls, addr: str) -> Address:
        """``"8000"``, ``"0.0.0.0:8000"``, ``"0:8000"`` or ``"[::1]:8000"``, as runserver
        reads them."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if not port.isdigit():
            raise CommandError(f"--addr must be [host:]port, not {addr!r}")
        return cls("0.0.0.0" if host == "0" else host, int(port))

    @property
    def link_host(self) -> str:
        """The host to connect to: a wildcard address is reached on loopback."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    @property
    def base_url(self) -> str:
        host = self.link_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def bind_error(self) -> OSError | None:
        """Why the web server could not listen here (None when it could), found by binding
        the address as runserver will: SO_REUSEADDR, so a socket of a server that just
        stopped (TIME_WAIT) does not count, while a listening one does."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as error:
                return error
        return None

    @property
    def listen(self) -> str:
        """The address as runserver takes it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def answers(self) -> bool:
        try:
            with socket.create_connection((self.link_host, self.port), timeout=0.2):
                return True
        except OSError:
            return False


def cannot_listen(addr: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (
            f"{addr} is already in use: {error.strerror or error}. Stop what listens there, "
            "or choose another address with --addr or DJFLOW_ADDR."
        )
    return f"cannot listen on {addr}: {error}"


def child_env(address: Address, modules: list[str], environ: dict[str, str]) -> dict[str, str]:
    """The children's environment: this one, plus the workflow modules, links that point at
    ``address`` unless ``SITE_URL`` was set, and the stand-in model as the default when no
    model is named and no provider configured (see :func:`default_model_note`), and the
    example MCP server when ``DJFLOW_MCP_SERVERS`` is not set."""
    env = {**environ, "PYTHONUNBUFFERED": "1", "WORKFLOW_MODULES": ",".join(modules)}
    if "SITE_URL" not in environ:
        env["SITE_URL"] = address.base_url
    if uses_standin(environ):
        env["DJFLOW_DEFAULT_MODEL"] = STANDIN_MODEL
    if "DJFLOW_MCP_SERVERS" not in environ:
        env["DJFLOW_MCP_SERVERS"] = json.dumps(EXAMPLE_MCP_SERVERS)
    return env


def uses_standin(environ: dict[str, str]) -> bool:
    """No default model named and no provider configured: recipe steps that name no model
    are answered by the stand-in, so the examples run to the end offline."""
    return not environ.get("DJFLOW_DEFAULT_MODEL") and not any(
        environ.get(key) for key in PROVIDER_KEYS
    )


def default_model_note(environ: dict[str, str]) -> str:
    if uses_standin(environ):
        return (
            f"Models: none configured; recipe steps that name no model are answered by the "
            f"offline stand-in ({STANDIN_MODEL}, its answers start with '[stand-in model]'). "
            "Set OPENAI_API_KEY or ANTHROPIC_API_KEY, and DJFLOW_DEFAULT_MODEL, for a real one."
        )
    model = environ.get("DJFLOW_DEFAULT_MODEL") or "none (each recipe step names its own)"
    return f"Models: the default is {model}."


def describe_exit(code: int) -> str:
    """A ``Popen.returncode`` in words: a negative one is the signal that killed the child."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} (signal {-code})"


@dataclass
class Backoff:
    """How long to wait before restarting a child that exited: ``first`` seconds after a
    first crash, doubling for each crash in a row up to ``most``; a child that stayed up
    ``steady`` seconds or more crashed "for the first time" again."""

    first: float = 1.0
    most: float = 30.0
    steady: float = 60.0
    crashes: int = 0  # in a row, counting the last

    def after_exit(self, uptime: float) -> float:
        if uptime >= self.steady:
            self.crashes = 0
        self.crashes += 1
        return min(self.first * 2.0 ** (self.crashes - 1), self.most)


@dataclass
class Child:
    """One supervised process; ``process`` is None while it waits for its restart."""

    name: str
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)


@dataclass(frozen=True)
class NewSuperuser:
    username: str
    generated_password: str | None  # None: the user supplied it, and it is never printed


@transaction.atomic
def superuser_ensure(
    *, username: str, password: str | None, email: str, named: bool
) -> NewSuperuser | None:
    """Create the superuser ``username`` when no superuser exists (or, when ``named``, when
    that user does not exist); returns what was created, None when nothing was.

    A user of that name who exists but is no superuser is left as is: promoting an account
    is the administrator's decision, not a side effect of starting the server.
    """
    users = get_user_model()._default_manager
    if not named and users.filter(is_superuser=True).exists():
        return None
    if users.filter(**{get_user_model().USERNAME_FIELD: username}).exists():
        return None
    generated = None if password else secrets.token_urlsafe(12)
    users.create_superuser(
        **{get_user_model().USERNAME_FIELD: username},
        email=email,
        password=password or generated,
    )
    return NewSuperuser(username=username, generated_password=generated)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    # Resolved before fork: the child must not import or load anything between fork and exec.
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class Command(BaseCommand):
    help = (
        "Migrate, create a superuser on first start, then run the web server, a Celery "
        "worker and celery beat, and supervise them: signals are forwarded, and a child "
        "that dies is restarted."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--addr",
            default=os.environ.get("DJFLOW_ADDR") or DEFAULT_ADDR,
            help=f"[host:]port the web server listens on (default DJFLOW_ADDR, else "
            f"{DEFAULT_ADDR}).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=2,
            help="Pool processes of the Celery worker (default 2).",
        )
        parser.add_argument(
            "--create-superuser",
            action="store_true",
            help="Create the superuser named by DJANGO_SUPERUSER_USERNAME (default admin) "
            "unless it exists, even when another superuser exists; its password is "
            "DJANGO_SUPERUSER_PASSWORD, or generated and printed. Without this flag one is "
            "created the same way only when no superuser exists.",
        )
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=30.0,
            help="Seconds the children get to stop before they are killed (default 30).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        addr = options["addr"]
        address = Address.parse(addr)
        # Before anything starts: a second standalone on a busy port must not migrate,
        # start a worker and beat, and print "up" before its web server fails.
        if (error := address.bind_error()) is not None:
            raise CommandError(cannot_listen(addr, error))
        self._var_dir_lock = self._claim_var_dir()
        self._stop_signal: int | None = None
        self._children: dict[str, Child] = {}
        self._announced = False
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

        self._make_var_dirs()
        # The children's metric files (DJFLOW_METRICS_DIR): a master cleans at its start.
        metrics_files.remove_gone(settings.METRICS_HOST_DIR)
        call_command("migrate", interactive=False, verbosity=options["verbosity"])
        self._ensure_superuser(named=options["create_superuser"])
        modules = self._sync_workflow_modules(options["verbosity"])
        self.stdout.write(default_model_note(dict(os.environ)))

        try:
            if self._stop_signal is not None:
                return
            self._children = self._start_children(address, options["concurrency"], modules)
            try:
                self._supervise(address, addr)
            finally:
                self._stop(options["stop_timeout"])
        finally:
            if not self._announced:
                self._print_new_superuser(address)  # stopped before "up": still said once
        self.stdout.write("Stopped.")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            # Already stopping: pass a repeated signal on (the worker's cold shutdown).
            for child in self._children.values():
                if child.process is not None and child.process.poll() is None:
                    child.process.send_signal(signum)
        self._stop_signal = signum

    def _claim_var_dir(self) -> IO[str] | None:
        """On the embedded default, one standalone per var dir: a second one (another port,
        the same folder) would start a second worker and beat on the same SQLite file and
        broker folders, and both workers are named after the host, so the Worker heartbeats
        page would show one. An advisory lock held for this process's life says who has it;
        the kernel drops it when this process dies, however it dies."""
        if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3":
            return None  # a shared server database: more standalones are more workers
        path = Path(settings.VAR_DIR) / "standalone.lock"
        lock = path.open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise CommandError(
                f"another standalone (pid {holder}) runs on {settings.VAR_DIR}: two would share "
                "one SQLite database and broker. Stop it, or give this one a folder of its own "
                "with DJFLOW_VAR_DIR."
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        return lock

    def _make_var_dirs(self) -> None:
        """The folders the embedded default writes to; settings create only the var dir."""
        dirs = [Path(settings.VAR_DIR)]
        if settings.CELERY_BROKER_URL.startswith("filesystem://"):
            options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
            dirs += [
                Path(options[key])
                for key in ("data_folder_in", "data_folder_out", "control_folder")
                if key in options
            ]
            if options.get("store_processed") and "processed_folder" in options:
                dirs.append(Path(options["processed_folder"]))
        if settings.EMAIL_BACKEND.endswith("filebased.EmailBackend"):
            dirs.append(Path(settings.EMAIL_FILE_PATH))
        for path in dirs:
            path.mkdir(parents=True, exist_ok=True)

    def _ensure_superuser(self, *, named: bool) -> NewSuperuser | None:
        """Create the first superuser; a generated password is kept to be shown once."""
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME") or DEFAULT_SUPERUSER
        created = superuser_ensure(
            username=username,
            password=os.environ.get("DJANGO_SUPERUSER_PASSWORD") or None,
            email=os.environ.get("DJANGO_SUPERUSER_EMAIL", ""),
            named=named,
        )
        if created is None and named:
            self.stdout.write(f"Superuser {username!r} exists already.")
        elif created is not None and created.generated_password is None:
            self.stdout.write(
                f"Created superuser {username!r} (password from DJANGO_SUPERUSER_PASSWORD)."
            )
        self._new_superuser = created
        return created

    def _print_new_superuser(self, address: Address) -> None:
        """A generated password, once, where it cannot be missed."""
        created = self._new_superuser
        if created is None or created.generated_password is None:
            return
        self._new_superuser = None
        rule = "=" * 72
        self.stdout.write(
            "\n".join(
                [
                    rule,
                    "No superuser existed, so one was created. Sign in with:",
                    f"    username  {created.username}",
                    f"    password  {created.generated_password}",
                    f"    at        {address.base_url}{reverse('login')}",
                    "The password is shown this once: change it in the admin (Users), or "
                    f"set it with `manage.py changepassword {created.username}`.",
                    rule,
                ]
            )
        )
        self.stdout.flush()

    def _sync_workflow_modules(self, verbosity: int) -> list[str]:
        """The workflow modules the children load, their documents saved before any child
        starts (so the first request finds them): ``WORKFLOW_MODULES`` when set in the
        environment (even empty), else the support_ticket example."""
        if "WORKFLOW_MODULES" in os.environ:
            modules = list(settings.WORKFLOW_MODULES)
            origin = "from WORKFLOW_MODULES"
        else:
            modules = list(EXAMPLE_MODULES)
            origin = "the examples; set WORKFLOW_MODULES to load your own"
        if not modules:
            self.stdout.write("Workflow modules: none (WORKFLOW_MODULES is empty).")
            return modules
        self.stdout.write(f"Workflow modules: {', '.join(modules)} ({origin}).")
        call_command("sync_workflows", modules=modules, verbosity=verbosity)
        return modules

    def _start_children(
        self, address: Address, concurrency: int, modules: list[str]
    ) -> dict[str, Child]:
        manage = str(Path(settings.BASE_DIR) / "manage.py")
        celery = [sys.executable, "-m", "celery", "-A", "config"]
        commands = {
            # --insecure serves the admin's static files although DEBUG is off: this is the
            # one-machine default, not a production web server.
            "web": [
                sys.executable,
                manage,
                "runserver",
                "--noreload",
                "--insecure",
                address.listen,
            ],
            "worker": [*celery, "worker", "-l", "info", f"--concurrency={concurrency}"],
            "beat": [*celery, "beat", "-l", "info"],
        }
        self._env = child_env(address, modules, dict(os.environ))
        self._started_at = timezone.now()
        self._preexec = _die_with_parent()
        children = {name: Child(name, command) for name, command in commands.items()}
        for child in children.values():
            self.stdout.write(f"Started {child.name} (pid {self._spawn(child).pid}).")
        self.stdout.flush()
        return children

    def _spawn(self, child: Child) -> subprocess.Popen[bytes]:
        child.process = process = subprocess.Popen(
            child.command,
            cwd=settings.BASE_DIR,
            env=self._env,
            stdin=subprocess.DEVNULL,
            process_group=0,
            preexec_fn=self._preexec,
        )
        child.started_at = time.monotonic()
        return process

    def _supervise(self, address: Address, addr: str) -> None:
        """Restart children that exit, until a signal asks to stop."""
        while self._stop_signal is None:
            now = time.monotonic()
            for child in self._children.values():
                if child.process is None:
                    if now >= child.restart_at:
                        pid = self._spawn(child).pid
                        self.stderr.write(f"Restarted {child.name} (pid {pid}).")
                    continue
                code = child.process.poll()
                if code is None:
                    continue
                if child.name == "web" and not self._announced:
                    self._web_failed_at_start(child.process.pid, code, address, addr)
                self._schedule_restart(child, child.process.pid, code, now)
            if not self._announced and address.answers() and self._worker_ready():
                self._announce(address)
            time.sleep(POLL_SECONDS)

    def _worker_ready(self) -> bool:
        """The worker child has sent its first heartbeat (or has had long enough)."""
        worker = self._children.get("worker")
        if worker is None or worker.process is None:
            return False
        pid = worker.process.pid
        if any(seen.pid == pid for seen in workers_seen(since=self._started_at)):
            return True
        if time.monotonic() - worker.started_at < WORKER_READY_SECONDS:
            return False
        self.stderr.write(
            f"The worker (pid {pid}) has sent no heartbeat in {WORKER_READY_SECONDS:g} s: "
            "runs may be refused until it does; its output above may say why."
        )
        return True

    def _web_failed_at_start(self, pid: int, code: int, address: Address, addr: str) -> None:
        self.stderr.write(f"web (pid {pid}) {describe_exit(code)} before it answered.")
        if (error := address.bind_error()) is not None:
            raise CommandError(cannot_listen(addr, error))
        self._var_dir_lock = self._claim_var_dir()
        raise CommandError(
            f"the web server {describe_exit(code)} at start; its output above says why"
        )

    def _schedule_restart(self, child: Child, pid: int, code: int, now: float) -> None:
        delay = child.backoff.after_exit(uptime=now - child.started_at)
        child.process = None
        child.restart_at = now + delay
        crashes = child.backoff.crashes
        in_a_row = f" ({crashes} crashes in a row)" if crashes > 1 else ""
        self.stderr.write(
            self.style.ERROR(f"{child.name} (pid {pid}) {describe_exit(code)}{in_a_row}; ")
            + f"restarting {child.name} in {delay:g} s."
        )
        if delay >= child.backoff.most:
            self.stderr.write(
                self.style.ERROR(
                    f"{child.name} keeps crashing: its output above says why. It is retried "
                    f"every {child.backoff.most:g} s until it stays up; Ctrl-C stops djflow."
                )
            )

    def _announce(self, address: Address) -> None:
        self._announced = True
        connection.close()  # the supervisor reads no more; hold nothing on the database
        base = address.base_url
        self.stdout.write(
            "\n".join(
                [
                    self.style.SUCCESS(f"djflow is up: {base}{reverse('home')}"),
                    f"    {base}{reverse('home')}  what waits for your decision, your runs",
                    f"    {base}{reverse('admin:index')}  the admin: workflows, runs, users",
                    f"    {base}{reverse('api-docs')}  the API docs",
                    "Ctrl-C stops it.",
                ]
            )
        )
        self._print_new_superuser(address)
        self.stdout.flush()

    def _stop(self, timeout: float) -> None:
        signum = self._stop_signal or signal.SIGTERM
        running = {
            child.name: child.process
            for child in self._children.values()
            if child.process is not None
        }
        for process in running.values():
            if process.poll() is None:
                process.send_signal(signum)
        deadline = time.monotonic() + timeout
        for name, process in running.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop within {timeout:g}s; killing it.")
                # Its whole group: the worker's pool processes too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
