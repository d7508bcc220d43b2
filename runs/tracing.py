"""One OpenTelemetry trace per run, though a run lives across many processes and hours.

No process holds a run open: a run sleeps, waits for an event or an approval with no process
alive, and its steps run on whichever worker claims them. So the trace is not built by
nesting live spans; every span's identity is derived from the journal, and any process can
emit its part knowing only ids:

- the trace id is the root run's UUID (a child run's spans join its root's trace);
- the run span's id is derived from (run, generation), a step span's from (run, generation,
  path, step id), an attempt span's from its step run's id (``_derived``);
- the worker emits each attempt span live, as a child of its (not yet emitted) step span,
  with the handler's own spans and model calls below it (``workers.tracing``);
- when the run ends (``runs.engine.ending``), the process that ended it emits the run span
  and its step spans with the times the journal recorded, and the attempts no worker ran
  (sleeps, waits, approvals, composite and child-run steps; attempts whose worker was lost).

A retried run's new generation gets a run span of its own, a child of the previous one's. A
child run's span is a child of the attempt span of its parent's ``subworkflow`` step.

Nothing here runs unless ``config.tracing`` set up a tracer provider in this process
(``OTEL_EXPORTER_OTLP_ENDPOINT`` set): :func:`enabled` is one attribute read otherwise, and
no query is made. Tracing never fails the work it traces: emission errors are logged.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from workflows import secrets

logger = logging.getLogger(__name__)

TRACER_NAME = "djflow"
# Spans emitted at a run's end go out in batches of this many, each flushed before the next:
# the batch processor's queue (2048 by default) drops what does not fit, and a foreach of
# thousands of items ends with thousands of step spans at once.
EMIT_BATCH = 512

_enabled = False
# (span id, trace id or None): the ids the next span started in this context gets
# (config.tracing.DerivedIds reads it); None: random ids, as usual.
forced_ids: ContextVar[tuple[int, int | None] | None] = ContextVar(
    "djflow_forced_ids", default=None
)


@dataclass(frozen=True)
class Attempt:
    """The attempt this thread is running: what its log lines carry (config.logging)."""

    run_id: str
    step_id: str
    attempt: int
    trace_id: str


current_attempt: ContextVar[Attempt | None] = ContextVar("djflow_attempt", default=None)


def enabled() -> bool:
    """Whether this process exports traces (config.tracing set a provider up)."""
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# --- Ids -----------------------------------------------------------------------------------


def trace_id_of(run_id: Any, root_run_id: Any = None) -> int:
    """The trace of a run: its root run's UUID, so a run tree is one trace."""
    return uuid.UUID(str(root_run_id or run_id)).int


@contextmanager
def running(run_id: Any, root_run_id: Any, step_id: str, attempt: int) -> Iterator[None]:
    """Mark the attempt as this thread's current one while it runs (for its log lines)."""
    trace_id = format(trace_id_of(run_id, root_run_id), "032x")
    token = current_attempt.set(Attempt(str(run_id), step_id, attempt, trace_id))
    try:
        yield
    finally:
        current_attempt.reset(token)


