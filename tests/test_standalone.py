"""``manage.py standalone`` on the embedded default: real processes, real file-system broker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parent.parent
SERVICE_VARS = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SENTRY_DSN")
RUN_TERMINAL = {"completed", "failed", "cancelled", "timed_out"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]


def _embedded_env(var_dir: Path) -> dict[str, str]:
    """This process's environment without the services pytest-env points at."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SERVICE_VARS and k != "WORKFLOW_MODULES" and not k.startswith("CELERY_")
    }
    env.update(DJFLOW_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:  # the process went away while we looked
            continue
        if int(fields["PPid"]) == pid:
            found.append(int(status.parent.name))
    return found


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for its reaper counts as gone."""
    try:
        return " (Z)" not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def _wait_for_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"standalone exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {timeout}s:\n{log.read_text()}")


def test_standalone_runs_web_worker_and_beat_and_stops_them_all(tmp_path: Path) -> None:
    env = _embedded_env(tmp_path / "var")
    port = _free_port()
    log = tmp_path / "standalone.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", f"--addr=127.0.0.1:{port}"],
            cwd=BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/admin/login/", proc, log, timeout=45)
        assert (tmp_path / "var" / "db.sqlite3").exists()  # the embedded default, not Postgres

        # A real round trip from another process: file-system broker → worker → SQLite results.
        roundtrip = subprocess.run(
            [
                sys.executable,
                "-c",
                "from config.celery import app; "
                "print(app.send_task('celery.accumulate', args=[4, 2]).get(timeout=20))",
            ],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=40,
        )
        assert roundtrip.returncode == 0, roundtrip.stderr + log.read_text()
        assert roundtrip.stdout.strip() == "[4, 2]"

        processes = _descendants(proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(proc.pid)]
        assert len(commands) == 3, commands
        assert any(b"runserver" in c for c in commands)
        assert any(b"worker" in c for c in commands)
        assert any(b"beat" in c for c in commands)
        assert "djflow is up" in log.read_text()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in processes if _alive(pid)], log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()  # the children follow it: they die with their parent
            proc.wait()


def test_standalone_stops_the_others_and_fails_when_a_child_dies(tmp_path: Path) -> None:
    env = _embedded_env(tmp_path / "var")
    port = _free_port()
    log = tmp_path / "standalone.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", f"--addr=127.0.0.1:{port}"],
            cwd=BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/admin/login/", proc, log, timeout=45)
        processes = _descendants(proc.pid)
        beat = next(
            pid
            for pid in _children(proc.pid)
            if b"beat" in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        os.kill(beat, signal.SIGKILL)

        assert proc.wait(timeout=30) != 0, log.read_text()
        assert f"beat (pid {beat}) exited with code -9" in log.read_text()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in processes if _alive(pid)], log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _api(method: str, url: str, token: str, body: object = None) -> tuple[int, dict[str, object]]:
    """One JSON request to the API over real HTTP; (status, body)."""
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_standalone_runs_the_support_ticket_example_end_to_end(tmp_path: Path) -> None:
    """The README's first command, as a user meets it: nothing configured (SQLite and the
    file-system broker), the example loaded by default, a question ticket run over HTTP."""
    env = _embedded_env(tmp_path / "var")
    env.update(DJANGO_SUPERUSER_USERNAME="admin", DJANGO_SUPERUSER_PASSWORD="a-long-password-1")
    env.setdefault("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "standalone.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "standalone",
                f"--addr=127.0.0.1:{port}",
                "--create-superuser",
            ],
            cwd=BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_http(f"{base}/admin/login/", proc, log, timeout=45)
        assert "Workflow modules: workflows.examples.support_ticket" in log.read_text()
        token = subprocess.run(
            [sys.executable, "manage.py", "drf_create_token", "admin"],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert token.returncode == 0, token.stderr
        key = token.stdout.split()[2]  # "Generated token <key> for user admin"

        status, run = _api(
            "POST",
            f"{base}/api/v1/runs",
            key,
            {"workflow": "support_ticket", "input": {"ticket": "Q: where is my invoice?"}},
        )
        assert status == 201, run
        deadline = time.monotonic() + 30
        while run["status"] not in RUN_TERMINAL and time.monotonic() < deadline:
            time.sleep(0.2)
            status, run = _api("GET", f"{base}/api/v1/runs/{run['id']}", key)
            assert status == 200, run
        assert run["status"] == "completed", (run, log.read_text())
        assert run["output"] == {"sent": True}
        assert run["error"] is None
        journal = [(step["step_id"], step["status"]) for step in run["steps"]]
        assert journal == [
            ("classify", "succeeded"),
            ("draft", "succeeded"),
            ("approval", "skipped"),
            ("send", "succeeded"),
        ], run["steps"]
        draft = run["steps"][1]
        assert draft["output"] == "an answer to a question"
        assert float(draft["cost_usd"]) > 0  # its span's usage was priced
        assert float(run["cost_usd"]) == float(draft["cost_usd"])

        # A bug waits for its approval event with no process alive, on SQLite too.
        status, bug = _api(
            "POST",
            f"{base}/api/v1/runs",
            key,
            {"workflow": "support_ticket", "input": {"ticket": "B: crash"}},
        )
        assert status == 201, bug
        deadline = time.monotonic() + 30
        while bug["status"] != "waiting" and time.monotonic() < deadline:
            time.sleep(0.2)
            status, bug = _api("GET", f"{base}/api/v1/runs/{bug['id']}", key)
        assert bug["status"] == "waiting", (bug, log.read_text())
        status, delivery = _api(
            "POST",
            f"{base}/api/v1/events",
            key,
            {"name": "approved", "key": "B: crash", "payload": {"ok": True}},
        )
        assert (status, delivery["matched"]) == (200, 1), delivery
        deadline = time.monotonic() + 30
        while bug["status"] not in RUN_TERMINAL and time.monotonic() < deadline:
            time.sleep(0.2)
            status, bug = _api("GET", f"{base}/api/v1/runs/{bug['id']}", key)
        assert bug["status"] == "completed", (bug, log.read_text())
        approval = next(step for step in bug["steps"] if step["step_id"] == "approval")
        assert approval["output"] == {"ok": True}

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert "database is locked" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_example_is_loaded_when_no_workflow_modules_are_named(db, monkeypatch) -> None:
    from io import StringIO

    from workers.management.commands.standalone import Command
    from workflows.models import WorkflowVersion

    monkeypatch.delenv("WORKFLOW_MODULES", raising=False)
    out = StringIO()
    assert Command(stdout=out)._sync_workflow_modules(verbosity=1) == [
        "workflows.examples.support_ticket"
    ]
    assert "Workflow modules: workflows.examples.support_ticket (the example" in out.getvalue()
    assert WorkflowVersion.objects.filter(workflow_id="support_ticket").exists()


def test_named_workflow_modules_replace_the_example(db, monkeypatch, settings) -> None:
    from io import StringIO

    from workers.management.commands.standalone import Command
    from workflows.models import WorkflowVersion

    monkeypatch.setenv("WORKFLOW_MODULES", "")
    settings.WORKFLOW_MODULES = []
    out = StringIO()
    assert Command(stdout=out)._sync_workflow_modules(verbosity=1) == []
    assert "Workflow modules: none" in out.getvalue()
    assert not WorkflowVersion.objects.exists()
