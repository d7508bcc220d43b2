"""The Celery app. Settings live in ``config.settings`` under the ``CELERY_`` namespace."""

import logging
import os

from celery import Celery
from celery.signals import beat_init, task_prerun, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

logger = logging.getLogger(__name__)

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def save_workflow_modules(**_: object) -> None:
    """Import ``WORKFLOW_MODULES`` and save their builders' documents before the pool
    starts: forked pool processes inherit the registered handlers, and a document that
    fails validation stops the worker instead of running stale code."""
    from django.conf import settings

    from workflows.sdk import sync_modules

    for workflow_id, result in sync_modules(settings.WORKFLOW_MODULES):
        state = "created" if result.created else "unchanged"
        logger.info("workflow %s v%s %s", workflow_id, result.version.number, state)


@beat_init.connect
def install_beat_entries(**_: object) -> None:
    """Make sure the engine's beat entries exist before beat reads its schedule."""
    from django.conf import settings
    from django.db import transaction
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from runs.beat import install_beat_entries as install

    with transaction.atomic():
        install(IntervalSchedule, PeriodicTask, settings.DJFLOW["RECONCILE_SECONDS"])


@task_prerun.connect
def recycle_database_connections(**_: object) -> None:
    """What Django does at the start of each request: drop a connection that errored or
    outlived CONN_MAX_AGE, and health-check the one kept before its first use."""
    from django.db import close_old_connections

    close_old_connections()
