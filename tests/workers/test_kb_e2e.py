"""Knowledge bases end to end on Postgres: real worker and beat processes run ``write_kb`` steps
and a recipe whose context retrieves what they wrote; the local model server
(tests/model_server.py, OpenAI's wire format through the official SDK) records the prompt it
was sent. (The embedded default, SQLite with FTS5: tests/test_standalone_kb.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from runs.models import ModelCall, Run
from tests.model_server import ModelServer
from tests.workers.test_recipe_e2e import configured, finished, save, start
from workflows import kb_search
from workflows.models import KnowledgeDocument

pytestmark = [pytest.mark.slow]

FIRST = "Clear the export cache, then export again."
SECOND = "Update to version 2.1: it no longer crashes on large exports."
WRITE = {
    "id": "keep",
    "kind": "write_kb",
    "kb": "answers",
    "key": "${input.id}",
    "title": "${input.title}",
    "content": "${input.answer}",
}
ANSWER = {
    "id": "answer",
    "kind": "recipe",
    "model": "openai:gpt-4o-mini",
    "system": "Answer support tickets.",
    "prompt": "Past answers:\n\n${context}\n\nTicket: ${input.ticket}",
    "context": {"kb": "answers", "query": "${input.ticket}", "top_k": 3},
    "max_tokens": 100,
}


def _ticket_answer(model_server: ModelServer, logs: Any, ticket: str) -> tuple[Run, str, ModelCall]:
    before = len(model_server.requests)
    run = finished(start("kb_answer", {"ticket": ticket}).id, logs)
    assert run.status == "completed", run.error
    [sent] = model_server.requests[before:]
    [call] = ModelCall.objects.filter(run=run)
    return run, sent.last_user_message(), call


def test_a_write_is_searched_and_retrieved_into_a_prompt_and_a_new_version_replaces_it(
    model_server: ModelServer, celery_worker, celery_beat, celery_processes, monkeypatch, api
) -> None:
    env = configured(monkeypatch, model_server.openai_env())
    celery_worker(env=env)
    celery_beat()
    logs = celery_processes.logs
    save("kb_write", WRITE)
    save("kb_answer", ANSWER)
    # A neighbour the ticket's words also find, ranked below the answer.
    save("kb_other", {**WRITE, "id": "other", "kb": "answers"})

    # 1. The write: the knowledge base is created, version 1 answered.
    run = finished(
        start("kb_write", {"id": "T-1", "title": "Export crashes", "answer": FIRST}).id, logs
    )
    assert run.status == "completed", run.error
    [keep] = run.steps.filter(step_id="keep")
    assert keep.output == {"kb": "answers", "key": "T-1", "version": 1}
    assert keep.input == {
        "kb": "answers",
        "key": "T-1",
        "title": "Export crashes",
        "content": FIRST,
    }
    document = KnowledgeDocument.objects.get(key="T-1")
    assert (document.run_id, document.step_run_id) == (run.id, keep.id)
    other = finished(
        start(
            "kb_other", {"id": "T-2", "title": "Invoices", "answer": "Export invoices as PDF."}
        ).id,
        logs,
    )
    assert other.status == "completed", other.error

    # 2. The search finds it.
    [hit, *_] = kb_search.search("answers", "export cache", 5)
    assert (hit.key, hit.version, hit.content) == ("T-1", 1, FIRST)

    # 3. The recipe's prompt, as the model server got it, holds the passage; what was retrieved
    # is on the model call, in the run API and in the attempt's spans.
    run, prompt, call = _ticket_answer(model_server, logs, "My export crashes, what now?")
    assert f"[Export crashes] {FIRST}" in prompt
    assert prompt.index("[Export crashes]") < prompt.index("[Invoices]")  # best first
    assert call.retrieved["kb"] == "answers"
    assert call.retrieved["query"] == "My export crashes, what now?"
    assert [(h["key"], h["version"]) for h in call.retrieved["hits"]] == [("T-1", 1), ("T-2", 1)]
    assert call.retrieved["hits"][0]["score"] > call.retrieved["hits"][1]["score"] > 0
    body = api.get(f"/api/v1/runs/{run.id}").json()
    [shown] = body["steps"][0]["model_calls"]
    assert shown["retrieved"] == call.retrieved
    [answer_step] = run.steps.all()
    [retrieval] = [span for span in answer_step.spans if span["name"] == "retrieval"]
    assert retrieval["attributes"]["hits"] == call.retrieved["hits"]

    # 4. A second write of the key: version 2; the search finds the new text, not the old.
    run = finished(
        start("kb_write", {"id": "T-1", "title": "Export crashes", "answer": SECOND}).id, logs
    )
    assert run.steps.get(step_id="keep").output["version"] == 2
    assert [(h.key, h.version) for h in kb_search.search("answers", "version large", 5)] == [
        ("T-1", 2)
    ]
    assert kb_search.search("answers", "cache", 5) == []
    run, prompt, call = _ticket_answer(model_server, logs, "My export crashes, what now?")
    assert f"[Export crashes] {SECOND}" in prompt and FIRST not in prompt
    assert call.retrieved["hits"][0] == {**call.retrieved["hits"][0], "key": "T-1", "version": 2}

    # 5. The same text again (a retried write) makes no version.
    run = finished(
        start("kb_write", {"id": "T-1", "title": "Export crashes", "answer": SECOND}).id, logs
    )
    assert run.steps.get(step_id="keep").output["version"] == 2
    assert KnowledgeDocument.objects.filter(key="T-1").count() == 2

    # 6. A context that finds nothing renders an empty ${context}; the call says so.
    run, prompt, call = _ticket_answer(model_server, logs, "zebra")
    assert prompt == "Past answers:\n\n\n\nTicket: zebra"
    assert call.retrieved["hits"] == []


def test_a_subworkflow_recipe_reading_a_missing_knowledge_base_fails_naming_the_field(
    model_server: ModelServer, celery_worker, celery_processes, monkeypatch
) -> None:
    """A child's steps are not pre-flighted: the step fails when it reaches retrieval."""
    env = configured(monkeypatch, model_server.openai_env())
    monkeypatch.setitem(settings.DJFLOW, "DEFAULT_MODEL", "")
    celery_worker(env=env)
    logs = celery_processes.logs
    save("kb_child", {**ANSWER, "context": {"kb": "nowhere"}})
    save("kb_parent", {"id": "child", "kind": "subworkflow", "workflow": "kb_child"})
    run = finished(start("kb_parent", {"ticket": "x"}).id, logs)
    assert run.status == "failed"
    failed = [
        step for step in _all_steps(run) if step.step_id == "answer" and step.status == "failed"
    ]
    assert len(failed) == 1 and failed[0].error["class"] == "fatal"
    assert "context.kb: knowledge base 'nowhere' does not exist" in failed[0].error["message"]
    assert model_server.requests == []  # no call made


def _all_steps(run: Run) -> list[Any]:
    from runs.models import StepRun

    return list(StepRun.objects.filter(run__root_run=run)) + list(StepRun.objects.filter(run=run))
