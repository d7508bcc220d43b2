"""Setting up OpenTelemetry in a process: once, and only when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set.

Without it no tracer provider is set: the API's no-op tracer answers every call, the
instrumentations are not installed, and ``runs.tracing.enabled()`` is false, so the engine
emits nothing and queries nothing for traces.

With it: a tracer provider whose spans go to the endpoint over OTLP/HTTP in batches, with
ids derived from the journal where ``runs.tracing`` asks for them (``DerivedIds``), and the
standard instrumentations of Django (a span per request, context read from ``traceparent``),
Celery (a span per task sent and run, context carried in the message headers) and psycopg (a
span per query). The standard ``OTEL_*`` variables (service name, headers, sampler, batch
sizes) apply as the SDK reads them.

When: web processes at WSGI/ASGI start; ``celery worker`` in each pool process after the
fork (``worker_process_init``: the batch processor's thread does not survive a fork), or in
the main process for pools that do not fork; ``celery beat`` at ``beat_init``. Spans still
queued are flushed when a pool process or the worker shuts down.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

from runs import tracing

logger = logging.getLogger(__name__)

# The engine's clock and housekeeping: a trace a second of beat's tick is noise, not insight.
# Their spans (and what they cause that carries no run's context) are not sampled.
QUIET_TASKS = frozenset(
    {
        "runs.fire_timers",
        "runs.wake_timers",
        "runs.reconcile",
        "workers.sweep_kb_embeddings",
        "celery.backend_cleanup",
    }
)

_lock = threading.Lock()
_provider: Any = None


def endpoint_configured() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


class DerivedIds(RandomIdGenerator):
    """Random ids, except for the spans ``runs.tracing`` starts with ids derived from the
    journal (the run's trace id, a step's span id): those it sets in a context variable."""

    def generate_span_id(self) -> int:
        forced = tracing.forced_ids.get()
        return forced[0] if forced is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:
        forced = tracing.forced_ids.get()
        if forced is not None and forced[1] is not None:
            return forced[1]
        return super().generate_trace_id()


class QuietRoots(Sampler):
    """Root spans are sampled (at ``OTEL_TRACES_SAMPLER_ARG``'s ratio, all by default),
    except a query outside any traced work (a heartbeat's, beat's schedule polling) and the
    clock's tasks: those would be a trace each, every second."""

    def __init__(self, ratio: float = 1.0) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        # Spans with a derived id (runs.tracing) are the run's own: always kept.
        if tracing.forced_ids.get() is None and _quiet(name, attributes or {}):
            return SamplingResult(Decision.DROP)
        return self._ratio.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return "QuietRoots"


def _quiet(name: str, attributes: Any) -> bool:
    if "db.system" in attributes or "db.system.name" in attributes:
        return True
    task = name.split("/", 1)[-1]
    return task in QUIET_TASKS


def setup(role: str, *, django: bool = False) -> bool:
    """Set up tracing in this process once (a second call does nothing); True when it is on.
    ``role`` (web, worker, beat) is a resource attribute of its spans; ``django``: instrument
    Django's request handling too (web processes)."""
    global _provider
    if not endpoint_configured():
        return False
    with _lock:
        if _provider is not None:
            return True
        try:
            _provider = _install(role, django=django)
        except Exception:
            # Tracing is an aid: a broken set-up is logged and the process goes on without.
            logger.exception("tracing not set up")
            return False
    tracing.set_enabled(True)
    return True


def _install(role: str, *, django: bool) -> Any:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0") or 1.0)
    provider = TracerProvider(
        resource=Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME", "djflow"),
                # Set up after the fork: this very process's.
                "process.pid": os.getpid(),
                "djflow.process": role,
            }
        ),
        id_generator=DerivedIds(),
        sampler=ParentBased(root=QuietRoots(ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    # Off by default: a span per query cost 15 % per step where everything else together
    # cost 7 % (bench/observability.py); on, they show where an attempt's time went.
    if os.environ.get("DJFLOW_TRACE_QUERIES", "false").strip().lower() in ("true", "1", "yes"):
        PsycopgInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    if django:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        DjangoInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    return provider


def shutdown() -> None:
    """Flush what is queued and stop the exporter (a pool process or a worker ending)."""
    provider = _provider
    if provider is None:
        return
    try:
        provider.shutdown()
    except Exception:
        logger.warning("tracing: flushing at shutdown failed", exc_info=True)


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)
