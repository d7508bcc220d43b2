"""Logging helpers installed from ``settings.LOGGING``: keep the engine's clock out of the logs;
with ``DJFLOW_LOG_FORMAT=json``, one JSON object a line carrying the run, step, attempt and
trace ids (:class:`RunIds`, :func:`json_formatter`).

Beat sends the timer tick (``runs.fire_timers``) every second, and the reconciler
(``runs.reconcile``), the knowledge-base embedding sweep (``workers.sweep_kb_embeddings``) and
the sweep for schedules' lost messages (``schedules.sweep``) every ``RECONCILE_SECONDS``;
Celery logs three info lines for each (beat's "Sending due task", the worker's "received"
and "succeeded"), about 186 lines a minute of an idle ``manage.py standalone``, burying
everything else (console e-mails included). :class:`QuietClock` drops those lines below
WARNING; an error or a retry of the tick still shows, and the engine itself logs at info when
a tick fired timers or the reconciler repaired something (``runs.tasks``), so nothing that
happened goes unsaid.

It is attached as a filter to the loggers that emit those lines (a logger's filter sees only
records logged to that very logger, not those propagated from below), and it applies in
every process that configures Django's logging: ``celery worker`` and ``celery beat`` (Celery's
own logging set-up, even when it takes over the root logger, leaves named loggers' filters
alone), the pool processes forked from the worker, and ``standalone``'s children.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

from runs import tracing

# The tasks whose routine Celery lines are dropped.
CLOCK_TASKS = frozenset(
    {
        "runs.fire_timers",
        "runs.wake_timers",
        "runs.reconcile",
        "workers.sweep_kb_embeddings",
        "schedules.sweep",
    }
)
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


# The ids a JSON line carries, null outside an attempt (a request, the clock's tick).
RUN_FIELDS = ("run_id", "step_id", "attempt", "trace_id", "span_id")


class RunIds(logging.Filter):
    """Sets the run, step and attempt of the attempt this thread runs (``runs.tracing.
    running``), and the trace and span ids, on every record that lacks them.

    The trace id is the current span's when tracing is on; otherwise, inside an attempt, its
    run's trace id (the root run's UUID, derived the same way), so a line can be matched with
    a trace exported by another process, or looked up by run when nothing was exported."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = tracing.current_attempt.get()
        span = trace.get_current_span().get_span_context()
        found = {
            "run_id": current.run_id if current else None,
            "step_id": current.step_id if current else None,
            "attempt": current.attempt if current else None,
            "trace_id": (
                format(span.trace_id, "032x")
                if span.is_valid
                else (current.trace_id if current else None)
            ),
            "span_id": format(span.span_id, "016x") if span.is_valid else None,
        }
        for name, value in found.items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def json_formatter() -> logging.Formatter:
    """One JSON object a line: time, level, logger, message, the run's ids, and whatever a
    call passed as ``extra``."""
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s "
        + " ".join(f"%({f})s" for f in RUN_FIELDS),
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


def use_json(logger: logging.Logger) -> None:
    """Make ``logger``'s handlers write JSON lines with the run's ids: for the handlers Celery
    installs in a worker (it takes over the root logger after Django configured it)."""
    for handler in logger.handlers:
        handler.setFormatter(json_formatter())
        if not any(isinstance(f, RunIds) for f in handler.filters):
            handler.addFilter(RunIds())
