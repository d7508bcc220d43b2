"""The engine's Prometheus metrics, defined once per process, and the functions that count.

Every process writes its values to a file of its own under ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client's multiprocess mode; the settings set it: ``DJFLOW_METRICS_DIR`` and
``config.metrics``), and ``GET /metrics`` in a web process adds them up: the prefork worker
children that run steps are not the process that is scraped.

Invariants:

- Counting never fails a step, a run's end or a request: every function here that counts
  logs what went wrong and returns. It runs after the transaction that made the fact true
  has committed (``transaction.on_commit``, at once outside a transaction), so a rolled-back
  end is never counted, and nothing here holds a transaction's locks longer.
- Labels are bounded: a workflow's id (bounded by its definitions), a step kind (the
  registry), a status (the tables of ``runs.status``), an error class from the fixed set
  below (anything else is ``other``), a provider and model (configured), an account; never a
  run's id.
- The gauges that are facts of the database (runs by status, timers due, approvals pending)
  and the broker's queue depths are not here: ``config.metrics`` reads them at scrape time.

One module for every definition: prometheus-client refuses a second definition of a name in
a process, and the multiprocess value class must be in place before the first one (below).
It lives in ``runs`` because the engine (run ends, the reconciler) and the workers (attempts,
model calls) both count, and workers may import runs, not the reverse.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from decimal import Decimal
from functools import partial, wraps
from typing import Any, ParamSpec

from django.conf import settings
from django.db import transaction
from prometheus_client import Counter, Gauge, Histogram, values

from workflows import failures

logger = logging.getLogger(__name__)
P = ParamSpec("P")

# prometheus-client chooses how values are stored when it is first imported, from the
# environment. The settings export PROMETHEUS_MULTIPROC_DIR, but anything that imported the
# client before them (a plug-in, a test runner) left it on in-memory values, which no other
# process would see: switch here, before the first metric exists.
# And the other way: a child of a process that had metrics on inherits the variable, and if
# the client was imported before the settings turned metrics off (and removed it), every
# metric would look for a folder that is no longer named (a worker started with
# DJFLOW_METRICS=false by a process with it on failed to start): back to in-memory values.
_multiprocess = bool(getattr(values.ValueClass, "_multiprocess", False))
if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not _multiprocess:
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
elif not os.environ.get("PROMETHEUS_MULTIPROC_DIR") and _multiprocess:
    values.ValueClass = values.MutexValue

# Error classes handlers and the built-in kinds may name (workflows.failures) and those the
# engine writes (runs.engine.plan, runs.engine.ending, workers.kinds). A class outside them
# (none is expected) counts as "other", so the label cannot grow without bound.
ERROR_CLASSES = frozenset(
    {
        *failures.ERROR_CLASSES,
        *failures.KIND_ERROR_CLASSES,
        "timeout",
        "lost",
        "rejected",
        "unsupported",
        "cancelled",
        "interrupted",
    }
)

# Runs last from milliseconds (a few inline steps) to days (approvals, sleeps).
_RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)

WORKFLOW_EXECUTIONS = Counter(
    "djflow_workflow_executions",
    "Runs that ended, by workflow and end (completed, failed, timed_out, cancelled).",
    ["workflow", "status"],
)
WORKFLOW_DURATION = Histogram(
    "djflow_workflow_duration_seconds",
    "Seconds from a run's start (its creation when it never started) to its end.",
    ["workflow", "status"],
    buckets=_RUN_BUCKETS,
)
STEP_ATTEMPTS = Counter(
    "djflow_step_attempts",
    "Attempts a worker ran and recorded, by outcome; error_class is empty on success.",
    ["workflow", "kind", "status", "error_class"],
)
STEP_DURATION = Histogram(
    "djflow_step_duration_seconds",
    "Seconds from an attempt's claim to its result being recorded, on the worker.",
    ["workflow", "kind"],
    buckets=_STEP_BUCKETS,
)
MODEL_TOKENS = Counter(
    "djflow_model_tokens",
    "Model tokens the attempts' spans reported, by provider, model and direction.",
    ["provider", "model", "direction"],
)
COST_USD = Counter(
    "djflow_cost_usd",
    "What the attempts cost (their model calls and priced spans), in US dollars.",
    ["workflow"],
)
RECONCILER_REPAIRS = Counter(
    "djflow_reconciler_repairs",
    "Rows the reconciler acted on, by part (reoffered, lost_workers, stuck_runs, ...).",
    ["part"],
)
PASS_FAILURES = Counter(
    "djflow_pass_failures",
    "Runs a periodic pass (reconcile.advance, timers.advance, retention, ...) failed on and "
    "went on without (runs.engine.isolation); the run's id is in the log and on the run.",
    ["pass"],
)
MODEL_SLOTS_FAIL_OPEN = Counter(
    "djflow_model_slots_fail_open",
    "Model calls let through without counting them against their account's concurrency "
    "limit because the slots' Redis was unreachable.",
)
MODEL_SLOT_WAITS = Counter(
    "djflow_model_slot_waits",
    "Model calls that found every slot of their account taken and waited: taken (a slot "
    "freed within the wait) or busy (none did; the attempt is handed back).",
    ["account", "outcome"],
)
MODEL_CALLS_IN_FLIGHT = Gauge(
    "djflow_model_calls_in_flight",
    "Model calls in flight in this process, per account (counted in Redis or not).",
    ["account"],
    # The sum over live processes: a process that ended takes its calls with it (its file is
    # removed by gunicorn's child_exit, Celery's worker_process_shutdown, or the next start).
    multiprocess_mode="livesum",
)


def error_class(error: Mapping[str, Any] | None) -> str:
    """The bounded label for an error's class: "" without an error, "other" for one the
    engine does not know."""
    if not error:
        return ""
    name = str(error.get("class") or "")
    return name if name in ERROR_CLASSES else "other"


def never_raises(function: Callable[P, None]) -> Callable[P, None]:
    """A metric that fails is logged, and whatever was being counted goes on."""

    @wraps(function)
    def safe(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            function(*args, **kwargs)
        except Exception:
            logger.warning(
                "metrics: %s failed", getattr(function, "__name__", "a count"), exc_info=True
            )

    return safe


@never_raises
def after_commit(count: Callable[[], None]) -> None:
    """Run ``count`` once the current transaction commits (at once outside one), never
    raising; with metrics turned off (``DJFLOW_METRICS=false``), never."""
    if settings.DJFLOW_METRICS_ENABLED:
        transaction.on_commit(never_raises(count))


@never_raises
def run_ended(
    *, workflow: str, status: str, started_at: datetime | None, finished_at: datetime
) -> None:
    """Count a run's end after its transaction commits."""
    seconds = max((finished_at - started_at).total_seconds(), 0.0) if started_at else None
    after_commit(partial(_count_run, workflow, status, seconds))


