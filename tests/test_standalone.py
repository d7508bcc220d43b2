"""``manage.py standalone`` on the embedded default: real processes, real file-system broker."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from tests.processes import wait_for
from tests.scrape import samples

BASE_DIR = Path(__file__).resolve().parent.parent
SERVICE_VARS = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SENTRY_DSN")
# What the standalone reads for itself: each test sets the ones it means.
STANDALONE_VARS = ("DJFLOW_ADDR", "SITE_URL", "WORKFLOW_MODULES")
RUN_TERMINAL = {"completed", "failed", "cancelled", "timed_out"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]


def _embedded_env(var_dir: Path) -> dict[str, str]:
    """This process's environment without the services pytest-env points at."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SERVICE_VARS + STANDALONE_VARS
        and not k.startswith(("CELERY_", "DJANGO_SUPERUSER_"))
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


def _wait_for_text(log: Path, text: str, timeout: float) -> float:
    """Seconds until ``text`` shows in the log."""
    started = time.monotonic()
    while text not in log.read_text():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{text!r} not in the log within {timeout}s:\n{log.read_text()}")
        time.sleep(0.05)
    return time.monotonic() - started


@contextlib.contextmanager
def _standalone(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A ``manage.py standalone`` with its output in a log file, killed if the test left it
    running (its children die with it)."""
    log = tmp_path / "standalone.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "standalone", *args],
            cwd=BASE_DIR,
            env=env or _embedded_env(tmp_path / "var"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _child(proc: subprocess.Popen[bytes], word: bytes) -> int:
    """The pid of the standalone's child whose command line has ``word``."""
    return next(
        pid for pid in _children(proc.pid) if word in Path(f"/proc/{pid}/cmdline").read_bytes()
    )


def _stop_and_check_all_gone(
    proc: subprocess.Popen[bytes], log: Path, signum: int = signal.SIGTERM
) -> None:
    processes = _descendants(proc.pid)
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 0, log.read_text()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in processes if _alive(pid)], log.read_text()


def _manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py <args>`` on the standalone's environment, its output captured."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=BASE_DIR,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _token(env: dict[str, str], username: str = "admin") -> str:
    token = _manage(env, "drf_create_token", username)
    assert token.returncode == 0, token.stderr
    return token.stdout.split()[2]  # "Generated token <key> for user admin"


def test_standalone_runs_web_worker_and_beat_and_stops_them_all(tmp_path: Path) -> None:
    """First start: a superuser with a generated password, shown once; links follow --addr;
    an idle engine keeps quiet; SIGTERM stops every child."""
    env = _embedded_env(tmp_path / "var")
    port = _free_port()
    with _standalone(tmp_path, f"--addr=127.0.0.1:{port}", env=env) as (proc, log):
        _wait_for_http(f"http://127.0.0.1:{port}/admin/login/", proc, log, timeout=45)
        assert (tmp_path / "var" / "db.sqlite3").exists()  # the embedded default, not Postgres

        # A real round trip from another process: broker → worker → SQLite results.
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

        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(proc.pid)]
        assert len(commands) == 3, commands
        assert any(b"runserver" in c for c in commands)
        assert any(b"worker" in c for c in commands)
        assert any(b"beat" in c for c in commands)

        _wait_for_text(log, "djflow is up", timeout=10)
        _wait_for_text(log, "    at        ", timeout=5)
        text = log.read_text()
        base = f"http://127.0.0.1:{port}"
        for where in (f"{base}/ ", f"{base}/admin/ ", f"{base}/api/v1/docs/ "):
            assert where in text, text
        # "Up" waits for the worker (its first heartbeat), so a start made then is served.
        assert text.index(" ready.") < text.index("djflow is up"), text
        password = re.search(r"^    password  (\S+)$", text, re.MULTILINE)
        assert password, text
        assert re.search(r"^    username  admin$", text, re.MULTILINE), text
        assert f"    at        {base}/accounts/login/" in text
        signed_in = _manage(
            env,
            "shell",
            "-c",
            "from django.contrib.auth import authenticate; "
            f"u = authenticate(username='admin', password={password[1]!r}); "
            "print(u is not None and u.is_superuser)",
        )
        assert signed_in.stdout.splitlines()[-1] == "True", signed_in.stdout + signed_in.stderr

        # E-mailed links point at this port: the children read SITE_URL from --addr.
        for word in (b"worker", b"runserver"):
            environ = Path(f"/proc/{_child(proc, word)}/environ").read_bytes().split(b"\0")
            assert f"SITE_URL={base}".encode() in environ

        # Idle: 15 s of ticks (and beat's first reconcile) print nothing.
        quiet_from = len(log.read_text())
        time.sleep(15)
        idle = log.read_text()[quiet_from:]
        assert "runs.fire_timers" not in idle and "runs.reconcile" not in idle, idle
        assert len(idle.splitlines()) < 5, idle

        _stop_and_check_all_gone(proc, log)
    assert log.read_text().count(password[1]) == 1  # said once


