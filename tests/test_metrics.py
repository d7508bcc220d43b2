"""GET /metrics without worker processes: who may scrape, the gauges read at scrape time, that
counting happens after commit and never fails a step, and the metric files' housekeeping.
tests/test_metrics_e2e.py scrapes gunicorn while real worker children run the steps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone
from prometheus_client import REGISTRY

from config import metrics as scrape
from config import metrics_files
from config.celery import app
from runs import metrics, services
from runs.models import Run, StepRun
from tests.processes import purge_broker
from tests.scrape import samples
from workers.execution import execute
from workflows.sync import sync_modules

TOKEN = "scrape-token-0123456789abcdef"
FLOWS = ["tests.flows_metrics"]
BASE_DIR = Path(__file__).resolve().parent.parent


def value(name: str, **labels: str) -> float:
    """This process's own value of a sample (0 when it has none yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- Who may scrape ------------------------------------------------------------------------


@pytest.fixture
def token(settings):
    settings.DJFLOW_METRICS_TOKEN = TOKEN
    return TOKEN


@pytest.mark.django_db
def test_with_a_token_set_a_scrape_without_it_or_with_another_is_401(token) -> None:
    client = Client()
    for headers in (
        {},
        {"HTTP_AUTHORIZATION": "Bearer wrong-token-0123456789abcdef"},
        {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}x"},
        {"HTTP_AUTHORIZATION": f"Basic {TOKEN}"},
        {"HTTP_AUTHORIZATION": TOKEN},
    ):
        response = client.get("/metrics", **headers)
        assert response.status_code == 401, headers
        assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
        assert b"djflow_" not in response.content
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE djflow_runs gauge" in response.content
    # The scheme is case-insensitive (RFC 9110); the method must be GET or HEAD.
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


@pytest.mark.django_db
def test_without_a_token_only_the_embedded_default_answers_and_only_to_this_machine(
    settings,
) -> None:
    settings.DJFLOW_METRICS_TOKEN = ""
    client = Client()
    # Postgres and Redis (these tests): never open, whoever asks.
    settings.EMBEDDED = False
    response = client.get("/metrics", REMOTE_ADDR="127.0.0.1")
    assert response.status_code == 403
    assert b"DJFLOW_METRICS_TOKEN" in response.content
    settings.EMBEDDED = True
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 403
    # A proxy on this machine that nobody declared: every request looks local, so a request
    # a proxy passed on is refused.
    for header in ("HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_REAL_IP", "HTTP_VIA"):
        forwarded = client.get("/metrics", REMOTE_ADDR="127.0.0.1", **{header: "203.0.113.9"})
        assert forwarded.status_code == 403, header
    # Behind a proxy every request comes from the proxy's address: loopback proves nothing.
    settings.DJFLOW_TRUSTED_PROXIES = 1
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 403


def test_the_tests_count_into_a_metrics_folder_of_their_own() -> None:
    """The suite's metric files went to the checkout's var/metrics, where a standalone started
    from the same checkout reads its /metrics (issue 37): the tests have var/tests."""
    from django.conf import settings

    checkout_var = (settings.BASE_DIR / "var").resolve()
    folder = metrics_files.this_host()
    assert folder is not None and folder.is_absolute()
    assert folder.is_relative_to(settings.DJFLOW_METRICS_DIR.resolve())
    assert not folder.is_relative_to(checkout_var / "metrics")
    # The processes the tests start find the same folders from any working directory.
    assert Path(os.environ["DJFLOW_VAR_DIR"]).is_absolute()