def _count_run(workflow: str, status: str, seconds: float | None) -> None:
    WORKFLOW_EXECUTIONS.labels(workflow=workflow, status=status).inc()
    if seconds is not None:
        WORKFLOW_DURATION.labels(workflow=workflow, status=status).observe(seconds)


@never_raises
def attempt_recorded(
    *,
    workflow: str,
    kind: str,
    status: str | None,
    error: Mapping[str, Any] | None,
    seconds: float,
    spans: Iterable[Any],
) -> None:
    """Count an attempt a worker recorded (``status`` None: its result was refused, the
    attempt having been given up meanwhile; its model calls were made and count all the
    same), after the recording transaction commits."""
    usage = [(s.provider, s.model, dict(s.usage), s.cost_usd) for s in spans]
    after_commit(
        partial(_count_attempt, workflow, kind, status, error_class(error), seconds, usage)
    )


def _count_attempt(
    workflow: str,
    kind: str,
    status: str | None,
    error_label: str,
    seconds: float,
    usage: list[tuple[str | None, str | None, dict[str, int], Decimal | None]],
) -> None:
    if status is not None:
        STEP_ATTEMPTS.labels(
            workflow=workflow, kind=kind, status=status, error_class=error_label
        ).inc()
        STEP_DURATION.labels(workflow=workflow, kind=kind).observe(seconds)
    cost = Decimal(0)
    for provider, model, tokens, span_cost in usage:
        cost += span_cost or 0
        for direction in ("input", "output"):
            amount = tokens.get(f"{direction}_tokens", 0)
            if amount:
                MODEL_TOKENS.labels(
                    provider=provider or "unknown", model=model or "unknown", direction=direction
                ).inc(amount)
    if cost:
        COST_USD.labels(workflow=workflow).inc(float(cost))


@never_raises
def reconciled(counts: Mapping[str, int]) -> None:
    """Count what one reconciler tick acted on (each part committed its own work)."""
    if not settings.DJFLOW_METRICS_ENABLED:
        return
    for part, rows in counts.items():
        if rows:
            RECONCILER_REPAIRS.labels(part=part).inc(rows)


@never_raises
def pass_failed(pass_name: str) -> None:
    """Count one run a periodic pass failed on. At once, not after a commit: the failure
    happened whatever becomes of the transaction it rolled back."""
    if settings.DJFLOW_METRICS_ENABLED:
        PASS_FAILURES.labels(**{"pass": pass_name}).inc()
