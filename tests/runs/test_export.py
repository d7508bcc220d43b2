"""A run's export (CONTRACT section 16; runs.export): ``GET /runs/{id}/export`` and
``manage.py run_export`` write one JSON document of the run, its children, every attempt
with its model and tool calls whole, the document versions and recipes used; secrets masked,
tracebacks for operators, 404 for whoever may not read the run; bounded in memory."""

from __future__ import annotations

import io
import json
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import export
from runs.engine import calls
from runs.models import Content, ModelCall, Run, StepRun
from runs.status import RunStatus, StepStatus
from tests.runs.factories import RunFactory, StepRunFactory, WorkflowVersionFactory
from tests.runs.factories import support_ticket_document as document
from tests.runs.test_model_calls_api import _called as _model_call
from tests.runs.test_tool_calls import _called as _tool_called
from workflows import access
from workflows.services import recipe_save

pytestmark = pytest.mark.django_db

TOKEN = "[secret:0123456789abcdef0123]"
LONG = "word " * 50_000  # a prompt far longer than GET /runs/{id} embeds


def _client(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def _person(name: str) -> Any:
    return get_user_model().objects.create_user(username=name, password="a-long-pw-1")


def _exported(client: APIClient, run: Run) -> dict[str, Any]:
    response = client.get(f"/api/v1/runs/{run.id}/export")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.streaming
    return json.loads(b"".join(response.streaming_content))


def test_a_completed_run_with_recipe_calls_exports_prompts_replies_and_recipes(
    api: APIClient,
) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "Hi ${input}"})
    run = RunFactory(status=RunStatus.COMPLETED)
    prompt = {"system": "Be brief.", "messages": [{"role": "user", "content": LONG}]}
    call = _model_call(run, prompt=prompt, recipe="greet", recipe_version=recipe.version)
    body = _exported(api, run)
    assert (body["format"], body["format_version"]) == ("djflow-run-export", 1)
    assert body["server_version"] == export.server_version()
    assert body["exported_at"]
    assert (body["run"]["id"], body["run"]["status"]) == (str(run.id), "completed")
    assert body["run"]["output"] == {"sent": True}
    [step] = body["run"]["steps"]
    [exported] = step["model_calls"]
    assert exported["prompt"] == prompt
    assert exported["reply"] == {"text": "hello"}
    assert exported["prompt_digest"] == call.prompt_id
    assert (exported["input_tokens"], exported["output_tokens"]) == (12, 3)
    assert (exported["model"], exported["recipe"], exported["recipe_version"]) == (
        "gpt-4o-mini",
        "greet",
        recipe.version,
    )
    [used] = body["recipes"]
    assert (used["name"], used["version"], used["document"]) == (
        "greet",
        recipe.version,
        recipe.document,
    )
    [doc] = body["documents"]
    assert (doc["workflow"], doc["version"]) == (run.workflow_id, run.version.number)
    assert doc["document"] == run.version.document


def test_tool_calls_are_exported_with_arguments_and_results(api: APIClient) -> None:
    run = RunFactory()
    _tool_called(run, arguments={"path": "/a"}, result={"is_error": False, "text": "the page"})
    _tool_called(
        run, 2, result=None, status="retryable", error={"class": "retryable", "message": "x"}
    )
    steps = _exported(api, run)["run"]["steps"]
    exported = [c for s in steps for c in s["tool_calls"]]
    assert [(c["server"], c["tool"], c["status"]) for c in exported] == [
        ("docs", "read", "ok"),
        ("docs", "read", "retryable"),
    ]
    assert exported[0]["arguments"] == {"path": "/a"}
    assert exported[0]["result"] == {"is_error": False, "text": "the page"}
    assert (exported[1]["result"], exported[1]["error"]["class"]) == (None, "retryable")


def test_the_whole_journal_is_exported_past_the_answer_cap(api: APIClient, settings: Any) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "ANSWER_STEPS": 3}
    run = RunFactory()
    for attempt in range(1, 8):
        StepRunFactory(run=run, step_id="poll", attempt=attempt)
    steps = _exported(api, run)["run"]["steps"]
    assert [s["attempt"] for s in steps] == list(range(1, 8))


