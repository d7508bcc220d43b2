"""``manage.py standalone``: the whole engine on one machine, in one command.

It migrates, saves the documents of the workflow modules (``WORKFLOW_MODULES``; when that
is not set at all, the contract's ``support_ticket`` example), then starts and supervises
three child processes: the web server, a Celery worker and celery beat. With nothing
configured they share the embedded default (SQLite and kombu's file-system broker under
``DJFLOW_VAR_DIR``); with ``DATABASE_URL`` and the ``CELERY_*`` variables set they run
against Postgres and Redis just the same.

Supervision rules:

- SIGINT and SIGTERM are forwarded to every child; children run in process groups of their
  own, so a Ctrl-C in the terminal reaches them through this command only, once (a second
  SIGINT turns the worker's warm shutdown into a cold one: a second Ctrl-C does just that).
- When any child exits on its own, the others are stopped and the command exits non-zero.
- A child still alive ``--stop-timeout`` seconds after the signal is killed with its group.
- On Linux each child gets SIGTERM if this command dies without cleaning up (even SIGKILL),
  so no orphan keeps the port or the broker.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

POLL_SECONDS = 0.2
# Loaded when the user names no modules of their own (WORKFLOW_MODULES unset): the contract's
# example, so a first run has a workflow to start.
EXAMPLE_MODULES = ["workflows.examples.support_ticket"]
_PR_SET_PDEATHSIG = 1


def _parse_addr(addr: str) -> tuple[str, int]:
    """``"8000"``, ``"0.0.0.0:8000"`` or ``"[::1]:8000"`` → (host to connect to, port)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    if not port.isdigit():
        raise CommandError(f"--addr must be [host:]port, not {addr!r}")
    return host, int(port)


def _port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


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
        "Migrate, then run the web server, a Celery worker and celery beat, and supervise "
        "them: signals are forwarded, and if one dies the others are stopped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--addr",
            default="127.0.0.1:8000",
            help="[host:]port the web server listens on (default 127.0.0.1:8000).",
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
            help="Create the superuser named by DJANGO_SUPERUSER_USERNAME and "
            "DJANGO_SUPERUSER_PASSWORD (and DJANGO_SUPERUSER_EMAIL) unless it exists.",
        )
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=30.0,
            help="Seconds the children get to stop before they are killed (default 30).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = _parse_addr(options["addr"])
        self._stop_signal: int | None = None
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

        self._make_var_dirs()
        call_command("migrate", interactive=False, verbosity=options["verbosity"])
        if options["create_superuser"]:
            self._create_superuser()
        modules = self._sync_workflow_modules(options["verbosity"])

        if self._stop_signal is not None:
            return
        self._children = children = self._start_children(
            options["addr"], options["concurrency"], modules
        )
        try:
            died = self._supervise(children, host, port)
        finally:
            self._stop(children, options["stop_timeout"])
        if died is not None:
            name, code = died
            raise CommandError(f"{name} exited with code {code}; stopped the others")
        self.stdout.write("Stopped.")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            # Already stopping: pass a repeated signal on (the worker's cold shutdown).
            for child in self._children.values():
                if child.poll() is None:
                    child.send_signal(signum)
        self._stop_signal = signum

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

    def _create_superuser(self) -> None:
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME")
        if not username or not os.environ.get("DJANGO_SUPERUSER_PASSWORD"):
            raise CommandError(
                "--create-superuser needs DJANGO_SUPERUSER_USERNAME and DJANGO_SUPERUSER_PASSWORD"
            )
        user_model = get_user_model()
        if user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).exists():
            self.stdout.write(f"Superuser {username!r} exists already.")
            return
        # createsuperuser --noinput reads the DJANGO_SUPERUSER_* variables itself.
        call_command("createsuperuser", interactive=False)

    def _sync_workflow_modules(self, verbosity: int) -> list[str]:
        """The workflow modules the children load, their documents saved before any child
        starts (so the first request finds them): ``WORKFLOW_MODULES`` when set in the
        environment (even empty), else the support_ticket example."""
        if "WORKFLOW_MODULES" in os.environ:
            modules = list(settings.WORKFLOW_MODULES)
            origin = "from WORKFLOW_MODULES"
        else:
            modules = list(EXAMPLE_MODULES)
            origin = "the example; set WORKFLOW_MODULES to load your own"
        if not modules:
            self.stdout.write("Workflow modules: none (WORKFLOW_MODULES is empty).")
            return modules
        self.stdout.write(f"Workflow modules: {', '.join(modules)} ({origin}).")
        call_command("sync_workflows", modules=modules, verbosity=verbosity)
        return modules

    def _start_children(
        self, addr: str, concurrency: int, modules: list[str]
    ) -> dict[str, subprocess.Popen[bytes]]:
        manage = str(Path(settings.BASE_DIR) / "manage.py")
        celery = [sys.executable, "-m", "celery", "-A", "config"]
        commands = {
            # --insecure serves the admin's static files although DEBUG is off: this is the
            # one-machine default, not a production web server.
            "web": [sys.executable, manage, "runserver", "--noreload", "--insecure", addr],
            "worker": [*celery, "worker", "-l", "info", f"--concurrency={concurrency}"],
            "beat": [*celery, "beat", "-l", "info"],
        }
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORKFLOW_MODULES": ",".join(modules)}
        preexec = _die_with_parent()
        children: dict[str, subprocess.Popen[bytes]] = {}
        for name, command in commands.items():
            children[name] = subprocess.Popen(
                command,
                cwd=settings.BASE_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                process_group=0,
                preexec_fn=preexec,
            )
            self.stdout.write(f"Started {name} (pid {children[name].pid}).")
        self.stdout.flush()
        return children

    def _supervise(
        self, children: dict[str, subprocess.Popen[bytes]], host: str, port: int
    ) -> tuple[str, int] | None:
        """Wait for a signal (returns None) or for a child to exit (returns its name, code)."""
        announced = False
        while self._stop_signal is None:
            for name, child in children.items():
                code = child.poll()
                if code is not None:
                    self.stderr.write(f"{name} (pid {child.pid}) exited with code {code}.")
                    return name, code
            if not announced and _port_answers(host, port):
                announced = True
                base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
                self.stdout.write(
                    self.style.SUCCESS(f"djflow is up: the web UI is at {base}/admin/")
                    + f" (API docs at {base}/api/v1/docs/). Ctrl-C stops it."
                )
                self.stdout.flush()
            time.sleep(POLL_SECONDS)
        return None

    def _stop(self, children: dict[str, subprocess.Popen[bytes]], timeout: float) -> None:
        signum = self._stop_signal or signal.SIGTERM
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)
        deadline = time.monotonic() + timeout
        for name, child in children.items():
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop within {timeout:g}s; killing it.")
                # Its whole group: the worker's pool processes too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
