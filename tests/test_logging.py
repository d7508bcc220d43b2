"""The engine's clock stays out of the logs (config.logging, runs.tasks); the rest stays in.

Records go through the loggers as settings.LOGGING configured them, emitted by Celery's own
functions where it has them. The same filter under a real ``celery worker -l info`` and
``celery beat -l info`` is tested by tests/test_standalone.py.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import pytest
from celery.app import trace
from django.utils import timezone

from runs import services
from runs.models import Timer
from runs.tasks import fire_timers, reconcile
from workflows.services import definition_save


def _succeeded(task: str, level: int = logging.INFO) -> None:
    context = {
        "id": str(uuid.uuid4()),
        "name": task,
        "return_value": 0,
        "runtime": 0.01,
        "description": "raised unexpected",
        "exc": "OperationalError('database is locked')",
    }
    if level == logging.INFO:
        trace.info(trace.LOG_SUCCESS, context)  # Celery's own call for "Task ... succeeded"
    else:
        trace.logger.log(level, trace.LOG_FAILURE, context, extra={"data": context})


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_celerys_lines_about_the_tick_and_the_reconciler_are_dropped(caplog) -> None:
    caplog.set_level(logging.INFO)
    _succeeded("runs.fire_timers")
    _succeeded("runs.reconcile")
    _succeeded("workers.sweep_kb_embeddings")
    logging.getLogger("celery.beat").info(
        "Scheduler: Sending due task %s (%s)", "djflow: fire timers", "runs.fire_timers"
    )
    logging.getLogger("celery.beat").info(
        "Scheduler: Sending due task %s (%s)",
        "djflow: embed knowledge-base documents a lost message left",
        "workers.sweep_kb_embeddings",
    )
    logging.getLogger("celery.worker.strategy").info(
        trace.LOG_RECEIVED, {"id": "1", "name": "runs.reconcile", "args": "", "kwargs": ""}
    )
    assert _messages(caplog) == []


def test_other_tasks_and_the_clocks_failures_still_show(caplog) -> None:
    caplog.set_level(logging.INFO)
    _succeeded("workers.execute_step")
    logging.getLogger("celery.beat").info(
        "Scheduler: Sending due task %s (%s)", "nightly", "reports.nightly"
    )
    _succeeded("runs.fire_timers", level=logging.ERROR)
    messages = _messages(caplog)
    assert len(messages) == 3, messages
    assert "workers.execute_step" in messages[0] and "succeeded" in messages[0]
    assert "reports.nightly" in messages[1]
    assert "runs.fire_timers" in messages[2] and "raised" in messages[2]


@pytest.mark.django_db
def test_an_idle_tick_and_reconciler_say_nothing_at_info(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="runs.tasks")
    assert fire_timers() == 0
    reconcile()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "runs.tasks"]
    assert said and all(level == logging.DEBUG for level, _ in said), said


@pytest.mark.django_db
def test_a_tick_that_fired_a_timer_says_so_at_info(caplog) -> None:
    definition_save(document={"id": "nap", "steps": [{"id": "z", "kind": "sleep", "ms": 60_000}]})
    run = services.run_start(workflow="nap", input={}).run
    Timer.objects.filter(run=run, fired_at__isnull=True).update(
        fire_at=timezone.now() - timedelta(milliseconds=1)
    )
    caplog.set_level(logging.INFO, logger="runs.tasks")
    assert fire_timers() >= 1
    assert any(
        r.name == "runs.tasks" and r.levelno == logging.INFO and "fired" in r.getMessage()
        for r in caplog.records
    ), caplog.records