def test_children_are_exported_recursively_and_unreadable_ones_left_out(db: Any) -> None:
    run = RunFactory()
    step = StepRunFactory(run=run, step_id="sub", kind="subworkflow")
    child = RunFactory(version=run.version, parent_run=run, parent_step_run=step, root_run=run)
    StepRunFactory(run=child, step_id="classify")
    grandchild = RunFactory(version=run.version, parent_run=child, root_run=run)
    other = WorkflowVersionFactory(document={**document(), "id": "other_flow"})
    hidden = RunFactory(version=other, parent_run=run, root_run=run)
    viewer = _person("vic")
    access.grant(access.VIEWER, run.workflow_id, user=viewer)
    body = _exported(_client(viewer), run)
    [exported] = body["run"]["children"]
    assert exported["id"] == str(child.id)
    assert exported["parent"] == {"run": str(run.id), "step": "sub"}
    assert [s["step_id"] for s in exported["steps"]] == ["classify"]
    assert [c["id"] for c in exported["children"]] == [str(grandchild.id)]
    assert str(hidden.id) not in json.dumps(body)
    assert [d["workflow"] for d in body["documents"]] == [run.workflow_id]
    # Trusted code (the command) sees the whole tree, and the other workflow's document.
    whole = json.loads("".join(export.run_export(run_id=run.id).chunks()))
    assert [c["id"] for c in whole["run"]["children"]] == [str(child.id), str(hidden.id)]
    assert [d["workflow"] for d in whole["documents"]] == [run.workflow_id, "other_flow"]


def test_secrets_are_masked_everywhere(api: APIClient) -> None:
    schema = {
        "type": "object",
        "properties": {"ticket": {"type": "string"}, "key": {"type": "string", "writeOnly": True}},
    }
    version = WorkflowVersionFactory(document=document(input_schema=schema))
    run = RunFactory(version=version, secrets="sealed", input={"ticket": "x", "key": TOKEN})
    StepRunFactory(run=run, output={"echo": f"Bearer {TOKEN}"})
    _model_call(
        run, prompt={"system": None, "messages": [{"role": "user", "content": f"key={TOKEN}"}]}
    )
    _tool_called(run)
    child = RunFactory(version=version, secrets="sealed", parent_run=run, input={"k": TOKEN})
    response = api.get(f"/api/v1/runs/{run.id}/export")
    text = b"".join(response.streaming_content).decode()
    assert "[secret:" not in text
    body = json.loads(text)
    assert body["run"]["input"]["key"] == "••••"
    steps = body["run"]["steps"]
    assert steps[0]["output"] == {"echo": "Bearer ••••"}
    assert steps[1]["model_calls"][0]["prompt"]["messages"][0]["content"] == "key=••••"
    assert steps[2]["tool_calls"][0]["arguments"] == {"path": "/a", "key": "••••"}
    assert body["run"]["children"][0]["id"] == str(child.id)
    assert body["run"]["children"][0]["input"] == {"k": "••••"}


def test_tracebacks_only_for_operators(db: Any) -> None:
    run = RunFactory(status=RunStatus.FAILED)
    StepRunFactory(run=run, step_id="send", status=StepStatus.FAILED)
    viewer, operator = _person("vic"), _person("otto")
    access.grant(access.VIEWER, run.workflow_id, user=viewer)
    access.grant(access.OPERATOR, run.workflow_id, user=operator)
    [seen] = _exported(_client(viewer), run)["run"]["steps"]
    assert seen["error"] == {"class": "fatal", "message": "boom"}
    [operated] = _exported(_client(operator), run)["run"]["steps"]
    assert operated["error"]["traceback"] == "Traceback ..."


def test_a_stranger_gets_a_404_and_a_viewer_the_export(db: Any) -> None:
    run = RunFactory()
    stranger, viewer = _person("eve"), _person("vic")
    access.grant(access.VIEWER, run.workflow_id, user=viewer)
    response = _client(stranger).get(f"/api/v1/runs/{run.id}/export")
    assert response.status_code == 404
    assert [e["field"] for e in response.json()["errors"]] == ["id"]
    assert _exported(_client(viewer), run)["run"]["id"] == str(run.id)
    unknown = _client(viewer).get("/api/v1/runs/not-a-run/export")
    assert unknown.status_code == 404


def test_the_command_writes_a_file_or_stdout(tmp_path: Path) -> None:
    run = RunFactory(status=RunStatus.COMPLETED)
    StepRunFactory(run=run)
    target = tmp_path / "run.json"
    call_command("run_export", str(run.id), "-o", str(target))
    written = json.loads(target.read_text(encoding="utf-8"))
    assert (written["format"], written["format_version"]) == ("djflow-run-export", 1)
    assert written["run"]["id"] == str(run.id) and len(written["run"]["steps"]) == 1
    assert not (tmp_path / "run.json.part").exists()
    out = io.StringIO()
    call_command("run_export", str(run.id), stdout=out)
    assert json.loads(out.getvalue())["run"]["steps"] == written["run"]["steps"]
    with pytest.raises(CommandError, match="no run"):
        call_command("run_export", "00000000-0000-0000-0000-000000000000")


