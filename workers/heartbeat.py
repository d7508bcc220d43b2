"""The worker's heartbeat: which handlers it serves, on which queues, written by its main
process (a bootstep of Celery's worker blueprint, ``config.celery``).

The first heartbeat is written when the step starts, before the consumer does: by the time
the worker answers a ping or takes a message, a run it serves may be started (the start
check in ``runs.services`` reads these rows). Then one every ``WORKER_HEARTBEAT_SECONDS`` on
the worker's timer (with Redis, the main process's event loop; with the file-system
transport, Celery's timer thread), and ``stopped_at`` at a clean shutdown, so that a handler
whose last worker stopped is known unserved at once rather than three beats later.

The handlers are the worker's registry (``WORKFLOW_MODULES``, imported at ``worker_init``
before any step starts); the queues are the ones it consumes (``-Q``, or every declared one).
A database error is logged and the next beat tries again: a worker that cannot write its
heartbeat cannot record steps either, and a few missed beats only make it look gone.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from celery import bootsteps
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from config import metrics_files
from runs.engine import unservable
from workflows import heartbeats, registry

logger = logging.getLogger(__name__)

# Rows of workers not seen this long are deleted when a worker starts (node names often
# carry a pid, so they pile up).
FORGET_AFTER = timedelta(days=7)


class Heartbeat(bootsteps.StartStopStep):
    """Writes this worker's heartbeat; ``config.celery`` adds it to the worker blueprint."""

    requires = ("celery.worker.components:Timer", "celery.worker.components:Pool")

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.timer_entry: Any = None
        self.started_at = timezone.now()

    def start(self, worker: Any) -> None:
        self.started_at = timezone.now()
        handlers, queues = registry.handler_names(), self._queues(worker)
        self._beat(worker.hostname, handlers, queues)
        self._housekeeping(handlers, queues)
        every = settings.DJFLOW["WORKER_HEARTBEAT_SECONDS"]
        self.timer_entry = worker.timer.call_repeatedly(
            every, self._beat, (worker.hostname, handlers, queues), priority=10
        )
        logger.info(
            "heartbeat of %s every %gs: %d handlers on queues %s",
            worker.hostname,
            every,
            len(handlers),
            ", ".join(queues),
        )

    def stop(self, worker: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None
        try:
            close_old_connections()
            heartbeats.heartbeat_stop(hostname=worker.hostname)
        except DatabaseError:
            logger.warning("heartbeat: could not mark %s stopped", worker.hostname, exc_info=True)

    def terminate(self, worker: Any) -> None:  # a cold shutdown
        self.stop(worker)

    @staticmethod
    def _queues(worker: Any) -> list[str]:
        return sorted(worker.app.amqp.queues.consume_from)

    def _beat(self, hostname: str, handlers: list[str], queues: list[str]) -> None:
        # The metrics folder's mark: a scrape elsewhere counts this host's live gauges (the
        # model calls in flight) while it is fresh (config.metrics_files).
        metrics_files.mark_host_alive()
        try:
            # The main process has no requests to recycle its connection around.
            close_old_connections()
            heartbeats.heartbeat_record(
                hostname=hostname,
                handlers=handlers,
                queues=queues,
                pid=os.getpid(),
                started_at=self.started_at,
            )
        except DatabaseError:
            logger.warning("heartbeat of %s not written", hostname, exc_info=True)
            connection.close()

    @staticmethod
    def _housekeeping(handlers: list[str], queues: list[str]) -> None:
        try:
            heartbeats.heartbeat_prune(older_than=timezone.now() - FORGET_AFTER)
            # Attempts that waited for this worker's handlers are offered to it now.
            offered = unservable.offer_waiting(
                handlers=handlers, queues=queues, batch=settings.DJFLOW["RECONCILE_BATCH"]
            )
        except DatabaseError:
            logger.warning("heartbeat: housekeeping at start failed", exc_info=True)
            return
        if offered:
            logger.info("offered %d attempts that waited for this worker's handlers", offered)
