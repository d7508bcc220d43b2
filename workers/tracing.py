"""The worker's part of a run's trace (``runs.tracing``): each attempt span, live, as a child
of its step's span, and below it the handler's own ``ctx.span()`` spans and its model calls,
with the OpenTelemetry GenAI attributes (``gen_ai.*``).

The step span is emitted when the run ends, by whichever process ends it, with the id this
worker derives now: the attempt joins it without either process knowing the other. The
attempt span links to the Celery task span that ran it (the message's own trace, carried by
the Celery instrumentation from whoever sent it).

Off (no ``OTEL_EXPORTER_OTLP_ENDPOINT``), every function here returns at its first line. On,
a tracing failure is logged and the attempt goes on: no step fails because tracing did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from runs import tracing
from workflows import secrets

if TYPE_CHECKING:
    from .claims import Claimed
    from .context import Span

logger = logging.getLogger(__name__)

# The GenAI operation of a span kind of ``ctx.span()`` that calls a model
# (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/).
GEN_AI_OPERATIONS = {"model_generation": "chat", "embedding": "embeddings"}
# Span kinds of ctx.span() that call out of the process.
_CLIENT_KINDS = frozenset({"client", "model_generation", "embedding"})
# Attempt statuses whose span is an error.
_FAILED = frozenset({"failed", "timed_out"})


@contextmanager
def attempt_span(row: Claimed, worker: str) -> Iterator[trace.Span | None]:
    """The attempt's span, current while its body runs (its queries and the handler's spans
    are its children); None when tracing is off or could not start it."""
    if not tracing.enabled():
        yield None
        return
    span = _start_attempt(row, worker)
    if span is None:
        yield None
        return
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False):
            yield span
    finally:
        try:
            if span.is_recording():  # not ended by attempt_recorded (the claim was refused)
                span.end()
        except Exception:
            logger.warning("tracing: attempt %s's span not ended", row.id, exc_info=True)


def _start_attempt(row: Claimed, worker: str) -> trace.Span | None:
    try:
        trace_id = tracing.trace_id_of(row.run_id, row.root_run_id)
        step = tracing.step_span_id(row.run_id, row.generation, row.path, row.step_id)
        # The Celery task span running this attempt, in the sender's trace: linked, not the
        # parent (the parent is the step, in the run's trace).
        carrier = trace.get_current_span().get_span_context()
        return tracing.start_span(
            f"attempt {row.step_id} #{row.attempt}",
            span_id=tracing.attempt_span_id(row.id),
            parent=tracing.remote_parent(trace_id, step),
            links=[Link(carrier)] if carrier.is_valid else [],
            attributes={
                "djflow.run.id": str(row.run_id),
                "djflow.workflow.id": row.workflow_id,
                "djflow.step.id": row.step_id,
                "djflow.step.path": row.path or None,
                "djflow.step.kind": row.kind,
                "djflow.attempt": row.attempt,
                "djflow.step_run.id": row.id,
                "djflow.worker": worker,
                "djflow.queue": row.queue,
            },
        )
    except Exception:
        logger.warning("tracing: attempt %s's span not started", row.id, exc_info=True)
        return None


def attempt_recorded(
    span: trace.Span | None, status: str, error: dict[str, Any] | None, cost: Any
) -> None:
    """What the attempt came to, on its span, which ends now: before the journal records the
    attempt's finish, so it lies within its step span (whose end is the last finish). The
    recording's own queries, still under it, come after."""
    if span is None:
        return
    try:
        span.set_attribute("djflow.attempt.status", status)
        span.set_attribute("djflow.cost_usd", float(cost or 0))
        if error:
            span.set_attribute("error.type", str(error.get("class")))
        if status in _FAILED:
            message = (error or {}).get("message")
            shown = secrets.scrub_text(str(message)) if message else None
            span.set_status(Status(StatusCode.ERROR, shown))
        span.end()
    except Exception:
        logger.warning("tracing: attempt result not set on its span", exc_info=True)


def open_handler_span(opened: Span) -> tuple[trace.Span, Any] | None:
    """An OpenTelemetry span for ``ctx.span()``, current until :func:`close_handler_span`."""
    if not tracing.enabled():
        return None
    try:
        kind = SpanKind.CLIENT if opened.kind in _CLIENT_KINDS else SpanKind.INTERNAL
        span = tracing.tracer().start_span(
            opened.name,
            kind=kind,
            attributes=_exported({"djflow.span.kind": opened.kind, **opened.attributes}),
        )
        activation = trace.use_span(span, end_on_exit=False, record_exception=False)
        activation.__enter__()
        return span, activation
    except Exception:
        logger.warning("tracing: span %s not started", opened.name, exc_info=True)
        return None


def close_handler_span(live: tuple[trace.Span, Any] | None, closed: Span) -> None:
    """End the span with what the handler set on ``closed``: its attributes, and for a model
    call the GenAI ones (operation, provider, models, token usage)."""
    if live is None:
        return
    span, activation = live
    try:
        activation.__exit__(None, None, None)
        operation = GEN_AI_OPERATIONS.get(closed.kind)
        attributes = dict(closed.attributes)
        if operation is not None:
            attributes.update(gen_ai_attributes(operation, closed))
            if closed.model:
                span.update_name(f"{operation} {closed.model}")
        cost = closed.cost_usd
        if cost is not None:
            attributes["djflow.cost_usd"] = float(cost)
        span.set_attributes(_exported(attributes))
        if closed.error is not None:
            if "error.type" not in attributes:
                span.set_attribute("error.type", closed.error.split(":", 1)[0])
            span.set_status(Status(StatusCode.ERROR, secrets.scrub_text(closed.error)))
        span.end()
    except Exception:
        logger.warning("tracing: span %s not ended", closed.name, exc_info=True)


def _exported(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes as they leave the process: a secret of the run the handler put there (the
    attempt holds the revealed values) is masked, as in its logs (``secrets.exposing``)."""
    return tracing.clean_attributes(secrets.scrub(attributes))


def gen_ai_attributes(operation: str, closed: Span) -> dict[str, Any]:
    """The GenAI semantic conventions' attributes of a model call."""
    usage = closed.usage
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": closed.provider,
        "gen_ai.request.model": closed.model,
        # The model that answered (set by the kind from the reply), else the one asked.
        "gen_ai.response.model": closed.attributes.get("gen_ai.response.model"),
        "gen_ai.usage.input_tokens": usage.get("input_tokens"),
        "gen_ai.usage.output_tokens": usage.get("output_tokens") if operation == "chat" else None,
        "gen_ai.usage.cache_read.input_tokens": usage.get("cached_tokens"),
        "gen_ai.usage.reasoning.output_tokens": usage.get("reasoning_tokens"),
    }
