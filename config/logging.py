"""Logging helpers installed from ``settings.LOGGING``: keep the engine's clock out of the logs.

Beat sends the timer tick (``runs.fire_timers``) every second, and the reconciler
(``runs.reconcile``) and the knowledge-base embedding sweep (``workers.sweep_kb_embeddings``)
every ``RECONCILE_SECONDS``; Celery logs three info lines for each
(beat's "Sending due task", the worker's "received" and "succeeded"), about 186 lines a
minute of an idle ``manage.py standalone``, burying everything else (console e-mails
included). :class:`QuietClock` drops those lines below WARNING; an error or a retry of the
tick still shows, and the engine itself logs at info when a tick fired timers or the
reconciler repaired something (``runs.tasks``), so nothing that happened goes unsaid.

It is attached as a filter to the loggers that emit those lines (a logger's filter sees only
records logged to that very logger, not those propagated from below), and it applies in
every process that configures Django's logging: ``celery worker`` and ``celery beat`` (Celery's
own logging set-up, even when it takes over the root logger, leaves named loggers' filters
alone), the pool processes forked from the worker, and ``standalone``'s children.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

# The tasks whose routine Celery lines are dropped.
CLOCK_TASKS = frozenset({"runs.fire_timers", "runs.reconcile", "workers.sweep_kb_embeddings"})
# The loggers emitting them: "Task ... received" (the worker's consumer), "Task ... succeeded
# in ..." (the pool process running it), "Scheduler: Sending due task ..." (beat).
CELERY_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


def _task_names(record: logging.LogRecord) -> list[object]:
    """The task names a Celery record is about: ``celery.app.trace`` and the strategy pass a
    context dict (also kept as ``record.data``), beat passes ``(entry name, task name)``."""
    context = getattr(record, "data", None)
    if isinstance(context, Mapping):
        return [context.get("name")]
    if isinstance(record.args, Mapping):
        return [record.args.get("name")]
    if isinstance(record.args, tuple):
        return list(record.args)
    return []


class QuietClock(logging.Filter):
    """Drops Celery's routine (below WARNING) lines about the engine's clock tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not any(name in CLOCK_TASKS for name in _task_names(record))