def _derived(*parts: Any) -> int:
    """A span id (64 bits, never 0) from what identifies the span."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def run_span_id(run_id: Any, generation: int) -> int:
    return _derived("run", run_id, generation)


def step_span_id(run_id: Any, generation: int, path: str, step_id: str) -> int:
    return _derived("step", run_id, generation, path, step_id)


def attempt_span_id(step_run_id: int) -> int:
    return _derived("attempt", step_run_id)


def container_of(path: str) -> tuple[str, str] | None:
    """The composite step a path sits in, as (its path, its step id): ``"a[1]/b[2]/"`` is in
    step ``b`` at path ``"a[1]/"``; None for the top level."""
    parts = [part for part in path.split("/") if part]
    if not parts:
        return None
    outer = "".join(f"{part}/" for part in parts[:-1])
    return outer, parts[-1].split("[", 1)[0]


def step_parent_id(run_id: Any, generation: int, path: str) -> int:
    """The span a step at ``path`` is a child of: its composite step's, or the run's."""
    container = container_of(path)
    if container is None:
        return run_span_id(run_id, generation)
    return step_span_id(run_id, generation, *container)


def remote_parent(trace_id: int, span_id: int) -> Context:
    """A context whose current span is (trace_id, span_id), emitted elsewhere or later."""
    parent = SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


@contextmanager
def _forcing(span_id: int, trace_id: int | None) -> Iterator[None]:
    token = forced_ids.set((span_id, trace_id))
    try:
        yield
    finally:
        forced_ids.reset(token)


def start_span(
    name: str,
    *,
    span_id: int,
    parent: Context,
    trace_id: int | None = None,
    start: datetime | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict[str, Any] | None = None,
    links: Sequence[Link] = (),
) -> trace.Span:
    """A span with a derived id: under ``parent`` (an empty Context for a root, whose trace
    id is then ``trace_id``), started at ``start`` (now when None)."""
    with _forcing(span_id, trace_id):
        return tracer().start_span(
            name,
            context=parent,
            kind=kind,
            attributes=clean_attributes(attributes or {}),
            links=links,
            start_time=_ns(start) if start is not None else None,
        )


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)


def clean_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes OpenTelemetry accepts: None dropped, anything not a primitive as text."""
    kept: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, str | bool | int | float):
            kept[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            kept[key] = list(value)
        else:
            kept[key] = str(value)
    return kept


# --- The request that started a run ----------------------------------------------------------


def link_to_run(run_id: Any, root_run_id: Any = None, generation: int = 1) -> None:
    """Link the current span (the POST /runs request's, the builder's script's) to the run's
    own trace: the run's spans are emitted later, elsewhere, under the run's trace id."""
    if not _enabled:
        return
    try:
        current = trace.get_current_span()
        if current.is_recording():
            target = SpanContext(
                trace_id_of(run_id, root_run_id),
                run_span_id(run_id, generation),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            current.add_link(target, {"djflow.run.id": str(run_id)})
            current.set_attribute("djflow.run.id", str(run_id))
    except Exception:
        logger.warning("could not link the current span to run %s", run_id, exc_info=True)


# --- A run's end -----------------------------------------------------------------------------

# Run statuses whose span is an error.
_FAILED = frozenset({"failed", "timed_out"})


def on_run_end(run_id: Any) -> None:
    """After the transaction that ended ``run_id`` commits, emit its run span, its step spans
    and the attempts no worker emitted. Registered only when tracing is on."""
    if not _enabled:
        return
    from django.db import transaction

    transaction.on_commit(lambda: emit_run(run_id))


def emit_run(run_id: Any) -> None:
    """Emit a finished run's spans from its journal (see the module's docstring); a failure
    is logged, never raised."""
    try:
        _emit_run(run_id)
    except Exception:
        logger.warning("tracing: the spans of run %s were not emitted", run_id, exc_info=True)


def _emit_run(run_id: Any) -> None:
    from workflows import kinds

    from .models import Run, StepRun

    run = (
        Run.objects.filter(id=run_id)
        .only(
            "id",
            "workflow_id",
            "version__number",
            "status",
            "error",
            "generation",
            "root_run_id",
            "parent_step_run_id",
            "cost_usd",
            "created_at",
            "started_at",
            "finished_at",
            "correlation",
        )
        .select_related("version")
        .first()
    )
    if run is None or run.finished_at is None:
        return
    rows = list(
        StepRun.objects.filter(run_id=run.id, generation=run.generation)
        .order_by("id")
        .values(
            "id",
            "step_id",
            "path",
            "kind",
            "attempt",
            "status",
            "error",
            "worker",
            "scheduled_at",
            "started_at",
            "finished_at",
            "cost_usd",
            "branch",
        )
    )
    trace_id = trace_id_of(run.id, run.root_run_id)
    worker_kinds = kinds.names(kinds.Role.WORKER)
    ended = run.finished_at
    spans: list[tuple[trace.Span, datetime]] = []
    # The run span.
    if run.parent_step_run_id is not None:
        parent = remote_parent(trace_id, attempt_span_id(run.parent_step_run_id))
    elif run.generation > 1:
        parent = remote_parent(trace_id, run_span_id(run.id, run.generation - 1))
    else:
        parent = Context()
    error = run.error or {}
    run_span = start_span(
        f"run {run.workflow_id}",
        span_id=run_span_id(run.id, run.generation),
        parent=parent,
        trace_id=trace_id,
        start=run.started_at if run.generation > 1 and run.started_at else run.created_at,
        attributes={
            "djflow.run.id": str(run.id),
            "djflow.workflow.id": run.workflow_id,
            "djflow.workflow.version": run.version.number,
            "djflow.run.status": run.status,
            "djflow.run.generation": run.generation,
            "djflow.run.correlation": run.correlation,
            "djflow.cost_usd": float(run.cost_usd),
            "error.type": error.get("class"),
        },
    )
    _set_status(run_span, run.status in _FAILED, error.get("message"))
    spans.append((run_span, ended))
    # Step spans: the attempts of one (path, step id), from the first offer to the last end.
    steps: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        steps.setdefault((row["path"], row["step_id"]), []).append(row)
    for (path, step_id), attempts in steps.items():
        last = attempts[-1]
        span = start_span(
            f"step {step_id}",
            span_id=step_span_id(run.id, run.generation, path, step_id),
            parent=remote_parent(trace_id, step_parent_id(run.id, run.generation, path)),
            start=min(a["scheduled_at"] for a in attempts),
            attributes={
                "djflow.run.id": str(run.id),
                "djflow.step.id": step_id,
                "djflow.step.path": path or None,
                "djflow.step.kind": last["kind"],
                "djflow.step.status": last["status"],
                "djflow.step.attempts": len(attempts),
                "djflow.step.branch": last["branch"] or None,
            },
        )
        _set_status(span, last["status"] in _FAILED, (last["error"] or {}).get("message"))
        spans.append((span, max((a["finished_at"] or ended) for a in attempts)))
        for attempt in attempts:
            if _worker_emitted(attempt, worker_kinds):
                continue
            spans.append(_journal_attempt(run, trace_id, attempt, ended))
    for start in range(0, len(spans), EMIT_BATCH):
        for span, end in spans[start : start + EMIT_BATCH]:
            span.end(end_time=_ns(end))
        if len(spans) > EMIT_BATCH:
            _flush()


def _worker_emitted(attempt: dict[str, Any], worker_kinds: frozenset[str]) -> bool:
    """Whether a worker emitted this attempt's span: it ran it (claimed it), unless the
    engine failed it because that worker was lost (class ``lost``: no worker lived to)."""
    if attempt["kind"] not in worker_kinds:
        return False
    lost = (attempt["error"] or {}).get("class") == "lost"
    return attempt["started_at"] is not None and not lost


def _journal_attempt(
    run: Any, trace_id: int, attempt: dict[str, Any], ended: datetime
) -> tuple[trace.Span, datetime]:
    error = attempt["error"] or {}
    span = start_span(
        f"attempt {attempt['step_id']} #{attempt['attempt']}",
        span_id=attempt_span_id(attempt["id"]),
        parent=remote_parent(
            trace_id,
            step_span_id(run.id, run.generation, attempt["path"], attempt["step_id"]),
        ),
        start=attempt["started_at"] or attempt["scheduled_at"],
        attributes={
            "djflow.run.id": str(run.id),
            "djflow.step.id": attempt["step_id"],
            "djflow.step.kind": attempt["kind"],
            "djflow.attempt": attempt["attempt"],
            "djflow.step_run.id": attempt["id"],
            "djflow.attempt.status": attempt["status"],
            "djflow.worker": attempt["worker"] or None,
            "djflow.cost_usd": float(attempt["cost_usd"]),
            "error.type": error.get("class"),
        },
    )
    _set_status(span, attempt["status"] in _FAILED, error.get("message"))
    return span, attempt["finished_at"] or ended


def _set_status(span: trace.Span, failed: bool, message: Any) -> None:
    if failed:
        # A stored message holds a secret as its token: shown as the mask, as the API does.
        shown = secrets.shown_text(str(message)) if message else None
        span.set_status(Status(StatusCode.ERROR, shown))


def _flush() -> None:
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush()
