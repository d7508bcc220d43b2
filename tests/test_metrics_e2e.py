"""GET /metrics on real processes: a prefork worker's pool children run the steps and count
them into the metric files, and gunicorn (two workers, ``config.gunicorn``'s hooks) adds them
up over real HTTP."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from config import metrics_files
from runs import services
from runs.models import Run
from tests.processes import CeleryProcess, gunicorn_argv, wait_for
from tests.scrape import samples

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.flows_metrics"]
TOKEN = "e2e-scrape-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


def test_counts_by_workflow_and_status_scraped_from_gunicorn_while_worker_children_ran_them(
    celery_worker, celery_processes, tmp_path: Path
) -> None:
    root = tmp_path / "metrics"
    extra = {"DJFLOW_METRICS_DIR": str(root), "DJFLOW_METRICS_TOKEN": TOKEN}
    worker = celery_worker(workflow_modules=FLOWS, env=extra, concurrency=2)
    port = _free_port()
    web = CeleryProcess(
        kind="web",
        argv=gunicorn_argv(port, workers=2),
        env=celery_processes.env(env=extra),
        log_path=tmp_path / "gunicorn.log",
    )
    celery_processes.processes.append(web.start())
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: _get(url)[0], timeout=30, interval=0.2, message=web.logs)

    ids = [services.run_start(workflow="metered_ok", input={}).run.id for _ in range(3)]
    ids += [services.run_start(workflow="metered_fail", input={}).run.id for _ in range(2)]
    wait_for(
        lambda: Run.objects.filter(id__in=ids, status__in=["completed", "failed"]).count() == 5,
        timeout=60,
        interval=0.1,
        message=celery_processes.logs,
    )
    assert sorted(Run.objects.filter(id__in=ids).values_list("status", flat=True)) == [
        "completed",
        "completed",
        "completed",
        "failed",
        "failed",
    ]

    # The token is enforced over HTTP too.
    assert _get(url)[0] == 401
    assert _get(url, "another-token-0123456789abcdef")[0] == 401

    def ends(found: dict) -> dict:
        return {
            tuple(labels): value
            for (name, labels), value in found.items()
            if name == "djflow_workflow_executions_total"
        }

    expected_ends = {
        (("status", "completed"), ("workflow", "metered_ok")): 3.0,
        (("status", "failed"), ("workflow", "metered_fail")): 2.0,
    }

    def scraped() -> dict | None:
        status, body = _get(url, TOKEN)
        assert status == 200, body[:500]
        found = samples(body)
        # Counted after each commit: the last may land a moment after its run shows ended.
        return found if ends(found) == expected_ends else None

    found = wait_for(scraped, timeout=10, interval=0.2, message=celery_processes.logs)
    ok, fail = ("workflow", "metered_ok"), ("workflow", "metered_fail")
    attempts = {
        labels: value
        for (name, labels), value in found.items()
        if name == "djflow_step_attempts_total"
    }
    assert attempts == {
        (("error_class", ""), ("kind", "task"), ("status", "succeeded"), ok): 3.0,
        (("error_class", "fatal"), ("kind", "task"), ("status", "failed"), fail): 2.0,
    }
    assert found[("djflow_workflow_duration_seconds_count", (("status", "completed"), ok))] == 3
    assert found[("djflow_workflow_duration_seconds_count", (("status", "failed"), fail))] == 2
    assert found[("djflow_step_duration_seconds_count", (("kind", "task"), ok))] == 3
    model = (("model", "claude-sonnet-4"), ("provider", "anthropic"))
    assert found[("djflow_model_tokens_total", (("direction", "input"), *model))] == 300
    assert found[("djflow_model_tokens_total", (("direction", "output"), *model))] == 30
    # claude-sonnet-4 at $3/$15 per million tokens: 3 * (100 * 3e-6 + 10 * 15e-6)
    assert found[("djflow_cost_usd_total", (ok,))] == pytest.approx(0.00135)
    assert found[("djflow_runs", (("status", "running"),))] == 0
    assert found[("djflow_scrape_error", (("source", "broker"),))] == 0

    # Whichever gunicorn worker answers adds up the same files.
    for _ in range(4):
        assert ends(samples(_get(url, TOKEN)[1])) == expected_ends
    # The steps were counted by the worker's pool children, in this host's folder.
    counted_by = {
        metrics_files.pid_of(path) for path in metrics_files.host_folder(root).glob("counter_*.db")
    }
    assert counted_by & set(worker.child_pids()), (counted_by, worker.child_pids())
