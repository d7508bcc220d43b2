"""Traces from real processes: a gunicorn web process takes POST /api/v1/runs, prefork worker
children run the attempts and a beat fires the retry's back-off and the sleep; each exports
over OTLP/HTTP to a receiver in this test (tests/otlp_receiver.py), which decodes the
protobuf as a collector would.

One trace per run holds run → steps → attempts → the handler's spans and the model call,
though its parts were emitted by different processes at different times (the attempts by
the worker child that ran each, the run and step spans by the process that ended the run);
the request's own trace reaches the worker through the Celery message and links to the run.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from runs.models import Run
from runs.tracing import attempt_span_id, run_span_id
from tests.model_server import ModelServer
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.processes import wait_for

from . import flows_traced as flows

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
BASE_DIR = Path(__file__).resolve().parents[2]
# Spans leave a process within a tenth of a second (the batch processor's delay).
OTEL = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "djflow-test"}


def finished(run_id: Any, logs: Any, timeout: float = 60.0) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def hex_of(span_id: int) -> str:
    return format(span_id, "016x")


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, (name, sorted(s.name for s in spans))
    return found[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_one_trace_per_run_across_web_worker_and_beat_processes(
    model_server: ModelServer, celery_worker, celery_beat, celery_processes, tmp_path, monkeypatch
) -> None:
    with OtlpReceiver() as receiver:
        env = {
            **model_server.openai_env(),
            **OTEL,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "DJFLOW_TRACE_QUERIES": "true",
            "DJFLOW_LOG_FORMAT": "json",
        }
        for name, value in model_server.openai_env().items():
            monkeypatch.setenv(name, value)  # the web process's pre-flight, and this one's
        worker = celery_worker(env=env, workflow_modules=["tests.workers.flows_traced"])
        # After the worker saved its modules' documents: this version, with the model call,
        # is the latest.
        flows.save_traced("openai:gpt-4o-mini")
        celery_beat(env=env)  # the retry's back-off and the sleep are timers
        web, base = _gunicorn(celery_processes.env(env=env), tmp_path)
        try:
            user = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-1-long")
            token = Token.objects.create(user=user).key
            answer = _post(f"{base}/api/v1/runs", {"workflow": "traced", "input": {}}, token)
            run = finished(answer["id"], celery_processes.logs)
            retried = finished(
                _post(f"{base}/api/v1/runs", {"workflow": "traced_retried"}, token)["id"],
                celery_processes.logs,
            )
        finally:
            web.terminate()
            web.wait(10)
        assert run.status == "completed", run.error
        assert retried.status == "completed", retried.error
        trace_id = uuid.UUID(str(run.id)).hex

        def whole() -> list[ReceivedSpan] | None:
            spans = receiver.trace(trace_id)
            names = {span.name for span in spans}
            wanted = {"run traced", "attempt ask #1", "chat gpt-4o-mini", "lookup"}
            return spans if wanted <= names else None

        spans = wait_for(whole, timeout=20, interval=0.2, message=lambda: _names(receiver))

        # One trace: every span of the run has a parent in it, but the run's own.
        ids = {span.span_id: span for span in spans}
        root = one(spans, "run traced")
        assert root.parent is None and root.span_id == hex_of(run_span_id(run.id, 1))
        orphans = [s.name for s in spans if s is not root and s.parent not in ids]
        assert orphans == []
        for step in ("fetch", "fan", "ask"):
            assert one(spans, f"step {step}").parent == root.span_id
        fan = one(spans, "step fan")
        items = [span for span in spans if span.name == "step item"]
        assert len(items) == 2 and {span.parent for span in items} == {fan.span_id}
        # Attempts, under their steps, emitted by the worker's pool children; the handler's
        # spans under the attempt, nested as it nested them.
        fetch = one(spans, "attempt fetch #1")
        assert fetch.parent == one(spans, "step fetch").span_id
        assert fetch.attributes["djflow.attempt.status"] == "succeeded"
        assert fetch.resource["djflow.process"] == "worker"
        assert fetch.pid in worker.child_pids()
        lookup = one(spans, "lookup")
        assert lookup.parent == fetch.span_id
        assert one(spans, "parse").parent == lookup.span_id
        # The attempt's own queries, by the psycopg instrumentation, are in the run's trace.
        assert any(s.parent == lookup.span_id or s.parent == fetch.span_id for s in spans)
        # The model call: the GenAI attributes, what the model server answered.
        call = one(spans, "chat gpt-4o-mini")
        ask = one(spans, "attempt ask #1")
        assert call.parent == ask.span_id and call.kind == "client"
        assert [r for r in model_server.requests if r.path.endswith("/chat/completions")]
        assert call.attributes["gen_ai.operation.name"] == "chat"
        assert call.attributes["gen_ai.provider.name"] == "openai"
        assert call.attributes["gen_ai.request.model"] == "gpt-4o-mini"
        assert call.attributes["gen_ai.response.model"]
        [attempt] = run.steps.filter(step_id="ask")
        assert call.attributes["gen_ai.usage.input_tokens"] == attempt.usage["input_tokens"] > 0
        assert call.attributes["gen_ai.usage.output_tokens"] == attempt.usage["output_tokens"] > 0
        assert call.attributes["gen_ai.request.max_tokens"] == 40
        # Every span of the run's structure lies within its parent's time (the Celery and
        # query spans the attempts caused are in the trace too, but a task sent at the end
        # of an attempt runs after it).
        for span in spans:
            parent = ids.get(span.parent or "")
            if parent is not None and _ours(span) and _ours(parent):
                assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns, span.name

        # The request: Django's server span links to the run, and its trace reaches a worker
        # through the Celery message (the task span the attempt links to).
        [server] = [
            s
            for s in receiver.spans
            if s.kind == "server" and s.attributes.get("djflow.run.id") == str(run.id)
        ]
        assert server.resource["djflow.process"] == "web"
        assert (trace_id, root.span_id) in server.links
        carried = [
            s
            for s in receiver.spans
            if s.trace_id == server.trace_id and s.name == "run/workers.execute_step"
        ]
        assert carried, _names(receiver)
        assert any(link[1] in {c.span_id for c in carried} for link in fetch.links)

        # The retried run: two attempts of one step, the failed one an error; the sleep's
        # attempt, which no worker ran, emitted at the run's end with the journal's times.
        retried_id = uuid.UUID(str(retried.id)).hex

        def retried_whole() -> list[ReceivedSpan] | None:
            spans = receiver.trace(retried_id)
            return spans if any(s.name == "run traced_retried" for s in spans) else None

        spans = wait_for(retried_whole, timeout=20, interval=0.2)
        flaky = one(spans, "step flaky")
        first, second = one(spans, "attempt flaky #1"), one(spans, "attempt flaky #2")
        assert first.parent == second.parent == flaky.span_id
        assert first.status_code == 2 and first.attributes["error.type"] == "retryable"
        assert flaky.attributes["djflow.step.attempts"] == 2
        [nap_row] = retried.steps.filter(step_id="nap")
        nap = one(spans, "attempt nap #1")
        assert nap.span_id == hex_of(attempt_span_id(nap_row.id))
        assert nap.parent == one(spans, "step nap").span_id
        assert nap.end_ns - nap.start_ns >= 300_000_000  # the sleep's 300 ms

        # JSON log lines of the worker carry the attempt's ids.
        lines = [_json(line) for line in celery_processes.logs().splitlines()]
        [fetched] = [line for line in lines if line and "fetched 2 rows" in line["message"]]
        assert fetched["run_id"] == str(run.id) and fetched["step_id"] == "fetch"
        assert fetched["attempt"] == 1
        assert fetched["trace_id"] == trace_id and fetched["span_id"] == fetch.span_id


def _ours(span: ReceivedSpan) -> bool:
    return any(key.startswith("djflow.") for key in span.attributes)


def _json(line: str) -> dict[str, Any] | None:
    start = line.find("{")
    if start < 0:
        return None
    try:
        value = json.loads(line[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) and "message" in value else None


def _names(receiver: OtlpReceiver) -> str:
    return "\n".join(sorted(f"{s.trace_id[:8]} {s.name} <- {s.parent}" for s in receiver.spans))


def _gunicorn(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = (tmp_path / "gunicorn.log").open("wb")
    web = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gunicorn"),
            "config.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
        ],
        cwd=BASE_DIR,
        env={**env, "DJFLOW_SSL_REDIRECT": "false", "ALLOWED_HOSTS": "127.0.0.1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert web.poll() is None, (tmp_path / "gunicorn.log").read_text()
        try:
            with urllib.request.urlopen(f"{base}/api/v1/definition.schema.json", timeout=2):
                return True
        except OSError:
            return False

    wait_for(up, timeout=60, interval=0.3)
    return web, base


def _post(url: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Token {token}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 201
        return dict(json.loads(answer.read()))
