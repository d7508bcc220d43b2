"""Knowledge-base embeddings and hybrid retrieval below the workers' processes: storage in
pgvector, the HNSW index the query uses, the embedding task's failures and retries, the
sweep's choice, and the fallbacks where vectors cannot be stored (a system check and a log
line, never a crash). End to end with real workers: test_kb_hybrid_e2e.py.

The pgvector tests need the extension in the PostgreSQL under test (README: "Embeddings and
hybrid search"); they skip, saying so, where it is missing. The fallback tests run
everywhere."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.signals import task_prerun
from django.conf import settings
from django.core.cache import cache
from django.db import connection

from config.celery import recycle_database_connections
from tests.model_server import Answer, ModelServer, Recorded
from workers import kb_embed, providers
from workers.tasks import embed_kb_document
from workflows import checks, kb_search, kb_vectors, knowledge
from workflows.models import KnowledgeDocument, KnowledgeEmbedding

pytestmark = pytest.mark.django_db

BASE_DIR = Path(__file__).resolve().parent.parent.parent
STANDIN = "standin:hash"
# Texts that share no word with each other, placed near or far by the scripted server.
PAPER = "Printer eats paper\n\nOpen tray two, remove the crumpled sheet, reseed the rollers."
QUERY = "my device swallowed a page"
VPN = "Tunnel drops\n\nRenew the certificate on the gateway."


def topical(request: Recorded) -> Answer:
    """Embeddings by topic, not by word: printing texts and the query near one another."""
    vectors = []
    for text in request.inputs():
        if "Printer" in text or "sheet" in text:
            vectors.append([1.0, 0.1, 0.0, 0.0])
        elif text == QUERY:
            vectors.append([0.9, 0.2, 0.1, 0.0])
        else:
            vectors.append([0.0, 0.0, 1.0, 0.2])
    return Answer(vectors=vectors)


@pytest.fixture
def vectors() -> Iterator[None]:
    if connection.vendor != "postgresql":
        pytest.skip("pgvector needs PostgreSQL")
    why = kb_vectors.unavailable()
    if why is not None:
        pytest.skip(why)
    kb_embed._indexed.clear()
    yield
    cache.clear()


@pytest.fixture
def eager_tasks() -> Iterator[None]:
    """Tasks applied in this process, inside the test's transaction: without the worker's
    per-task connection recycling (config.celery), which would close the test's connection."""
    task_prerun.disconnect(recycle_database_connections)
    yield
    task_prerun.connect(recycle_database_connections)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_MODEL", STANDIN)
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_DIMENSIONS", 16)
    return STANDIN


@pytest.fixture
def openai_embeddings(monkeypatch: pytest.MonkeyPatch, model_server: ModelServer) -> str:
    for name, value in model_server.openai_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_MODEL", "openai:text-embedding-3-small")
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_DIMENSIONS", 4)
    model_server.default = topical
    return "openai:text-embedding-3-small"


def _write(key: str, text: str, kb: str = "answers") -> KnowledgeDocument:
    title, _, content = text.partition("\n\n")
    return knowledge.kb_write(kb=kb, key=key, title=title, content=content).document


def test_a_version_is_embedded_once_and_its_nearest_query_reads_the_hnsw_index(
    vectors: None, standin: str
) -> None:
    document = _write("jam", PAPER)

    assert kb_embed.embed_document(document.pk) == "stored"
    assert kb_embed.embed_document(document.pk) == "exists"  # a duplicate message

    [row] = KnowledgeEmbedding.objects.filter(document=document)
    assert (row.model, row.dimensions) == (STANDIN, 16)
    expected = providers.embed(
        STANDIN, [kb_embed.document_text(document.title, document.content)], dimensions=16
    )
    assert kb_vectors.stored(document.pk, STANDIN) == pytest.approx(expected.vectors[0], abs=1e-6)
    name = kb_vectors.index_name(STANDIN, 16)
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [name])
        [(definition,)] = cursor.fetchall()
    assert "USING hnsw (((embedding)::vector(16)) vector_cosine_ops)" in definition
    assert "WHERE (((model)::text = 'standin:hash'::text) AND (dimensions = 16))" in definition
    # The query as retrieval issues it, with sequential scans allowed: the planner picks the
    # index on its own.
    query = providers.embed(STANDIN, ["printer paper"], dimensions=16).vectors[0]
    plan = kb_vectors.explain_nearest([document.kb_id], STANDIN, query, 20)
    assert f"Index Scan using {name}" in plan, plan
    assert kb_vectors.nearest([document.kb_id], STANDIN, query, 20)[0][0] == document.pk