def test_a_killed_child_is_restarted_and_a_run_started_after_completes(tmp_path: Path) -> None:
    """SIGKILL the worker, then beat and the web server: each is reported and restarted;
    a run started afterwards completes and logs its tasks; SIGINT (Ctrl-C) stops it all.
    The address comes from DJFLOW_ADDR; the supplied password is never printed."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = _embedded_env(tmp_path / "var")
    env.update(DJFLOW_ADDR=f"127.0.0.1:{port}", DJANGO_SUPERUSER_PASSWORD="a-long-password-1")
    with _standalone(tmp_path, env=env) as (proc, log):
        _wait_for_http(f"{base}/admin/login/", proc, log, timeout=45)
        key = _token(env)

        worker = _child(proc, b"worker")
        os.kill(worker, signal.SIGKILL)
        _wait_for_text(log, f"worker (pid {worker}) was killed by SIGKILL (signal 9)", 10)
        _wait_for_text(log, "restarting worker in 1 s.", 5)
        restarted = _wait_for_text(log, "Restarted worker (pid ", 10)
        assert restarted < 3, log.read_text()  # one second of back-off, then a new process

        beat, web = _child(proc, b"beat"), _child(proc, b"runserver")
        os.kill(beat, signal.SIGKILL)
        os.kill(web, signal.SIGKILL)
        _wait_for_text(log, f"beat (pid {beat}) was killed by SIGKILL", 10)
        _wait_for_text(log, f"web (pid {web}) was killed by SIGKILL", 10)
        _wait_for_text(log, "Restarted web (pid ", 10)
        _wait_for_http(f"{base}/admin/login/", proc, log, timeout=30)
        assert len(_children(proc.pid)) == 3

        tasks_from = len(log.read_text())
        status, run = _start_run(base, key, {"ticket": "Q: where is my invoice?"})
        assert status == 201, run
        run = _wait_for_run(base, key, run, RUN_TERMINAL, log)
        assert run["status"] == "completed", (run, log.read_text())
        # The run's own tasks still show in the log (only the clock's are dropped).
        assert "Task workers.execute_step[" in log.read_text()[tasks_from:], log.read_text()

        _stop_and_check_all_gone(proc, log, signal.SIGINT)
    text = log.read_text()
    assert "a-long-password-1" not in text
    assert "Created superuser 'admin' (password from DJANGO_SUPERUSER_PASSWORD)." in text


def test_a_busy_port_is_an_error_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        env = _embedded_env(tmp_path / "var")
        env["DJFLOW_ADDR"] = addr
        done = _manage(env, "standalone")
    assert done.returncode != 0
    assert f"{addr} is already in use: Address already in use" in done.stderr, done.stderr
    assert "Started" not in done.stdout and "djflow is up" not in done.stdout, done.stdout
    assert not (tmp_path / "var" / "db.sqlite3").exists()  # not even migrated


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


def _start_run(
    base: str, key: str, run_input: dict[str, object], workflow: str = "support_ticket"
) -> tuple[int, dict[str, Any]]:
    """Start a run (of support_ticket by default); a start refused until the (re)started
    worker's first heartbeat (400, no live worker serves a handler) is tried again for up to
    30 s."""
    body = {"workflow": workflow, "input": run_input}
    deadline = time.monotonic() + 30
    while True:
        status, run = _api("POST", f"{base}/api/v1/runs", key, body)
        refused = status == 400 and "worker" in json.dumps(run)
        if not refused or time.monotonic() > deadline:
            return status, run
        time.sleep(0.5)


def _wait_for_run(
    base: str, key: str, run: dict[str, Any], statuses: set[str], log: Path, timeout: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while run["status"] not in statuses and time.monotonic() < deadline:
        time.sleep(0.2)
        status, run = _api("GET", f"{base}/api/v1/runs/{run['id']}", key)
        assert status == 200, run
    return run


def test_standalone_runs_the_support_ticket_example_end_to_end(tmp_path: Path) -> None:
    """The README's first command, as a user meets it: nothing configured (SQLite and the
    embedded broker), the example loaded by default, a question ticket run over HTTP."""
    env = _embedded_env(tmp_path / "var")
    env.update(DJANGO_SUPERUSER_USERNAME="admin", DJANGO_SUPERUSER_PASSWORD="a-long-password-1")
    env.setdefault("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    args = (f"--addr=127.0.0.1:{port}", "--create-superuser")
    with _standalone(tmp_path, *args, env=env) as (proc, log):
        _wait_for_http(f"{base}/admin/login/", proc, log, timeout=45)
        assert "Workflow modules: workflows.examples.support_ticket" in log.read_text()
        key = _token(env)

        status, run = _start_run(base, key, {"ticket": "Q: where is my invoice?"})
        assert status == 201, run
        run = _wait_for_run(base, key, run, RUN_TERMINAL, log)
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
        # Its span's usage is the offline stand-in's, priced at nothing (issue 37): a load
        # test of the example showed $1.50 of spend no provider made.
        assert draft["usage"]["models"] == {"echo": {"input_tokens": 812, "output_tokens": 37}}
        assert float(draft["cost_usd"]) == 0 and float(run["cost_usd"]) == 0

        # A bug waits for its approval event with no process alive, on SQLite too.
        status, bug = _start_run(base, key, {"ticket": "B: crash"})
        assert status == 201, bug
        bug = _wait_for_run(base, key, bug, {"waiting"}, log)
        assert bug["status"] == "waiting", (bug, log.read_text())
        status, delivery = _api(
            "POST",
            f"{base}/api/v1/events",
            key,
            {"name": "approved", "key": "B: crash", "payload": {"ok": True}},
        )
        assert (status, delivery["matched"]) == (200, 1), delivery
        bug = _wait_for_run(base, key, bug, RUN_TERMINAL, log)
        assert bug["status"] == "completed", (bug, log.read_text())
        approval = next(step for step in bug["steps"] if step["step_id"] == "approval")
        assert approval["output"] == {"ok": True}

        # The AI example runs offline on the stand-in model: a JSON recipe feeding a
        # condition, a text recipe drafting the reply, each call recorded.
        assert "answered by the offline stand-in" in log.read_text()
        status, triaged = _start_run(
            base, key, {"ticket": "The export button crashes"}, "ticket_triage"
        )
        assert status == 201, triaged
        triaged = _wait_for_run(base, key, triaged, RUN_TERMINAL, log)
        assert triaged["status"] == "completed", (triaged, log.read_text())
        assert triaged["output"]["kind"] in ("bug", "question")
        assert triaged["output"]["reply"].startswith("[stand-in model]")
        calls = [call for step in triaged["steps"] for call in step["model_calls"]]
        assert [call["provider"] for call in calls] == ["standin", "standin"]

        # Metrics: the embedded default serves them to this machine without a token, adding
        # up what the worker's pool processes counted.
        _check_metrics(base, log)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    text = log.read_text()
    assert "database is locked" not in text
    assert "a-long-password-1" not in text  # a password the user chose is never printed


def test_fan_outs_complete_on_the_embedded_defaults_chords(tmp_path: Path) -> None:
    """A parallel and a foreach of 25 items (three header messages) on SQLite and the
    file-system broker: each fan-out is a chord whose body Celery's chord_unlock calls once
    the header's stored results are ready (the SQLAlchemy result backend counts nothing)."""
    env = _embedded_env(tmp_path / "var")
    env.update(
        DJANGO_SUPERUSER_USERNAME="admin",
        DJANGO_SUPERUSER_PASSWORD="a-long-password-1",
        WORKFLOW_MODULES="tests.flows_standalone",
    )
    env.setdefault("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with _standalone(tmp_path, f"--addr=127.0.0.1:{port}", "--create-superuser", env=env) as (
        proc,
        log,
    ):
        _wait_for_http(f"{base}/admin/login/", proc, log, timeout=45)
        key = _token(env)
        status, run = _start_run(base, key, {"items": list(range(25))}, "standalone_fanned")
        assert status == 201, run
        run = _wait_for_run(base, key, run, RUN_TERMINAL, log, timeout=60)
        assert run["status"] == "completed", (run, log.read_text())
        assert run["output"] == [n * 2 for n in range(25)]
        both = next(step for step in run["steps"] if step["step_id"] == "both")
        assert both["output"] == {"a": "a", "b": "b"}
        # Both chords' bodies were called by chord_unlock (it succeeds once it has called
        # the body; while the header runs it retries).
        pattern = re.compile(r"Task celery\.chord_unlock\[([0-9a-f-]+)\] succeeded")
        wait_for(
            lambda: len(set(pattern.findall(log.read_text()))) >= 2,
            timeout=20,
            message=log.read_text,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()


def _check_metrics(base: str, log: Path) -> None:
    ends = {
        (("status", "completed"), ("workflow", "support_ticket")): 2.0,
        (("status", "completed"), ("workflow", "ticket_triage")): 1.0,
    }

    def scraped() -> dict | None:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            found = samples(response.read())
        counted = {
            labels: value
            for (name, labels), value in found.items()
            if name == "djflow_workflow_executions_total"
        }
        # Counted after each commit: the last may land a moment after its run shows ended.
        return found if counted == ends else None

    found = wait_for(scraped, timeout=10, interval=0.2, message=log.read_text)
    standin = {
        labels: value
        for (name, labels), value in found.items()
        if name == "djflow_model_tokens_total" and ("provider", "standin") in labels
    }
    assert standin and all(value > 0 for value in standin.values()), standin
    assert found[("djflow_scrape_error", (("source", "broker"),))] == 0
    assert found[("djflow_scrape_error", (("source", "database"),))] == 0
    assert found[("djflow_queue_depth", (("queue", "default"),))] == 0


def test_the_example_is_loaded_when_no_workflow_modules_are_named(db, monkeypatch) -> None:
    from io import StringIO

    from workers.management.commands.standalone import Command
    from workflows.models import WorkflowVersion

    monkeypatch.delenv("WORKFLOW_MODULES", raising=False)
    out = StringIO()
    assert Command(stdout=out)._sync_workflow_modules(verbosity=1) == [
        "workflows.examples.support_ticket",
        "workflows.examples.ticket_triage",
        "workflows.examples.ticket_tools",
        "workflows.examples.kb_support",
    ]
    assert (
        "Workflow modules: workflows.examples.support_ticket, workflows.examples.ticket_triage,"
        " workflows.examples.ticket_tools, workflows.examples.kb_support (the examples"
        in out.getvalue()
    )
    assert WorkflowVersion.objects.filter(workflow_id="support_ticket").exists()
    assert WorkflowVersion.objects.filter(workflow_id="ticket_triage").exists()
    assert WorkflowVersion.objects.filter(workflow_id="ticket_tools").exists()
    assert WorkflowVersion.objects.filter(workflow_id="kb_answer_ticket").exists()


def test_with_no_provider_configured_the_stand_in_answers_and_says_so() -> None:
    from workers.management.commands.standalone import (
        Address,
        child_env,
        default_model_note,
    )

    address = Address.parse("127.0.0.1:8000")
    bare = child_env(address, [], {})
    assert bare["DJFLOW_DEFAULT_MODEL"] == "standin:echo"
    assert "stand-in" in default_model_note({})
    keyed = child_env(address, [], {"OPENAI_API_KEY": "sk-x"})
    assert "DJFLOW_DEFAULT_MODEL" not in keyed
    named = child_env(address, [], {"DJFLOW_DEFAULT_MODEL": "openai:gpt-4o-mini"})
    assert named["DJFLOW_DEFAULT_MODEL"] == "openai:gpt-4o-mini"
    assert "openai:gpt-4o-mini" in default_model_note(named)


def test_the_example_mcp_server_is_configured_unless_servers_are_named() -> None:
    from workers.management.commands.standalone import Address, child_env

    address = Address.parse("127.0.0.1:8000")
    bare = json.loads(child_env(address, [], {})["DJFLOW_MCP_SERVERS"])
    assert bare == {"tickets": {"command": [sys.executable, "-m", "workflows.examples.mcp_server"]}}
    mine = child_env(address, [], {"DJFLOW_MCP_SERVERS": ""})
    assert mine["DJFLOW_MCP_SERVERS"] == ""


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


# --- the pieces, without processes ------------------------------------------------------------


def test_the_back_off_doubles_to_its_most_and_starts_over_after_a_steady_run() -> None:
    from workers.management.commands.standalone import Backoff

    backoff = Backoff()
    assert [backoff.after_exit(uptime=2) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.crashes == 7
    assert backoff.after_exit(uptime=60) == 1  # it stayed up a minute: a first crash again
    assert backoff.after_exit(uptime=0.5) == 2


def test_an_exit_is_told_by_code_or_by_signal() -> None:
    from workers.management.commands.standalone import describe_exit

    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-9) == "was killed by SIGKILL (signal 9)"
    assert describe_exit(-15) == "was killed by SIGTERM (signal 15)"


@pytest.mark.parametrize(
    ("addr", "listen", "site_url"),
    [
        ("8123", "127.0.0.1:8123", "http://127.0.0.1:8123"),
        ("0.0.0.0:8123", "0.0.0.0:8123", "http://127.0.0.1:8123"),
        ("0:8123", "0.0.0.0:8123", "http://127.0.0.1:8123"),
        ("localhost:9000", "localhost:9000", "http://localhost:9000"),
        ("[::]:8123", "[::]:8123", "http://[::1]:8123"),
    ],
)
def test_links_follow_the_address_unless_site_url_is_set(
    addr: str, listen: str, site_url: str
) -> None:
    from workers.management.commands.standalone import Address, child_env

    address = Address.parse(addr)
    assert address.listen == listen
    assert child_env(address, ["m"], {"PATH": "/bin"})["SITE_URL"] == site_url
    mine = {"SITE_URL": "https://flows.example.com"}
    assert child_env(address, [], mine)["SITE_URL"] == "https://flows.example.com"


def test_a_bad_address_is_refused() -> None:
    from django.core.management.base import CommandError

    from workers.management.commands.standalone import Address

    with pytest.raises(CommandError, match="--addr must be"):
        Address.parse("127.0.0.1:http")


def test_a_first_start_creates_a_superuser_and_shows_its_password_once(db, monkeypatch) -> None:
    from io import StringIO

    from django.contrib.auth import authenticate

    from workers.management.commands.standalone import Address, Command

    for name in ("USERNAME", "PASSWORD", "EMAIL"):
        monkeypatch.delenv(f"DJANGO_SUPERUSER_{name}", raising=False)
    out = StringIO()
    command = Command(stdout=out)
    created = command._ensure_superuser(named=False)
    assert created is not None and created.username == "admin"
    password = created.generated_password
    assert password and len(password) >= 16
    assert authenticate(username="admin", password=password).is_superuser
    assert out.getvalue() == ""  # held for the "up" banner

    command._print_new_superuser(Address.parse("127.0.0.1:8123"))
    command._print_new_superuser(Address.parse("127.0.0.1:8123"))
    assert out.getvalue().count(password) == 1
    assert "http://127.0.0.1:8123/accounts/login/" in out.getvalue()

    # Second start: a superuser exists, nothing is created and nothing is said.
    out.truncate(0)
    assert Command(stdout=out)._ensure_superuser(named=False) is None
    assert out.getvalue() == ""


def test_a_supplied_password_is_used_and_never_printed(db, monkeypatch) -> None:
    from io import StringIO

    from django.contrib.auth import authenticate

    from workers.management.commands.standalone import Address, Command

    monkeypatch.setenv("DJANGO_SUPERUSER_USERNAME", "ops")
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-long-password-1")
    out = StringIO()
    command = Command(stdout=out)
    command._ensure_superuser(named=False)
    command._print_new_superuser(Address.parse("8123"))
    assert authenticate(username="ops", password="a-long-password-1").is_superuser
    assert "a-long-password-1" not in out.getvalue()
    assert "Created superuser 'ops'" in out.getvalue()


def test_create_superuser_adds_the_named_one_beside_others(db, admin_user, monkeypatch) -> None:
    from io import StringIO

    from django.contrib.auth import get_user_model

    from workers.management.commands.standalone import Command

    monkeypatch.setenv("DJANGO_SUPERUSER_USERNAME", "ops")
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-long-password-1")
    out = StringIO()
    assert Command(stdout=out)._ensure_superuser(named=False) is None  # one exists already
    assert Command(stdout=out)._ensure_superuser(named=True) is not None
    assert get_user_model().objects.get(username="ops").is_superuser
    assert Command(stdout=out)._ensure_superuser(named=True) is None
    assert "Superuser 'ops' exists already." in out.getvalue()


def test_a_plain_user_named_admin_is_not_promoted(db, monkeypatch) -> None:
    from django.contrib.auth import get_user_model

    from workers.management.commands.standalone import superuser_ensure

    get_user_model().objects.create_user(username="admin", password="x")
    assert superuser_ensure(username="admin", password=None, email="", named=False) is None
    assert not get_user_model().objects.filter(is_superuser=True).exists()


def _supervisor(children: dict[str, list[str]]) -> tuple[Any, StringIO]:
    """A standalone Command supervising real little processes instead of the engine's."""
    from workers.management.commands.standalone import Child, Command

    err = StringIO()
    command = Command(stdout=StringIO(), stderr=err)
    command._stop_signal, command._announced, command._new_superuser = None, False, None
    command._env, command._preexec = dict(os.environ), None
    command._children = {name: Child(name, argv) for name, argv in children.items()}
    for child in command._children.values():
        command._spawn(child)
    return command, err


@pytest.mark.parametrize("port_taken", [False, True])
def test_a_web_server_that_exits_before_it_answered_stops_the_start(port_taken: bool) -> None:
    from django.core.management.base import CommandError

    from workers.management.commands.standalone import Address

    command, err = _supervisor({"web": [sys.executable, "-c", "raise SystemExit(3)"]})
    with socket.socket() as taken:
        if port_taken:  # bound, not listening: nothing answers, as when runserver lost a race
            taken.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{taken.getsockname()[1] if port_taken else _free_port()}"
        expected = "is already in use" if port_taken else "exited with code 3 at start"
        with pytest.raises(CommandError, match=expected):
            command._supervise(Address.parse(addr), addr)
    assert (
        "web (pid " in err.getvalue() and "exited with code 3 before it answered" in err.getvalue()
    )


def test_a_child_that_keeps_crashing_is_retried_at_the_most_back_off_loudly() -> None:
    from workers.management.commands.standalone import Child, Command

    err = StringIO()
    command = Command(stdout=StringIO(), stderr=err)
    child = Child("beat", ["beat"], started_at=100.0)
    for crash in range(6):
        command._schedule_restart(child, 4000 + crash, -9, now=100.5)
    lines = err.getvalue().splitlines()
    assert lines[0] == "beat (pid 4000) was killed by SIGKILL (signal 9); restarting beat in 1 s."
    assert "(2 crashes in a row); restarting beat in 2 s." in lines[1]
    assert "(6 crashes in a row); restarting beat in 30 s." in lines[-2]
    assert lines[-1].startswith("beat keeps crashing: its output above says why.")
    assert child.process is None and child.restart_at == 130.5


def test_a_second_standalone_on_the_same_var_dir_is_refused(tmp_path: Path) -> None:
    """One standalone per var dir on the embedded default: the lock is held here as a
    running standalone holds it, and a second one on another port stops before it
    migrates or starts anything, naming the holder."""
    var = tmp_path / "var"
    var.mkdir()
    with (var / "standalone.lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        env = _embedded_env(var)
        env["DJFLOW_ADDR"] = f"127.0.0.1:{_free_port()}"
        done = _manage(env, "standalone")
    assert done.returncode != 0
    assert f"another standalone (pid 4242) runs on {var}" in done.stderr, done.stderr
    assert "Started" not in done.stdout, done.stdout
    assert not (var / "db.sqlite3").exists()  # not even migrated
