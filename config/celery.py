"""The Celery app. Settings live in ``config.settings`` under the ``CELERY_`` namespace."""

import logging
import os
from functools import cached_property
from types import FrameType
from typing import Any

from celery import Celery, platforms
from celery.apps.beat import Beat as CeleryBeat
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    beat_init,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

logger = logging.getLogger(__name__)


def _stop_between_ticks(service: Any) -> None:
    """SIGTERM and SIGINT end beat's loop after its current pass, instead of saving the
    schedule inside the signal handler as Celery's own handler does.

    DatabaseScheduler queries the database on every pass (and when it is built, and our
    ``beat_init`` receivers write the engine's entries); a signal landing during such a query
    ran Celery's handler on top of it, whose save waited for the connection's lock, held by
    the interrupted query: beat hung until SIGKILL (seen as a 10 s stop in tests, and a
    deploy's kill timeout in production). Here the handler only sets the service's shutdown
    flag; the loop ends after its sleep (a second with the engine's 1 s tick), or before its
    first pass, and the service saves the schedule on its way out, with no query interrupted.

    A second signal leaves at once, as Celery's handler did (SystemExit; psycopg cancels a
    query it interrupts): a pass can be stuck for long, e.g. sending to a broker that is
    down (Celery retries the connection up to 100 times, about 46 minutes).
    """
    asked: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if asked:
            raise SystemExit()
        asked.append(signum)
        service.stop(wait=False)

    platforms.signals.update(SIGTERM=stop, SIGINT=stop)


class Beat(CeleryBeat):
    """``celery beat``: the handlers above from the start, in place of Celery's.

    Installing them from a ``beat_init`` receiver left a window: the service builds its
    scheduler (queries) and sends ``beat_init`` (our receivers write entries) with Celery's
    saving handler in place, and a stop landing there hung (CI, test_beat_starts_..._stops).
    """

    def install_sync_handler(self, service: Any) -> None:
        _stop_between_ticks(service)


class App(Celery):
    @cached_property
    def Beat(self) -> Any:  # Celery's name for it
        return self.subclass_with_self(Beat)


app = App("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Each worker writes which handlers it serves (by name: loaded once Django is set up).
app.steps["worker"].add("workers.heartbeat:Heartbeat")


@worker_init.connect
def save_workflow_modules(**_: object) -> None:
    """Import ``WORKFLOW_MODULES`` and save their builders' documents before the pool
    starts: forked pool processes inherit the registered handlers, and a document that
    fails validation stops the worker instead of running stale code."""
    from django.conf import settings

    from workflows.sync import sync_modules

    for workflow_id, result in sync_modules(settings.WORKFLOW_MODULES):
        state = "created" if result.created else "unchanged"
        logger.info("workflow %s v%s %s", workflow_id, result.version.number, state)


@worker_init.connect
def clean_metric_files(**_: object) -> None:
    """The worker's master, before its pool starts: remove the metric files of this host's
    processes that are gone (config.metrics_files)."""
    from django.conf import settings

    from config import metrics_files

    metrics_files.remove_gone(settings.METRICS_HOST_DIR)


@worker_process_shutdown.connect
def end_metrics_of_process(**_: object) -> None:
    """A pool process ends: its live gauges (model calls in flight) end with it."""
    from config import metrics_files

    metrics_files.process_ended(os.getpid())


@beat_init.connect
def install_beat_entries(**_: object) -> None:
    """Make sure the engine's beat entries exist before beat reads its schedule."""
    from django.conf import settings
    from django.db import transaction
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from runs.beat import install_beat_entries as install
    from runs.dispatch import broker_priority
    from schedules.beat import install_beat_entry as install_schedules

    with transaction.atomic():
        install(
            IntervalSchedule,
            PeriodicTask,
            settings.DJFLOW["RECONCILE_SECONDS"],
            settings.DJFLOW["RETENTION_EVERY_SECONDS"],
            clock_priority=broker_priority(9),
        )
        install_schedules(IntervalSchedule, PeriodicTask, settings.DJFLOW["RECONCILE_SECONDS"])


@task_prerun.connect
def recycle_database_connections(**_: object) -> None:
    """What Django does at the start of each request: drop a connection that errored or
    outlived CONN_MAX_AGE, and health-check the one kept before its first use."""
    from django.db import close_old_connections

    close_old_connections()


@worker_process_init.connect
def trace_pool_process(**_: object) -> None:
    """Tracing in each prefork pool process, after the fork (config.tracing)."""
    from config import tracing

    tracing.setup("worker")


@worker_init.connect
def trace_unforked_worker(sender: Any = None, **_: object) -> None:
    """Tracing in the worker's own process when its pool does not fork (solo, threads):
    there the tasks run in this process and no ``worker_process_init`` comes."""
    from config import tracing

    if "prefork" not in str(getattr(sender, "pool_cls", "prefork")).lower():
        tracing.setup("worker")


@beat_init.connect
def trace_beat(**_: object) -> None:
    from config import tracing

    tracing.setup("beat")


@worker_process_shutdown.connect
@worker_shutdown.connect
def flush_traces(**_: object) -> None:
    """Export the spans still queued before the process ends."""
    from config import tracing

    tracing.shutdown()


@after_setup_logger.connect
@after_setup_task_logger.connect
def json_log_lines(logger: logging.Logger | None = None, **_: object) -> None:
    """Celery replaces the root logger's handlers (and sets the task logger's) after Django
    configured logging: with DJFLOW_LOG_FORMAT=json, theirs write JSON lines too."""
    from django.conf import settings

    from config.logging import use_json

    if logger is not None and settings.LOG_FORMAT == "json":
        use_json(logger)
