"""Hybrid knowledge-base retrieval end to end on Postgres with pgvector: real worker and beat
processes embed what ``write_kb`` steps write (through the local model server's
``/v1/embeddings``, OpenAI's wire format through the official SDK), and a recipe's context
finds by meaning a passage that shares no word with its query. Skipped, saying why, where
the PostgreSQL under test has no pgvector."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.db import connection

from runs.models import ModelCall, Run
from tests.model_server import EMBEDDINGS_PATH, Answer, ModelServer, Recorded, echo
from tests.processes import wait_for
from tests.workers.test_kb_e2e import ANSWER, WRITE
from tests.workers.test_recipe_e2e import configured, finished, save, start
from workflows import kb_vectors, knowledge
from workflows.models import KnowledgeDocument, KnowledgeEmbedding

pytestmark = [pytest.mark.slow]

MODEL = "openai:text-embedding-3-small"
TICKET = "my device swallowed a page"  # no word in common with any passage below
FIRST = "Open tray two, remove the crumpled sheet, reseed the rollers."
SECOND = "Pull the jammed sheet out through the rear door."
FAR = "Renew the certificate on the gateway."
# USD per million input tokens: high enough that a query's few tokens show in the cost.
PRICE = 1000


def by_topic(request: Recorded) -> Answer:
    """Embeddings by topic, not by word (the printing passages and the ticket near one
    another); chat completions echo, as the server's default does."""
    if request.path != EMBEDDINGS_PATH:
        return echo(request)
    vectors = []
    for text in request.inputs():
        if text.startswith("Printer") or text == TICKET:
            vectors.append([1.0, 0.1 if text != TICKET else 0.2, 0.0, 0.0])
        else:
            vectors.append([0.0, 0.0, 1.0, 0.2])
    return Answer(vectors=vectors)


def _embedded(document: KnowledgeDocument) -> bool:
    return KnowledgeEmbedding.objects.filter(document=document, model=MODEL).exists()


def _answer(model_server: ModelServer, logs: Any) -> tuple[Run, str, ModelCall]:
    before = len(model_server.requests)
    run = finished(start("kb_answer", {"ticket": TICKET}).id, logs)
    assert run.status == "completed", run.error
    sent = [r for r in model_server.requests[before:] if r.path != EMBEDDINGS_PATH]
    queries = [r for r in model_server.requests[before:] if r.path == EMBEDDINGS_PATH]
    assert [r.inputs() for r in queries] == [[TICKET]]  # the query, embedded by the worker
    [call] = ModelCall.objects.filter(run=run)
    return run, sent[-1].last_user_message(), call


def test_written_versions_are_embedded_by_a_worker_and_found_by_meaning(
    model_server: ModelServer, celery_worker, celery_beat, celery_processes, monkeypatch
) -> None:
    if connection.vendor != "postgresql" or kb_vectors.unavailable() is not None:
        pytest.skip(kb_vectors.unavailable() or "pgvector needs PostgreSQL")
    model_server.default = by_topic
    env = {
        **configured(monkeypatch, model_server.openai_env()),
        "DJFLOW_EMBEDDINGS_MODEL": MODEL,
        "DJFLOW_EMBEDDINGS_DIMENSIONS": "4",
        "DJFLOW_PRICES": f'{{"{MODEL}": {{"input": {PRICE}}}}}',
        # The sweep's period (beat) and its grace (two periods, in the worker).
        "DJFLOW_RECONCILE_SECONDS": "2",
    }
    celery_worker(env=env)
    celery_beat(env=env)
    logs = celery_processes.logs
    save("kb_write", WRITE)
    save("kb_answer", ANSWER)

    # 1. Two writes; a worker embeds each after its step, title and content.
    for key, title, answer in (("T-1", "Printer eats paper", FIRST), ("T-2", "Tunnel drops", FAR)):
        run = finished(start("kb_write", {"id": key, "title": title, "answer": answer}).id, logs)
        assert run.status == "completed", run.error
    first = KnowledgeDocument.objects.get(key="T-1", version=1)
    far = KnowledgeDocument.objects.get(key="T-2")
    wait_for(lambda: _embedded(first) and _embedded(far), timeout=20, message=logs)
    texts = sorted(r.inputs()[0] for r in model_server.requests if r.path == EMBEDDINGS_PATH)
    assert texts == [f"Printer eats paper\n\n{FIRST}", f"Tunnel drops\n\n{FAR}"]
    assert kb_vectors.stored(first.pk, MODEL) == pytest.approx([1.0, 0.1, 0.0, 0.0], abs=1e-6)

    # 2. The ticket shares no word with the passage: the vector side finds it; the prompt
    # holds it, best first; the ranks per list are on the record.
    run, prompt, call = _answer(model_server, logs)
    assert f"[Printer eats paper] {FIRST}" in prompt
    assert prompt.index("[Printer eats paper]") < prompt.index("[Tunnel drops]")
    assert call.retrieved["search"] == "hybrid"
    assert call.retrieved["hits"] == [
        {
            "key": "T-1",
            "version": 1,
            "score": round(1 / 61, 6),
            "ranks": {"fulltext": None, "vector": 1},
        },
        {
            "key": "T-2",
            "version": 1,
            "score": round(1 / 62, 6),
            "ranks": {"fulltext": None, "vector": 2},
        },
    ]
    # The query's embedding is on the attempt: its span, its tokens, its cost.
    [step] = run.steps.all()
    [span] = [s for s in step.spans if s["name"] == "query_embedding"]
    tokens = len(TICKET) // 4  # the model server counts a quarter of the characters
    assert (span["model"], span["provider"], span["usage"]) == (
        "text-embedding-3-small",
        "openai",
        {"input_tokens": tokens, "output_tokens": 0},
    )
    query_cost = Decimal(tokens * PRICE) / 1_000_000
    assert Decimal(str(span["cost_usd"])) == query_cost
    assert step.usage["models"]["text-embedding-3-small"]["input_tokens"] == tokens
    assert step.cost_usd == call.cost_usd + query_cost

    # 3. Version 2 gets its own embedding; the old one, as near, is never retrieved.
    run = finished(
        start("kb_write", {"id": "T-1", "title": "Printer eats paper", "answer": SECOND}).id, logs
    )
    second = KnowledgeDocument.objects.get(key="T-1", version=2)
    wait_for(lambda: _embedded(second), timeout=20, message=logs)
    assert _embedded(first)  # kept, as the version is
    run, prompt, call = _answer(model_server, logs)
    assert f"[Printer eats paper] {SECOND}" in prompt and FIRST not in prompt
    assert [(h["key"], h["version"]) for h in call.retrieved["hits"]] == [("T-1", 2), ("T-2", 1)]

    # 4. A version whose message was lost (written here, where no embeddings model is set,
    # so no message is sent): the beat's sweep finds it and a worker embeds it.
    lost = knowledge.kb_write(
        kb="answers", key="T-3", title="Printer smudges", content="Wipe the drum."
    ).document
    assert not _embedded(lost)
    wait_for(lambda: _embedded(lost), timeout=30, message=logs)
    assert "sent 1 version(s) missing an embedding by openai:text-embedding-3-small" in logs()
