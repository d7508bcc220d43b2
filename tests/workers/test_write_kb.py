"""The ``write_kb`` step's two halves without worker processes (tests/workers/test_kb_e2e.py
runs them in real ones): the planner resolves the document into the attempt's input, a bad
field failing the attempt naming it; the body upserts and answers ``{kb, key, version}``. And
the recipe context's own pieces: the query, and the passages formatted into ``${context}``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runs import services
from runs.models import StepRun
from workers.context import StepContext, bound_logger
from workers.kinds import recipe as recipe_kind
from workers.kinds import write_kb
from workflows import kb_search, kinds
from workflows.failures import KindFailure
from workflows.models import KnowledgeDocument
from workflows.services import definition_save


def _ctx(run_id: str = "00000000-0000-4000-8000-000000000001") -> StepContext:
    return StepContext(
        run_id=run_id,
        step_id="keep",
        attempt=1,
        idempotency_key="key",
        workflow_id="flow",
        logger=bound_logger(run_id, "keep", 1),
        step_run_id=7,
        deadline_at=datetime.now(UTC) + timedelta(seconds=5),
    )


def _start(step: dict[str, Any], input: Any) -> StepRun:
    document = {"id": "kb_prep", "steps": [{"id": "keep", "kind": "write_kb", **step}]}
    definition_save(document=document)
    run = services.run_start(workflow="kb_prep", input=input).run
    [row] = StepRun.objects.filter(run=run)
    return row


def test_the_kind_is_registered_as_a_worker_kind() -> None:
    kind = kinds.get("write_kb")
    assert kind is not None and kind.role == kinds.Role.WORKER and kind.prepare is write_kb.prepare
    assert kind.body is not None and kind.body({"id": "x"}, "flow") is write_kb.write


@pytest.mark.django_db
def test_templates_are_resolved_into_the_attempts_input() -> None:
    row = _start(
        {"kb": "answers", "key": "${input.id}", "title": "${input.t}", "content": "${input.doc}"},
        {"id": "T-1", "t": "Export", "doc": {"steps": ["clear", "retry"]}},
    )
    assert row.status == "scheduled"
    assert row.input == {
        "kb": "answers",
        "key": "T-1",
        "title": "Export",
        # Not text: stored as its compact JSON.
        "content": '{"steps":["clear","retry"]}',
    }
    untitled = _start(
        {"kb": "${input.kb}", "key": "k", "content": "${input.c}"}, {"kb": "b", "c": "x"}
    )
    assert untitled.input == {"kb": "b", "key": "k", "title": "", "content": "x"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("step", "input", "message"),
    [
        ({"kb": "${input.kb}"}, {"kb": 5}, "kb: resolved to a number: must be a non-empty string"),
        ({"kb": "${input.kb}"}, {}, "kb: resolved to null: must be a non-empty string"),
        ({"kb": "${input.kb}"}, {"kb": "Not OK"}, "kb: resolved to 'Not OK': 'Not OK' is not a"),
        ({"key": "${input.k}"}, {"k": ""}, "key: resolved to '', not a non-empty string"),
        ({"key": "${input.k}"}, {"k": ["a"]}, "key: resolved to an array, not a non-empty"),
        ({"key": "${input.k}"}, {"k": "k" * 201}, "key: is 201 characters; at most 200"),
        ({"title": "${input.t}"}, {"t": {"a": 1}}, "title: resolved to an object, not a string"),
        ({"title": "${input.t}"}, {"t": "t" * 501}, "title: is 501 characters; at most 500"),
        ({"content": "${input.c}"}, {}, "content: resolved to null"),
        ({"content": "${input.c}"}, {"c": ""}, "content: resolved to empty text"),
    ],
    ids=[
        "kb-number",
        "kb-null",
        "kb-name",
        "key-empty",
        "key-array",
        "key-long",
        "title-object",
        "title-long",
        "content-null",
        "content-empty",
    ],
)
def test_a_field_that_cannot_be_written_fails_the_attempt_naming_it(
    step: dict[str, Any], input: Any, message: str
) -> None:
    row = _start({"kb": "answers", "key": "k", "content": "c", **step}, input)
    assert row.status == "failed"
    assert row.error["class"] == "invalid_input"
    assert row.error["message"].startswith(message), row.error
    assert not KnowledgeDocument.objects.exists()


@pytest.mark.django_db
def test_the_body_writes_a_version_per_change_and_answers_it() -> None:
    given = {"kb": "answers", "key": "T-1", "title": "Export", "content": "Clear the cache."}
    assert write_kb.write(_ctx(), given) == {"kb": "answers", "key": "T-1", "version": 1}
    # A retry of the same attempt: the same text, no new version.
    ctx = _ctx()
    assert write_kb.write(ctx, given) == {"kb": "answers", "key": "T-1", "version": 1}
    [span] = ctx.spans
    assert span.name == "kb_write" and span.attributes["created"] is False
    changed = {**given, "content": "Update to 2.1."}
    assert write_kb.write(_ctx(), changed)["version"] == 2
    newest = KnowledgeDocument.objects.get(current=True)
    assert str(newest.run_id).endswith("1") and newest.step_run_id == 7


@pytest.mark.django_db
def test_content_over_the_setting_fails_invalid_input_naming_it(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "KB_MAX_CONTENT_BYTES": 8}
    given = {"kb": "answers", "key": "k", "title": "", "content": "123456789"}
    with pytest.raises(KindFailure) as failed:
        write_kb.write(_ctx(), given)
    assert failed.value.error_class == "invalid_input"
    assert failed.value.message.startswith("write_kb: content: is 9 bytes")


def test_an_input_that_is_not_a_prepared_document_is_fatal() -> None:
    with pytest.raises(KindFailure) as failed:
        write_kb.write(_ctx(), {"kb": "answers"})
    assert failed.value.error_class == "fatal"


# --- the recipe's context -------------------------------------------------------------------


def _hit(key: str, content: str, title: str = "") -> kb_search.Hit:
    return kb_search.Hit(key=key, version=1, title=title, content=content, score=1.0)


def test_passages_are_blocks_best_first_within_the_bound() -> None:
    hits = [_hit("a", "first", "A"), _hit("b", "second"), _hit("c", "x" * 100)]
    text, used = recipe_kind.format_context(hits, 10_000)
    assert text == "[A] first\n\n[b] second\n\n[c] " + "x" * 100
    assert [hit.key for hit in used] == ["a", "b", "c"]
    text, used = recipe_kind.format_context(hits, 40)
    assert len(text.encode()) <= 40 and text.startswith("[A] first\n\n[b] second\n\n[c] xx")
    assert [hit.key for hit in used] == ["a", "b", "c"]
    text, used = recipe_kind.format_context([_hit("é", "é" * 50)], 9)
    assert len(text.encode()) <= 9 and [hit.key for hit in used] == ["é"]
    assert recipe_kind.format_context([], 100) == ("", [])


@pytest.mark.parametrize(
    ("context", "step_input", "query"),
    [
        ({"kb": "a"}, "export crashes", "export crashes"),
        ({"kb": "a"}, {"ticket": "export"}, '{"ticket":"export"}'),
        ({"kb": "a", "query": "${input.ticket} now"}, {"ticket": "export"}, "export now"),
        ({"kb": "a", "query": "${input.missing}"}, {}, ""),
        ({"kb": "a"}, "x" * 5000, "x" * kb_search.MAX_QUERY_CHARS),
    ],
    ids=["text", "json", "template", "missing", "cut"],
)
def test_the_query_is_the_rendered_template_or_the_step_input(
    context: dict[str, Any], step_input: Any, query: str
) -> None:
    assert recipe_kind._query(context, step_input) == query


def test_a_query_rendered_past_the_bound_fails_naming_it() -> None:
    context = {"kb": "a", "query": "${input}" * 3}
    with pytest.raises(KindFailure) as failed:
        recipe_kind._query(context, "x" * 400_000)
    assert failed.value.error_class == "invalid_input"
    assert "context.query" in failed.value.message


@pytest.mark.django_db
def test_retrieval_is_recorded_with_the_runs_secrets_concealed() -> None:
    from workflows import knowledge

    knowledge.kb_write(kb="answers", key="T-1", title="Export", content="Clear the export cache.")
    ctx = _ctx()
    ctx.conceal = lambda value: (
        value.replace("hunter2", "••••") if isinstance(value, str) else value
    )
    text, retrieved = recipe_kind._retrieve(
        ctx, {"kb": "answers", "query": "export ${input.token}"}, {"token": "hunter2"}
    )
    assert text == "[Export] Clear the export cache."
    assert retrieved["query"] == "export ••••" and "hunter2" not in str(retrieved)
    assert [(h["key"], h["version"]) for h in retrieved["hits"]] == [("T-1", 1)]
    [span] = ctx.spans
    assert span.name == "retrieval" and span.attributes["query"] == "export ••••"
    assert span.attributes["hits"] == retrieved["hits"]


@pytest.mark.django_db
def test_a_run_secret_written_to_a_knowledge_base_is_stored_masked() -> None:
    """A knowledge base is shared: its readers need not be able to read the run, and it is
    stored as it was written. A writeOnly input field reaching ``write_kb`` (through
    ``${input.x}`` or the whole input) must not land there in plaintext (CONTRACT section 8:
    the database holds secrets encrypted, people see ``••••``)."""
    from workers.execution import execute
    from workflows.secrets import MASK

    plaintext = "sk-live-4f9a2c7e1b"
    document = {
        "id": "kb_secret",
        "input_schema": {
            "type": "object",
            "properties": {"token": {"type": "string", "writeOnly": True}},
        },
        "steps": [
            {
                "id": "keep",
                "kind": "write_kb",
                "kb": "answers",
                "key": "T-${input.token}",
                "title": "key ${input.token}",
                "content": {"note": "use ${input.token}", "all": "${input}"},
            }
        ],
    }
    definition_save(document=document)
    run = services.run_start(workflow="kb_secret", input={"token": plaintext}).run
    execute(StepRun.objects.get(run=run, status="scheduled").id, worker="here")
    row = StepRun.objects.get(run=run, step_id="keep")
    assert row.status == "succeeded", row.error
    [stored] = KnowledgeDocument.objects.filter(kb__name="answers")
    for text in (stored.key, stored.title, stored.content):
        assert plaintext not in text
    assert stored.key == f"T-{MASK}" and stored.title == f"key {MASK}"
    assert MASK in stored.content and "[secret:" not in stored.content
    assert row.output == {"kb": "answers", "key": f"T-{MASK}", "version": 1}