def test_hybrid_finds_by_meaning_what_shares_no_word_and_only_current_versions(
    vectors: None, openai_embeddings: str, model_server: ModelServer
) -> None:
    old = _write("jam", "Printer jams\n\nCall the technician.")
    other = _write("vpn", VPN)
    for document in (old, other):
        assert kb_embed.embed_document(document.pk) == "stored"
    new = _write("jam", PAPER)  # version 2
    assert kb_embed.embed_document(new.pk) == "stored"
    assert kb_embed.embed_document(old.pk) == "superseded"  # its embedding stays, unused
    sent = [r.inputs() for r in model_server.requests]
    assert sent == [["Printer jams\n\nCall the technician."], [VPN], [PAPER]]
    assert [r.body["dimensions"] for r in model_server.requests] == [4, 4, 4]

    query = providers.embed(openai_embeddings, [QUERY], dimensions=4).vectors[0]
    embedding = kb_search.QueryEmbedding(openai_embeddings, query)
    assert kb_search.search("answers", QUERY, 5, match="any") == []  # no word in common
    hits = kb_search.search("answers", QUERY, 5, match="any", backend="hybrid", embedding=embedding)

    assert [(h.key, h.version, h.ranks) for h in hits] == [
        ("jam", 2, (None, 1)),
        ("vpn", 1, (None, 2)),
    ]
    assert hits[0].score == pytest.approx(1 / 61)
    # A word both lists find ranks first: fused, not replaced.
    both = kb_search.search(
        "answers", "gateway " + QUERY, 5, match="any", backend="hybrid", embedding=embedding
    )
    assert [(h.key, h.ranks) for h in both] == [("vpn", (1, 2)), ("jam", (None, 1))]


def test_the_sweep_picks_current_versions_missing_an_embedding_after_the_grace(
    vectors: None, standin: str
) -> None:
    embedded = _write("a", "Printer\n\njam")
    kb_embed.embed_document(embedded.pk)
    missing = _write("b", "Tunnel\n\ndrops")
    replaced = _write("c", "Old\n\ntext")
    newer = _write("c", "New\n\ntext")

    assert kb_vectors.missing(STANDIN, 16, limit=10, older_than_s=0) == [missing.pk, newer.pk]
    assert kb_vectors.missing(STANDIN, 16, limit=1, older_than_s=0) == [missing.pk]
    assert kb_vectors.missing(STANDIN, 16, limit=10, older_than_s=3600) == []  # too new
    # Another length of the same model is another embedding.
    assert embedded.pk in kb_vectors.missing(STANDIN, 8, limit=10, older_than_s=0)
    assert replaced.pk not in kb_vectors.missing(STANDIN, 8, limit=10, older_than_s=0)


def test_a_fatal_failure_is_logged_by_name_and_remembered_and_a_retryable_one_retried(
    vectors: None,
    openai_embeddings: str,
    model_server: ModelServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    eager_tasks: None,
) -> None:
    refused = _write("refused", PAPER)
    model_server.enqueue(Answer(status=400, error_message="input is not allowed"))
    with caplog.at_level(logging.ERROR, logger="workers.tasks"):
        assert embed_kb_document.apply(args=[refused.pk]).get() == "failed"
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"embedding of document {refused.pk} by {openai_embeddings} failed, fatal" in line
    assert "input is not allowed" in line
    assert not KnowledgeEmbedding.objects.filter(document=refused).exists()

    # The sweep leaves the failed one alone for an hour; it sends the others (once).
    waiting = _write("waiting", VPN)
    sent: list[Any] = []
    monkeypatch.setattr(knowledge, "send_embed", sent.append)
    assert kb_embed.sweep(grace_s=0) == 1
    assert sent == [waiting.pk]
    assert kb_embed.sweep(grace_s=0) == 0  # sent already: its message may still be coming

    # 429 then an answer: retried with back-off (run eagerly here, so at once), then stored.
    model_server.enqueue(
        Answer(status=429, error_message="slow down", headers={"retry-after": "1"})
    )
    assert embed_kb_document.apply(args=[waiting.pk]).get() == "stored"
    assert [r.inputs() for r in model_server.requests[-2:]] == [[VPN], [VPN]]


