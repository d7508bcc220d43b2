"""Security review of ``manage.py run_replay`` (CONTRACT section 16): what a replay may touch
besides its private SQLite database, and what a crafted export may do. Each test was a
finding, fixed: R1 a connection to the deployment's Redis (model-call slots), R2 its metric
files, R3 a malformed export's exit 1, R4 a crafted loop replaying for hours, R5 and R6 runs
with typed secrets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from runs import export

from .flows_replay import graded

BASE = Path(__file__).resolve().parents[2]


def _exported(run_id: Any, folder: Path) -> Path:
    path = folder / "run.json"
    path.write_text("".join(export.run_export(run_id=run_id).chunks()), encoding="utf-8")
    return path


def _replay(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "run_replay", *map(str, args)],
        cwd=BASE,
        env={**os.environ, "WORKFLOW_MODULES": "", **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


class Listener:
    """A loopback TCP server that only counts the connections it is offered."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(2)
        self.sock.close()


def _replayed_graded(djflow: Any, tmp_path: Path) -> tuple[int, Path, str]:
    """Replay a run of a task and a recipe step offline, its Redis URLs pointing at a
    loopback listener and its DJFLOW_VAR_DIR in tmp_path: (connections, var folder, out)."""
    djflow.model(reply="Hello!")
    run = djflow.start(graded, input={"q": "refund please"})
    assert run.status == "completed", run.error
    path = _exported(run.id, tmp_path)
    var = tmp_path / "var"
    listener = Listener()
    try:
        redis_url = f"redis://127.0.0.1:{listener.port}/0"
        done = _replay(
            path,
            "--json",
            env={
                "CELERY_BROKER_URL": redis_url,
                "CELERY_RESULT_BACKEND": redis_url.replace("/0", "/1"),
                "DJFLOW_VAR_DIR": str(var),
            },
        )
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr + done.stdout
    return listener.connections, var, done.stderr


def test_an_offline_replay_opens_no_connection_to_the_deployments_redis(djflow, tmp_path) -> None:
    connections, _, stderr = _replayed_graded(djflow, tmp_path)
    assert connections == 0, stderr[-1500:]


def test_an_offline_replay_writes_nothing_to_the_deployments_metrics(djflow, tmp_path) -> None:
    from prometheus_client.mmap_dict import MmapedDict

    _, var, _ = _replayed_graded(djflow, tmp_path)
    # What a scrape of the deployment reads: before the fix, e.g.
    # djflow_workflow_executions_total{status="completed",workflow="rp_graded"} 1 and
    # djflow_cost_usd_total{workflow="rp_graded"}: the replay counted as a real run. (A
    # counter without labels is made, at 0, when its module is imported, before the command
    # runs: a zero counts nothing.)
    counted = [
        (key, value)
        for path in (var / "metrics").rglob("*.db")
        for key, value, _ in MmapedDict(str(path), read_mode=True).read_all_values()
        if value
    ]
    assert counted == []


def _export_of_trivial_run(djflow: Any, tmp_path: Path) -> dict[str, Any]:
    from workflows.sdk import workflow

    tiny = workflow("atk_tiny")
    tiny.sleep("nap", ms=1000)
    run = djflow.start(tiny)
    djflow.advance(2)
    assert run.status == "completed", run.error
    return json.loads(_exported(run.id, tmp_path).read_text())


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data["run"].pop("workflow"),
        lambda data: data["run"].update(steps=[{"id": "x"}]),
        lambda data: data.update(documents=[{"workflow": "atk_tiny"}]),
        lambda data: data["run"].update(status=["completed"]),
    ],
)
def test_a_malformed_export_is_exit_3(djflow, tmp_path, damage) -> None:
    data = _export_of_trivial_run(djflow, tmp_path)
    damage(data)
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(data))
    done = _replay(path)
    assert done.returncode == 3, (done.returncode, done.stderr[-800:])
    assert "Traceback" not in done.stderr


def test_a_crafted_unbounded_loop_does_not_hang_the_replay(djflow, tmp_path) -> None:
    data = _export_of_trivial_run(djflow, tmp_path)
    for entry in data["documents"]:
        entry["document"]["limits"] = {"max_steps": 10**9, "run_timeout_ms": 10**13}
        entry["document"]["steps"] = [
            {
                "id": "again",
                "kind": "loop",
                "max_iterations": 10**8,  # a save refuses over 10,000
                "do": {"id": "nap", "kind": "sleep", "ms": 1000},
                "until": {"path": "input.never", "op": "eq", "value": True},
            }
        ]
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(data))
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", "run_replay", str(path)],
            cwd=BASE,
            env={**os.environ, "WORKFLOW_MODULES": ""},
            capture_output=True,
            text=True,
            timeout=40,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the replay of a crafted export was still running after 40 s")
    assert done.returncode == 3, done.stderr[-800:]


# --- a replay of an export whose secrets are masked ------------------------------------------

from workflows.sdk import workflow  # noqa: E402

pinned = workflow(
    "atk_pinned",
    input_schema={
        "type": "object",
        "properties": {
            "who": {"type": "string"},
            "pin": {"type": "integer", "writeOnly": True},
            "token": {"type": "string", "writeOnly": True, "pattern": "^tok-"},
        },
        "required": ["who", "pin", "token"],
    },
)
pinned.task("check", input={"who": "${input.who}", "pin": "${input.pin}"})
pinned.output({"ok": "${steps.check.output}"})


@pinned.handler("check")
def check(ctx: Any, input: Any, prior: Any) -> Any:
    return input["who"]


def test_a_run_with_typed_secrets_replays_from_its_export(djflow, tmp_path) -> None:
    run = djflow.start(pinned, input={"who": "ann", "pin": 123456, "token": "tok-abc"})
    assert run.status == "completed", run.error
    done = _replay(_exported(run.id, tmp_path))
    assert done.returncode == 0, done.stderr[-800:] + done.stdout[-800:]


def test_secrets_given_again_replay_and_are_never_printed(djflow, tmp_path) -> None:
    run = djflow.start(pinned, input={"who": "ann", "pin": 987654, "token": "tok-abc"})
    given = json.dumps({"who": "ann", "pin": 987654, "token": "tok-abc"})
    done = _replay(_exported(run.id, tmp_path), "--input", given, "--json")
    assert "987654" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    # The step reading the pin was recorded with '••••' and now gets 987654: a miss (2) is
    # the most a replay can say here; 0 if the replay compares secrets as masked.
    assert done.returncode in (0, 2), done.stdout[-1500:]
