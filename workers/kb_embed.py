"""Embeddings of knowledge-base documents, computed by workers after each write, and the
sweep that makes up for lost messages (CONTRACT section 10: hybrid retrieval when
``DJFLOW_EMBEDDINGS_MODEL`` is set). The tasks (``workers.tasks``) are thin: they call
:func:`embed_document` and :func:`sweep`.

Invariants:

- Nothing here runs in a request: a write sends the version's id on commit
  (``workflows.knowledge``), and a worker embeds it through ``providers.embed``, the same
  adapters and clients as recipes' model calls.
- What is embedded is the title, a blank line and the content, cut to
  :data:`EMBED_MAX_BYTES` of UTF-8 (a byte-level tokenizer makes at most one token per byte,
  so this stays under OpenAI's 8,191-token input limit; a longer passage is embedded by its
  beginning).
- Only current versions are embedded: a version superseded before its message was handled
  is skipped (it is never retrieved). A version embedded already is not sent again, so a
  duplicate message costs one query, not a model call.
- A failure is never silent: a retryable one is retried by the task with back-off, a fatal
  one (or the last retry) is logged naming the document, the model and the provider's
  message, and remembered for :data:`FAILED_FOR_S` so the sweep does not pay for it again
  every tick; after that the sweep tries once more.
- The sweep (beat, every ``RECONCILE_SECONDS``) sends at most :data:`SWEEP_BATCH` current
  versions that have no embedding by the configured model and length, written at least two
  sweep periods ago (newer ones wait for their own message), skipping those it sent
  within :data:`QUEUED_FOR_S` (their message may still be waiting or retrying): a lost
  message leaves a version unembedded for minutes, never for ever.
- Where the database cannot store vectors (SQLite, PostgreSQL without pgvector) nothing is
  embedded and retrieval stays full-text; each process says why once, at warning level
  (``manage.py check`` says it too: ``workflows.checks``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Literal

from django.conf import settings
from django.core.cache import cache

from workflows import kb_vectors, knowledge
from workflows.models import KnowledgeDocument, KnowledgeEmbedding

from . import providers

logger = logging.getLogger(__name__)

EMBED_MAX_BYTES = 8000
# A document's embedding request; a query's gets what is left of its attempt.
EMBED_TIMEOUT_S = 60.0
SWEEP_BATCH = 100
QUEUED_FOR_S = 15 * 60
FAILED_FOR_S = 60 * 60

Outcome = Literal["stored", "exists", "superseded", "gone", "unconfigured", "unavailable"]

_said: set[str] = set()
# (model, dimensions) whose HNSW index this process has made sure of.
_indexed: set[tuple[str, int]] = set()


def hybrid_model() -> providers.EmbeddingsModel | None:
    """The embeddings model retrieval and writes use: None when none is set, or when this
    database cannot store vectors (said once per process)."""
    model = providers.embeddings_model()
    if model is None:
        return None
    why = kb_vectors.unavailable()
    if why is not None:
        say_once(f"DJFLOW_EMBEDDINGS_MODEL is {model.name!r}, but {why}")
        return None
    return model


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("knowledge-base embeddings: %s", message)


def document_text(title: str, content: str) -> str:
    """What is embedded of a version (see the module docstring)."""
    text = f"{title}\n\n{content}" if title else content
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= EMBED_MAX_BYTES:
        return text
    return data[:EMBED_MAX_BYTES].decode("utf-8", "ignore")


def embed_document(document_id: int) -> Outcome:
    """Embed one document version and store its vector. Raises ``providers.ModelError``
    (classed ``retryable`` or ``fatal``) when the provider fails; the task decides."""
    model = hybrid_model()
    if model is None:
        return "unconfigured" if providers.embeddings_model() is None else "unavailable"
    document = KnowledgeDocument.objects.filter(pk=document_id).first()
    if document is None:
        return "gone"
    if not document.current:
        return "superseded"
    done = KnowledgeEmbedding.objects.filter(document_id=document_id, model=model.name)
    if model.dimensions is not None:
        done = done.filter(dimensions=model.dimensions)
    if done.exists():
        return "exists"
    reply = providers.embed(
        model.name,
        [document_text(document.title, document.content)],
        dimensions=model.dimensions,
        timeout_s=EMBED_TIMEOUT_S,
    )
    [vector] = reply.vectors
    ensure_index(model.name, len(vector))
    kb_vectors.store(
        document_id=document_id, model=model.name, vector=vector, input_tokens=reply.input_tokens
    )
    return "stored"


def ensure_index(model: str, dimensions: int) -> None:
    """The HNSW index of ``(model, dimensions)`` exists (made once per process: a check is a
    query, a build can take minutes on a large table, and two processes building at once
    are both safe, ``CREATE INDEX CONCURRENTLY IF NOT EXISTS``)."""
    if (model, dimensions) in _indexed:
        return
    kb_vectors.ensure_index(model, dimensions)
    _indexed.add((model, dimensions))


def remember_failure(document_id: int, model: str, message: str) -> None:
    cache.set(_failed_key(model, document_id), message[:500], FAILED_FOR_S)


def sweep(*, batch: int = SWEEP_BATCH, grace_s: float | None = None) -> int:
    """Send the current versions still missing an embedding (see the module docstring);
    answers how many were sent. ``grace_s``: two sweep periods unless given."""
    model = hybrid_model()
    if model is None:
        return 0
    if grace_s is None:
        grace_s = 2.0 * settings.DJFLOW["RECONCILE_SECONDS"]
    found = kb_vectors.missing(model.name, model.dimensions, limit=batch * 2, older_than_s=grace_s)
    if not found:
        return 0
    keys = {
        doc_id: (_queued_key(model.name, doc_id), _failed_key(model.name, doc_id))
        for doc_id in found
    }
    marked = cache.get_many([key for pair in keys.values() for key in pair])
    due = [doc_id for doc_id, pair in keys.items() if not any(k in marked for k in pair)][:batch]
    for doc_id in due:
        knowledge.send_embed(doc_id)
    cache.set_many({keys[doc_id][0]: True for doc_id in due}, QUEUED_FOR_S)
    if due:
        logger.info(
            "knowledge-base embeddings: sent %d version(s) missing an embedding by %s",
            len(due),
            model.name,
        )
    return len(due)


def _queued_key(model: str, document_id: int) -> str:
    return f"djflow:kb-embed:queued:{_digest(model)}:{document_id}"


def _failed_key(model: str, document_id: int) -> str:
    return f"djflow:kb-embed:failed:{_digest(model)}:{document_id}"


def _digest(model: str) -> str:
    """A model's name as a cache key part: any text may name a model, some caches (memcached)
    take no spaces or controls in keys."""
    return hashlib.sha256(model.encode("utf-8")).hexdigest()[:16]