def test_a_short_token_refuses_to_start(tmp_path) -> None:
    env = {**os.environ, "DJFLOW_METRICS_TOKEN": "short", "DJFLOW_VAR_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=BASE_DIR,
        env={**env, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "DJFLOW_METRICS_TOKEN must be at least 16 characters" in done.stderr


# --- Gauges read at scrape time ------------------------------------------------------------


@pytest.fixture
def flows(db) -> None:
    sync_modules(FLOWS)


def _scrape(client: Client) -> dict:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    return samples(response.content)


@pytest.mark.django_db
def test_unfinished_runs_timers_due_and_queue_depths_are_read_at_scrape_time(flows, token) -> None:
    client = Client()
    before = _scrape(client)
    assert before[("djflow_runs", (("status", "running"),))] == 0
    runs = [services.run_start(workflow="metered_ok", input={}).run for _ in range(2)]
    assert {run.status for run in Run.objects.filter(id__in=[r.id for r in runs])} == {"running"}
    # A timer an hour overdue: the clock is behind by that much.
    from runs.models import Timer

    Timer.objects.create(
        run=runs[0],
        key="late",
        purpose="sleep",
        fire_at=timezone.now() - timedelta(hours=1),
    )
    purge_broker()
    try:
        for _ in range(3):
            app.send_task("approvals.send_mail", args=[0], queue="mail")
        after = _scrape(client)
    finally:
        purge_broker()
    assert after[("djflow_runs", (("status", "running"),))] == 2
    assert after[("djflow_runs", (("status", "pending"),))] == 0
    # Finished runs are counted by the counters, not here.
    assert not any(
        name == "djflow_runs" and dict(labels)["status"] == "completed" for name, labels in after
    )
    assert after[("djflow_timers_due", ())] == 1
    assert 3590 <= after[("djflow_timer_lag_seconds", ())] <= 3700
    assert after[("djflow_queue_depth", (("queue", "mail"),))] == 3
    assert after[("djflow_queue_depth", (("queue", "engine"),))] == 0
    assert after[("djflow_approvals_pending", ())] == 0
    assert after[("djflow_scrape_error", (("source", "broker"),))] == 0
    assert after[("djflow_scrape_error", (("source", "database"),))] == 0


@pytest.mark.django_db
def test_accounts_budgets_and_spend_are_read_at_scrape_time(token) -> None:
    from decimal import Decimal

    from runs.models import Account

    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    Account.objects.create(
        name="support",
        budget_usd=Decimal("25"),
        period="day",
        period_start=midnight,
        spent_usd=Decimal("3.5"),
        reserved_usd=Decimal("0.25"),
    )
    # Yesterday's spend of a daily budget no call has reset yet: today it spent nothing.
    Account.objects.create(
        name="stale",
        budget_usd=Decimal("10"),
        period="day",
        period_start=midnight - timedelta(days=1),
        spent_usd=Decimal("9"),
    )
    Account.objects.create(name="nocap", budget_usd=None, period="", period_start=midnight)
    scraped = _scrape(Client())
    assert scraped[("djflow_account_budget_usd", (("account", "support"),))] == 25
    assert scraped[("djflow_account_spent_usd", (("account", "support"),))] == 3.5
    assert scraped[("djflow_account_reserved_usd", (("account", "support"),))] == 0.25
    assert scraped[("djflow_account_spent_usd", (("account", "stale"),))] == 0
    assert ("djflow_account_budget_usd", (("account", "nocap"),)) not in scraped
    assert scraped[("djflow_account_spent_usd", (("account", "nocap"),))] == 0


@pytest.mark.django_db
def test_a_source_that_fails_is_left_out_and_said_not_a_failed_scrape(
    token, monkeypatch, caplog
) -> None:
    def down(self):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(scrape.BrokerCollector, "_depths", down)
    found = _scrape(Client())
    assert found[("djflow_scrape_error", (("source", "broker"),))] == 1
    assert found[("djflow_scrape_error", (("source", "database"),))] == 0
    assert not any(name == "djflow_queue_depth" for name, _ in found)
    assert ("djflow_runs", (("status", "running"),)) in found
    assert "reading the broker failed" in caplog.text


# --- Counting: after commit, never failing what it counts ---------------------------------


def _run_one(workflow: str, capture) -> Run:
    run = services.run_start(workflow=workflow, input={}).run
    with capture(execute=True):
        execute(StepRun.objects.get(run=run, status="scheduled").id, worker="here")
    return Run.objects.get(id=run.id)


@pytest.mark.django_db
def test_a_run_end_and_its_attempt_are_counted_with_their_labels(
    flows, django_capture_on_commit_callbacks
) -> None:
    ended = value("djflow_workflow_executions_total", workflow="metered_fail", status="failed")
    attempts = value(
        "djflow_step_attempts_total",
        workflow="metered_fail",
        kind="task",
        status="failed",
        error_class="fatal",
    )
    tokens = value(
        "djflow_model_tokens_total",
        provider="anthropic",
        model="claude-sonnet-4",
        direction="input",
    )
    cost = value("djflow_cost_usd_total", workflow="metered_ok")
    assert _run_one("metered_fail", django_capture_on_commit_callbacks).status == "failed"
    assert _run_one("metered_ok", django_capture_on_commit_callbacks).status == "completed"
    assert (
        value("djflow_workflow_executions_total", workflow="metered_fail", status="failed")
        == ended + 1
    )
    assert (
        value(
            "djflow_step_attempts_total",
            workflow="metered_fail",
            kind="task",
            status="failed",
            error_class="fatal",
        )
        == attempts + 1
    )
    assert (
        value(
            "djflow_model_tokens_total",
            provider="anthropic",
            model="claude-sonnet-4",
            direction="input",
        )
        == tokens + 100
    )
    # claude-sonnet-4 at $3/$15 per million tokens: 100 * 3e-6 + 10 * 15e-6
    assert value("djflow_cost_usd_total", workflow="metered_ok") == pytest.approx(cost + 0.00045)


@pytest.mark.django_db
def test_a_metric_that_fails_fails_no_step_and_no_run(
    flows, django_capture_on_commit_callbacks, monkeypatch, caplog
) -> None:
    def broken(**labels):
        raise RuntimeError("the metric files are gone")

    monkeypatch.setattr(metrics.STEP_ATTEMPTS, "labels", broken)
    monkeypatch.setattr(metrics.WORKFLOW_EXECUTIONS, "labels", broken)
    monkeypatch.setattr(metrics.MODEL_TOKENS, "labels", broken)
    with caplog.at_level(logging.WARNING, logger="runs.metrics"):
        run = _run_one("metered_ok", django_capture_on_commit_callbacks)
    assert run.status == "completed", run.error
    assert run.steps.get().status == "succeeded"
    assert caplog.text.count("the metric files are gone") >= 2


@pytest.mark.django_db
def test_an_end_rolled_back_is_not_counted(django_capture_on_commit_callbacks) -> None:
    before = value("djflow_workflow_executions_total", workflow="rolled", status="completed")
    now = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            metrics.run_ended(
                workflow="rolled", status="completed", started_at=now, finished_at=now
            )
            raise RuntimeError("the end's transaction failed")
        metrics.run_ended(workflow="rolled", status="completed", started_at=now, finished_at=now)
    assert value("djflow_workflow_executions_total", workflow="rolled", status="completed") == (
        before + 1
    )


def test_error_classes_are_a_bounded_label() -> None:
    assert metrics.error_class(None) == ""
    assert metrics.error_class({"class": "retryable"}) == "retryable"
    assert metrics.error_class({"class": "timeout", "message": "x"}) == "timeout"
    assert metrics.error_class({"class": "MyOwnError"}) == "other"
    assert metrics.error_class({"message": "no class"}) == "other"


# --- The metric files ---------------------------------------------------------------------


def _gone_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_a_master_removes_the_files_of_its_hosts_processes_that_are_gone(tmp_path) -> None:
    gone, live = _gone_pid(), os.getppid()
    folder = tmp_path / "host"
    folder.mkdir()
    for name in (
        f"counter_{gone}.db",
        f"gauge_livesum_{gone}.db",
        f"counter_{live}.db",
        "other.db",
    ):
        (folder / name).write_bytes(b"")
    assert metrics_files.remove_gone(folder) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"counter_{live}.db", "other.db"])


