"""``manage.py standalone`` on the embedded default: real processes, real file-system broker."""

from __future__ import annotations

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

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]


def _embedded_env(var_dir: Path) -> dict[str, str]:
    """This process's environment without the services pytest-env points at."""
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS}
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