def _big_run(attempts: int) -> Run:
    """A run of ``attempts`` attempts of about 2 KiB of values and a model call each."""
    run = RunFactory(status=RunStatus.COMPLETED)
    value = {"text": "x" * 1024}
    StepRun.objects.bulk_create(
        StepRun(
            run=run,
            step_id="each",
            path=f"each[{n}]",
            kind="recipe",
            attempt=1,
            status=StepStatus.SUCCEEDED,
            input=value,
            output=value,
        )
        for n in range(attempts)
    )
    body = {"system": "s", "messages": [{"role": "user", "content": "y" * 1024}]}
    prompt, _ = Content.objects.get_or_create(
        digest=calls.digest(body), defaults={"body": body, "size": 1100}
    )
    ModelCall.objects.bulk_create(
        ModelCall(step_run_id=pk, run=run, provider="openai", model="m", prompt=prompt, status="ok")
        for pk in StepRun.objects.filter(run=run).values_list("id", flat=True)
    )
    return run


def _measured(run: Run) -> tuple[int, int, float]:
    """(bytes written, peak traced bytes, seconds) of exporting ``run``."""
    found = export.run_export(run_id=run.id)
    tracemalloc.start()
    started = time.monotonic()
    written = 0
    try:
        for chunk in found.chunks():
            written += len(chunk.encode())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return written, peak, time.monotonic() - started


def test_a_large_run_exports_in_bounded_memory(capsys: Any) -> None:
    small, large = _big_run(300), _big_run(3_000)
    small_bytes, small_peak, _ = _measured(small)
    large_bytes, large_peak, seconds = _measured(large)
    with capsys.disabled():
        print(
            f"\nexport of 3,000 attempts: {large_bytes} bytes, peak {large_peak} B, {seconds:.2f} s"
        )
    assert large_bytes > 9 * small_bytes > 9 * 3 * 1024 * 300
    # Ten times the journal, about the same memory: one batch at a time, never the whole.
    assert large_peak < 2 * small_peak + 1_048_576
    # Holding the document whole would take more than its bytes.
    assert large_peak < large_bytes / 2


def test_the_openapi_document_describes_the_export(api: APIClient) -> None:
    run = RunFactory(status=RunStatus.COMPLETED)
    StepRunFactory(run=run)
    schema = api.get("/api/v1/schema/?format=json").json()
    operation = schema["paths"]["/api/v1/runs/{run_id}/export"]["get"]
    assert operation["operationId"] == "runs_export"
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    # Its own answers, and those every operation may give (config.openapi: 406, 414, 429, 503,
    # and 400 for NUL in its path).
    assert {"200", "401", "404", "400", "414", "429"} <= set(operation["responses"])
    # OpenAPI 3.0's nullable is JSON Schema's type list.
    answer["properties"]["server_version"] = {"type": ["string", "null"]}
    jsonschema.validate(_exported(api, run), answer)


def _write_later(run: Run) -> None:
    try:
        StepRunFactory(run=run, step_id="later")
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_an_export_outside_a_transaction_reads_one_snapshot() -> None:
    """Outside any transaction (the command, a streamed answer) the export opens its own,
    REPEATABLE READ: an attempt written while it is half-way is not in it."""
    run = RunFactory(status=RunStatus.RUNNING)
    StepRunFactory(run=run, step_id="first")
    chunks = export.run_export(run_id=run.id).chunks()
    head = next(chunks) + next(chunks)  # the run's row is read: the snapshot is taken
    # Committed meanwhile by another connection (a thread has its own).
    writer = threading.Thread(target=_write_later, args=(run,))
    writer.start()
    writer.join()
    body = json.loads(head + "".join(chunks))
    assert [s["step_id"] for s in body["run"]["steps"]] == ["first"]
    again = json.loads("".join(export.run_export(run_id=run.id).chunks()))
    assert [s["step_id"] for s in again["run"]["steps"]] == ["first", "later"]


def test_a_batch_holds_at_most_batch_bytes_of_values(monkeypatch: Any) -> None:
    run = _big_run(9)  # each attempt about 2 KiB of values
    monkeypatch.setattr(export, "BATCH_BYTES", 5_000)
    assert [len(batch) for batch in export._batches(run.id)] == [2, 2, 2, 2, 1]
    monkeypatch.setattr(export, "BATCH_BYTES", 100)  # one attempt over it still goes alone
    assert [len(batch) for batch in export._batches(run.id)] == [1] * 9