def test_a_scrape_reads_every_hosts_files_less_its_own_gone_live_gauges(
    tmp_path, monkeypatch
) -> None:
    gone, live = _gone_pid(), os.getppid()
    own, other = tmp_path / "web-1", tmp_path / "worker-1"
    retired, silent = tmp_path / "worker-old", tmp_path / "worker-unmarked"
    for folder in (own, other, retired, silent):
        folder.mkdir()
    monkeypatch.setenv(metrics_files.ENV, str(own))
    kept = [
        own / f"counter_{gone}.db",
        own / f"gauge_livesum_{live}.db",
        # Another host's process ids mean nothing here: its files are read as they are,
        # while its workers beat (their heartbeat touches the mark).
        other / f"gauge_livesum_{gone}.db",
        other / f"counter_{gone}.db",
        # A host whose workers stopped beating: its counts stay (counters never go down)...
        retired / f"counter_{gone}.db",
        silent / f"counter_{gone}.db",
    ]
    # ... but not what it had in flight, which ended with it; left in place, not removed.
    skipped = [retired / f"gauge_livesum_{gone}.db", silent / f"gauge_livesum_{gone}.db"]
    dropped = own / f"gauge_livesum_{gone}.db"
    for path in [*kept, *skipped, dropped]:
        path.write_bytes(b"")
    (other / metrics_files.ALIVE_MARK).touch()
    (retired / metrics_files.ALIVE_MARK).touch()
    an_hour_ago = time.time() - 3600
    os.utime(retired / metrics_files.ALIVE_MARK, (an_hour_ago, an_hour_ago))
    found = metrics_files.files_to_read(tmp_path, live_window=15)
    assert sorted(found) == sorted(str(p) for p in kept)
    assert not dropped.exists()
    assert all(path.exists() for path in skipped)
    # The mark is this host's workers' heartbeat.
    monkeypatch.setenv(metrics_files.ENV, str(retired))
    metrics_files.mark_host_alive()
    monkeypatch.setenv(metrics_files.ENV, str(own))
    assert str(skipped[0]) in metrics_files.files_to_read(tmp_path, live_window=15)