def test_without_vectors_retrieval_is_full_text_said_once_and_by_the_check(
    standin: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    why = "the pgvector extension is not installed in this PostgreSQL: install it"
    monkeypatch.setattr(kb_vectors, "unavailable", lambda conn=None: why)
    monkeypatch.setattr(kb_embed, "_said", set())
    document = _write("jam", PAPER)

    with caplog.at_level(logging.WARNING, logger="workers.kb_embed"):
        assert kb_embed.hybrid_model() is None
        assert kb_embed.hybrid_model() is None
        assert kb_embed.embed_document(document.pk) == "unavailable"
        assert kb_embed.sweep() == 0
    said = [r.getMessage() for r in caplog.records if r.name == "workers.kb_embed"]
    assert said == [f"knowledge-base embeddings: DJFLOW_EMBEDDINGS_MODEL is '{STANDIN}', but {why}"]

    [warning] = checks.embeddings_storage(databases=["default"])
    assert warning.id == "djflow.W001" and why in warning.msg
    if connection.vendor == "postgresql":
        # Whether PostgreSQL has it is asked only when the check may use the database.
        assert checks.embeddings_storage(databases=None) == []


def test_no_check_warning_without_an_embeddings_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_MODEL", "")
    assert checks.embeddings_storage(databases=["default"]) == []


def test_the_check_on_the_embedded_default_says_sqlite_stores_no_vectors(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env.update(DJFLOW_EMBEDDINGS_MODEL=STANDIN, DJFLOW_VAR_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "djflow.W001" in said and "DJFLOW_EMBEDDINGS_MODEL is 'standin:hash'" in said
    assert "the sqlite database cannot store embeddings" in said


def test_postgres_without_the_extension_is_said_and_the_next_migrate_installs_it(
    vectors: None, standin: str
) -> None:
    """The extension dropped (DDL in the test's transaction, rolled back after): what a
    PostgreSQL that never had it created looks like; install (migrate's post_migrate) makes
    the vector column again."""
    with connection.cursor() as cursor:
        cursor.execute("DROP EXTENSION vector CASCADE")
    kb_vectors.forget()
    why = kb_vectors.unavailable()
    assert why is not None and "the pgvector extension is available but not created" in why
    assert kb_embed.hybrid_model() is None
    [warning] = checks.embeddings_storage(databases=["default"])
    assert "run manage.py migrate" in warning.msg

    assert kb_vectors.install() is None
    document = _write("jam", PAPER)
    assert kb_embed.embed_document(document.pk) == "stored"


@pytest.mark.parametrize("model", ["", STANDIN], ids=["unset", "set"])
def test_a_new_version_is_sent_to_be_embedded_after_commit_only_when_a_model_is_set(
    model: str, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    monkeypatch.setitem(settings.DJFLOW, "EMBEDDINGS_MODEL", model)
    sent: list[tuple[str, Any]] = []

    class Signature:
        def __init__(self, name: str, args: Any, **options: Any) -> None:
            self.message = (name, args)

        def apply_async(self) -> None:
            sent.append(self.message)

    monkeypatch.setattr(knowledge.current_app, "signature", Signature)
    with django_capture_on_commit_callbacks(execute=True):
        document = _write("jam", PAPER)
        assert sent == []  # not before the commit
        _write("jam", PAPER)  # the same text: no version, nothing to embed
    assert sent == ([("workers.embed_kb_document", (document.pk,))] if model else [])
