"""Traces in one process (runs.tracing, workers.tracing, config.tracing), with the SDK's
in-memory exporter: one trace per run, run → steps → attempts → the handler's spans, GenAI
attributes on a model call, the request linked to its run, tracing failing without failing a
step, nothing at all when no endpoint is set; and JSON log lines carrying the ids.

The same across real worker processes, exported over OTLP/HTTP: test_tracing_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased

from config import logging as log_config
from config import tracing as setup
from runs import tracing
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from runs.services import run_start
from workers.execution import execute
from workflows.secrets import MASK

from . import flows_traced as flows

pytestmark = pytest.mark.django_db
BASE_DIR = Path(__file__).resolve().parents[2]

_EXPORTER = InMemorySpanExporter()
_PROVIDER: list[TracerProvider] = []


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """This process traces into memory: the provider config.tracing would set up, with an
    in-memory exporter (a global provider is set once per process)."""
    if not _PROVIDER:
        provider = TracerProvider(
            id_generator=setup.DerivedIds(), sampler=ParentBased(root=setup.QuietRoots())
        )
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
        _PROVIDER.append(provider)
    _EXPORTER.clear()
    monkeypatch.setattr(tracing, "_enabled", True)
    return _EXPORTER


@pytest.fixture
def offers():
    """Offers to workers are not sent: the tests run each attempt in this process."""
    with mock.patch("workers.tasks.execute_step.apply_async"):
        yield


def drive(run: Run) -> Run:
    """Run every offered attempt here, as a worker would, until the run ends."""
    for _ in range(50):
        run.refresh_from_db()
        if run.finished_at is not None:
            return run
        offered = StepRun.objects.filter(run=run, status="scheduled").order_by("id").first()
        if offered is None:
            run_advance(run_id=run.id)  # a fan-out's last item asks for it (a message)
        else:
            execute(offered.id, worker="here")
    raise AssertionError("the run did not end")


def by_id(spans: list[ReadableSpan]) -> dict[int, ReadableSpan]:
    return {span.context.span_id: span for span in spans}


def parent_of(span: ReadableSpan, spans: dict[int, ReadableSpan]) -> ReadableSpan | None:
    return spans.get(span.parent.span_id) if span.parent is not None else None


def named(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [found] = [span for span in spans if span.name == name]
    return found


def test_one_trace_per_run_holds_run_steps_attempts_and_handler_spans(
    exported, offers, django_capture_on_commit_callbacks
) -> None:
    flows.save_traced("standin:echo")
    with django_capture_on_commit_callbacks(execute=True):
        run = run_start(workflow="traced", input={}).run
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run)
    assert run.status == "completed", run.error

    spans = [s for s in exported.get_finished_spans() if s.name != "query"]
    ours = [s for s in spans if s.context.trace_id == uuid.UUID(str(run.id)).int]
    # Every span the engine made is in the run's trace.
    assert {s.name for s in spans} - {s.name for s in ours} == set()
    ids = by_id(ours)
    root = named(ours, "run traced")
    assert root.parent is None
    assert root.attributes["djflow.run.status"] == "completed"
    # Steps under the run; the foreach's items under the foreach.
    for step in ("fetch", "fan", "ask"):
        assert parent_of(named(ours, f"step {step}"), ids) is root
    items = [s for s in ours if s.name == "step item"]
    assert len(items) == 2
    assert {parent_of(s, ids).name for s in items} == {"step fan"}
    assert {s.attributes["djflow.step.path"] for s in items} == {"fan[0]/", "fan[1]/"}
    # Attempts under their steps, emitted by the worker (fetch) or at the end (the foreach).
    fetch = named(ours, "attempt fetch #1")
    assert parent_of(fetch, ids) is named(ours, "step fetch")
    assert fetch.attributes["djflow.attempt.status"] == "succeeded"
    assert fetch.attributes["djflow.worker"] == "here"
    assert parent_of(named(ours, "attempt fan #1"), ids) is named(ours, "step fan")
    # The handler's spans under the attempt, nested as the handler nested them.
    lookup = named(ours, "lookup")
    assert parent_of(lookup, ids) is fetch
    assert lookup.attributes["source"] == "catalogue" and lookup.attributes["rows"] == 2
    assert parent_of(named(ours, "parse"), ids) is lookup
    # Times: each child within its parent.
    for span in ours:
        parent = parent_of(span, ids)
        if parent is not None:
            assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time, (
                span.name
            )


def test_a_model_call_carries_the_gen_ai_attributes(
    exported, offers, django_capture_on_commit_callbacks
) -> None:
    flows.save_traced("standin:echo")
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_start(workflow="traced", input={}).run)
    spans = exported.get_finished_spans()
    call = named(list(spans), "chat echo")
    assert call.kind == trace.SpanKind.CLIENT
    attributes = call.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "standin"
    assert attributes["gen_ai.request.model"] == "echo"
    assert attributes["gen_ai.response.model"]
    [attempt] = StepRun.objects.filter(run=run, step_id="ask")
    assert attributes["gen_ai.usage.input_tokens"] == attempt.usage["input_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] == attempt.usage["output_tokens"] > 0
    assert attributes["gen_ai.request.max_tokens"] == 40
    assert parent_of(call, by_id(list(spans))).name == "attempt ask #1"


def test_the_request_that_started_a_run_links_to_its_trace(exported, offers) -> None:
    flows.save_traced("standin:echo")
    with tracing.tracer().start_as_current_span("POST /api/v1/runs") as request:
        run = run_start(workflow="traced", input={}).run
    assert request.attributes["djflow.run.id"] == str(run.id)
    [link] = request.links
    assert link.context.trace_id == uuid.UUID(str(run.id)).int
    assert link.context.span_id == tracing.run_span_id(run.id, 1)


def test_a_tracing_failure_fails_no_step(
    exported, offers, django_capture_on_commit_callbacks, caplog
) -> None:
    flows.save_traced("standin:echo")
    broken = mock.patch.object(tracing, "start_span", side_effect=RuntimeError("exporter gone"))
    with broken, django_capture_on_commit_callbacks(execute=True):
        run = drive(run_start(workflow="traced", input={}).run)
    assert run.status == "completed", run.error
    assert "exporter gone" in caplog.text


def test_a_secret_of_the_run_leaves_the_process_masked(
    exported, offers, django_capture_on_commit_callbacks
) -> None:
    key = "sk-live-4f1c9a7e2b5d8c3a"
    flows.secretive.save()
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_start(workflow="traced_secret", input={"key": key}).run)
    assert run.status == "failed"
    spans = [s for s in exported.get_finished_spans() if s.context.trace_id == run.id.int]
    shown = repr([(s.name, dict(s.attributes or {}), s.status.description) for s in spans])
    assert key not in shown
    call = named(list(spans), "call")
    assert call.attributes["key"] == MASK and call.attributes["note"] == f"sent {MASK}"
    assert named(list(spans), "attempt use #1").status.description == f"refused key {MASK}"
    assert named(list(spans), "run traced_secret").status.description == f"refused key {MASK}"


def test_ids_are_derived_from_the_journal() -> None:
    run_id = uuid.uuid4()
    assert tracing.trace_id_of(run_id) == run_id.int
    assert tracing.trace_id_of(uuid.uuid4(), root_run_id=run_id) == run_id.int
    assert tracing.step_span_id(run_id, 1, "", "a") == tracing.step_span_id(run_id, 1, "", "a")
    assert tracing.step_span_id(run_id, 1, "", "a") != tracing.step_span_id(run_id, 2, "", "a")
    assert tracing.container_of("") is None
    assert tracing.container_of("fan[3]/") == ("", "fan")
    assert tracing.container_of("a[1]/b[2]/") == ("a[1]/", "b")
    assert tracing.step_parent_id(run_id, 1, "fan[3]/") == tracing.step_span_id(
        run_id, 1, "", "fan"
    )


def test_the_clock_and_stray_queries_start_no_trace() -> None:
    sampler = setup.QuietRoots()
    trace_id = uuid.uuid4().int

    def kept(name: str, attributes: dict[str, Any] | None = None) -> bool:
        decision = sampler.should_sample(None, trace_id, name, attributes=attributes).decision
        return decision.is_sampled()

    assert not kept("run/runs.fire_timers") and not kept("apply_async/runs.reconcile")
    assert not kept("SELECT", {"db.system": "postgresql"})
    assert kept("run/workers.execute_step") and kept("POST /api/v1/runs")
    # A run's own spans (derived ids) are always kept.
    with tracing._forcing(1, trace_id):
        assert kept("SELECT", {"db.system": "postgresql"})


def test_without_an_endpoint_no_provider_is_set_up(tmp_path: Path) -> None:
    probe = (
        "import django; django.setup()\n"
        "from opentelemetry import trace\n"
        "from config import tracing as setup\n"
        "from runs import tracing\n"
        "print(setup.setup('web', django=True), type(trace.get_tracer_provider()).__name__,"
        " tracing.enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=BASE_DIR,
        env={**env, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "ProxyTracerProvider", "False"]


def test_nothing_is_emitted_when_tracing_is_off(
    offers, django_capture_on_commit_callbacks, monkeypatch
) -> None:
    monkeypatch.setattr(tracing, "_enabled", False)
    flows.save_traced("standin:echo")
    with (
        mock.patch.object(tracing, "start_span") as started,
        mock.patch.object(tracing, "emit_run") as emitted,
        django_capture_on_commit_callbacks(execute=True),
    ):
        run = drive(run_start(workflow="traced", input={}).run)
    assert run.status == "completed"
    started.assert_not_called()
    emitted.assert_not_called()


@pytest.mark.parametrize(
    ("queries", "traced"), [("", "False"), ("false", "False"), ("true", "True")]
)
def test_query_spans_follow_djflow_trace_queries(queries: str, traced: str) -> None:
    probe = (
        "import django; django.setup()\n"
        "from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor\n"
        "from config import tracing as setup\n"
        "from runs import tracing\n"
        "print(setup.setup('worker'), tracing.enabled(),"
        " PsycopgInstrumentor().is_instrumented_by_opentelemetry)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        # Nothing listens there; nothing is sent before a span ends.
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
    )
    if queries:
        env["DJFLOW_TRACE_QUERIES"] = queries
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", traced]


# --- JSON log lines ----------------------------------------------------------------------------


def test_json_log_lines_carry_the_run_step_attempt_and_trace_ids(
    offers, django_capture_on_commit_callbacks
) -> None:
    stream = JsonStream()
    logger = logging.getLogger("workflows.step")
    logger.addHandler(stream.handler)
    try:
        flows.save_traced("standin:echo")
        with django_capture_on_commit_callbacks(execute=True):
            run = drive(run_start(workflow="traced", input={}).run)
    finally:
        logger.removeHandler(stream.handler)
    [line] = [line for line in stream.lines() if "fetched" in line["message"]]
    assert line["run_id"] == str(run.id)
    assert line["step_id"] == "fetch"
    assert line["attempt"] == 1
    assert line["trace_id"] == uuid.UUID(str(run.id)).hex
    assert line["level"] == "INFO" and line["logger"] == "workflows.step"


def test_a_json_line_inside_a_traced_attempt_carries_its_span(exported) -> None:
    stream = JsonStream()
    logger = logging.getLogger("tests.json")
    logger.addHandler(stream.handler)
    logger.setLevel(logging.INFO)
    try:
        with tracing.tracer().start_as_current_span("work") as span:
            logger.info("inside")
        logger.info("outside")
    finally:
        logger.removeHandler(stream.handler)
    inside, outside = stream.lines()
    context = span.get_span_context()
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
    assert outside["trace_id"] is None and outside["run_id"] is None


class JsonStream:
    """A handler set up as settings.LOGGING sets the console's with DJFLOW_LOG_FORMAT=json."""

    def __init__(self) -> None:
        self.records: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.records.append(self.handler.format(record))
        log_config.use_json(_Holder(self.handler))

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.records]


class _Holder:
    def __init__(self, handler: logging.Handler) -> None:
        self.handlers = [handler]