def test_gunicorns_and_celerys_hooks_clean_at_a_masters_start_and_at_a_childs_end(
    tmp_path, monkeypatch, settings
) -> None:
    from config import gunicorn
    from config.celery import clean_metric_files, end_metrics_of_process

    gone, child = _gone_pid(), os.getpid()
    settings.METRICS_HOST_DIR = tmp_path
    monkeypatch.setenv(metrics_files.ENV, str(tmp_path))

    def files() -> set[str]:
        return {path.name for path in tmp_path.iterdir()}

    for starting in (lambda: gunicorn.on_starting(None), lambda: clean_metric_files(sender=None)):
        (tmp_path / f"counter_{gone}.db").write_bytes(b"")
        (tmp_path / f"counter_{child}.db").write_bytes(b"")
        starting()
        assert files() == {f"counter_{child}.db"}
    # A child that ends keeps its counts and takes its live gauges with it.
    for ending in (
        lambda: gunicorn.child_exit(None, type("Worker", (), {"pid": child})()),
        lambda: end_metrics_of_process(pid=child, exitcode=0),
    ):
        (tmp_path / f"gauge_livesum_{child}.db").write_bytes(b"")
        ending()
        assert files() == {f"counter_{child}.db"}


def test_a_childs_end_raises_nothing_when_its_live_gauges_went_first(tmp_path, monkeypatch) -> None:
    """A scrape removes a gone process's live gauges too (files_to_read): if it does so between
    the hook's finding the file and removing it, the hook must not raise. An exception out of
    gunicorn's child_exit leaves the arbiter's main loop, and the master exits."""
    from prometheus_client import multiprocess

    from config import gunicorn

    gone, host = _gone_pid(), tmp_path / "web-1"
    host.mkdir()
    monkeypatch.setenv(metrics_files.ENV, str(host))
    live_gauge = host / f"gauge_livesum_{gone}.db"
    live_gauge.write_bytes(b"")

    def found_then_removed_by_a_scrape(pattern: str) -> list[str]:
        found = [str(live_gauge)] if live_gauge.exists() and "livesum" in pattern else []
        assert metrics_files.files_to_read(tmp_path) == []
        return found

    monkeypatch.setattr(multiprocess, "glob", SimpleNamespace(glob=found_then_removed_by_a_scrape))
    gunicorn.child_exit(None, type("Worker", (), {"pid": gone})())
    assert not live_gauge.exists()


def test_the_settings_export_this_hosts_folder_before_the_client_is_imported(tmp_path) -> None:
    probe = (
        "import os, django; django.setup(); "
        "from prometheus_client import values; from runs import metrics; "
        "print(os.environ['PROMETHEUS_MULTIPROC_DIR']); "
        "print(values.ValueClass._multiprocess)"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJFLOW_METRICS_DIR": str(tmp_path / "m"),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    folder, multiprocess = done.stdout.split()
    assert Path(folder) == metrics_files.host_folder(tmp_path / "m")
    assert Path(folder).is_dir()
    assert multiprocess == "True"


def test_turned_off_nothing_is_counted_or_served_and_values_stay_in_memory(
    settings, token, tmp_path, django_capture_on_commit_callbacks
) -> None:
    settings.DJFLOW_METRICS_ENABLED = False
    before = value("djflow_workflow_executions_total", workflow="off", status="completed")
    now = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        metrics.run_ended(workflow="off", status="completed", started_at=now, finished_at=now)
    assert value("djflow_workflow_executions_total", workflow="off", status="completed") == before
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 404
    # A process started with it off does not write files, even under a parent that did.
    probe = (
        "import os, django; django.setup(); "
        "from prometheus_client import values; from runs import metrics; "
        "print(os.environ.get('PROMETHEUS_MULTIPROC_DIR')); "
        "print(getattr(values.ValueClass, '_multiprocess', False))"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJFLOW_METRICS": "false",
        "DJFLOW_METRICS_DIR": str(tmp_path / "m"),
        metrics_files.ENV: str(tmp_path / "inherited"),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "False"]
    assert not (tmp_path / "m").exists()
    # ... also when the client was imported before the settings turned metrics off (Celery's
    # command line imports plug-ins first): a worker so started used to fail at once, its
    # metrics looking for the folder the settings had just unnamed.
    early = (
        "import prometheus_client, django; django.setup(); "
        "from prometheus_client import values; from runs import metrics; "
        "metrics.WORKFLOW_EXECUTIONS.labels(workflow='w', status='completed').inc(); "
        "print(getattr(values.ValueClass, '_multiprocess', False))"
    )
    done = subprocess.run(
        [sys.executable, "-c", early],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    assert not (tmp_path / "inherited").exists()


def test_a_file_removed_between_listing_and_reading_is_listed_again(tmp_path, monkeypatch) -> None:
    """A master's start removes the files of its host's processes that are gone: a scrape
    that listed one of them reads the folder again instead of failing (a 500 seen once in
    the suite, FileNotFoundError on a histogram_<pid>.db another process had removed)."""
    listings: list[list[str]] = []
    real = metrics_files.files_to_read

    def listing(root: Path, *, live_window: float = 15.0) -> list[str]:
        found = real(root, live_window=live_window)
        # The first listing names a file that is gone by the time it is read.
        listings.append(found)
        return [*found, str(tmp_path / "counter_999999.db")] if len(listings) == 1 else found

    monkeypatch.setattr(metrics_files, "files_to_read", listing)
    list(scrape.FilesCollector().collect())
    assert len(listings) == 2
    # Gone at every listing: the scrape fails after SCRAPE_TRIES listings, never loops.
    monkeypatch.setattr(
        metrics_files,
        "files_to_read",
        lambda root, live_window=15.0: [str(tmp_path / "counter_999998.db")],
    )
    with pytest.raises(FileNotFoundError):
        list(scrape.FilesCollector().collect())
