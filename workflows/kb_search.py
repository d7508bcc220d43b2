"""Search in knowledge bases (CONTRACT section 10): what a recipe's ``context`` retrieves,
what ``GET /api/v1/kbs/{kb}/documents?q=`` and the admin's search box answer.

``search(kb, query, top_k)`` answers the best current versions (never an older one), best
first, as :class:`Hit` rows. Backends, chosen by name (``backend=``, else
``settings.DJFLOW["KB_SEARCH_BACKEND"]``, default ``fulltext``; a hybrid one registers with
:func:`register_backend` and takes the same arguments):

- ``fulltext`` on Postgres: the title (weight A) and content (weight B) as one ``tsvector``
  in the ``english`` configuration (``search_vector``, kept by a trigger of migration 0005),
  matched by ``@@`` and ranked by ``ts_rank``. A GIN index over the current rows' vectors
  (``kb_document_search``) answers the match, so a search reads the index, not the table
  (EXPLAIN on 10,000 rows: a bitmap index scan on it); ranking reads the stored vectors of
  the rows matched, never parsing their text again.
- ``fulltext`` on SQLite (the embedded default): an FTS5 table over the current versions
  (external content, kept by triggers from migration 0005), ranked by ``bm25()`` with the
  title weighted 2.5 to the content's 1 (the ratio of Postgres's A and B). Scores are the
  negated bm25 (larger is better); they compare within one search, not across backends.

- ``hybrid`` (a recipe's context when ``DJFLOW_EMBEDDINGS_MODEL`` is set and the database
  stores vectors): the ``fulltext`` ranking's best :data:`HYBRID_CANDIDATES` and the
  :data:`HYBRID_CANDIDATES` current documents nearest to the query's embedding (given by
  the caller as ``embedding=``, computed by a worker: ``workflows.kb_vectors.nearest``,
  cosine distance through an HNSW index), fused by reciprocal rank fusion (``kb_rank``,
  k = 60): a document either list found may be retrieved, one both found ranks first. Each
  hit's ``ranks`` says where each list had it (``(fulltext, vector)``, None where one left
  it out); its score is the fused one. Without an embedding it is the full-text ranking.

Two ways of matching the words of ``query``:

- ``all`` (the API, the admin): web-search syntax, as ``websearch_to_tsquery`` reads it:
  every word must occur; ``"a phrase"``, ``or`` between words, ``-word`` to exclude;
- ``any`` (a recipe's context, whose default query is the whole step input): any word may
  occur, the documents with more of them, and rarer ones, ranking higher.

User text never becomes SQL: Postgres gets it as a parameter of ``websearch_to_tsquery``
(which accepts any text) or ``plainto_tsquery``; SQLite gets an FTS5 expression built here
from the words of the text only (``\\w+`` runs), each one double-quoted, so no character a
user types is FTS5 syntax. A query is at most :data:`MAX_QUERY_CHARS` characters (the API
refuses a longer one, naming ``q``; a recipe's query is cut there), read as at most
:data:`MAX_TERMS` words.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from django.conf import settings
from django.contrib.postgres.search import SearchQuery, SearchRank
from django.db import connection
from django.db.models import F

from . import kb_vectors
from .kb_rank import reciprocal_rank_fusion
from .models import KnowledgeBase, KnowledgeDocument

MAX_QUERY_CHARS: Final = 1000
MAX_TERMS: Final = 32
MAX_TOP_K: Final = 100
# Candidates each ranking of a hybrid search gives the fusion (more when top_k is larger).
HYBRID_CANDIDATES: Final = 20
# The text-search configuration of the stored vectors (migration 0005's trigger): a query
# must stem its words as they were.
TEXT_SEARCH_CONFIG: Final = "english"
FTS_TABLE: Final = "workflows_knowledgedocument_fts"
# bm25 weights of the FTS5 columns (title, content).
FTS_WEIGHTS: Final = (2.5, 1.0)

Match = Literal["all", "any"]
_WORD = re.compile(r"\w+")
# A web-search token: an optional '-', then a quoted phrase or a run of non-space.
_TOKEN = re.compile(r'(-?)(?:"([^"]*)"?|(\S+))')


@dataclass(frozen=True)
class Hit:
    key: str
    version: int
    title: str
    content: str
    score: float
    id: int = 0
    # Hybrid: the hit's rank in the full-text and in the vector ranking (None: not in it).
    ranks: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class QueryEmbedding:
    """A query's embedding by ``model`` (the vectors it is compared with are that model's,
    at the same length)."""

    model: str
    vector: Sequence[float]


@dataclass(frozen=True)
class Ranked:
    id: int
    score: float
    ranks: tuple[int | None, ...] | None = None


# A backend: (knowledge base ids, query, top_k, match, the query's embedding or None) ->
# the best documents, best first.
Backend = Callable[[Sequence[int], str, int, Match, QueryEmbedding | None], list[Ranked]]
_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, backend: Backend) -> None:
    _BACKENDS[name] = backend


def search(
    kb: KnowledgeBase | str,
    query: str,
    top_k: int = 5,
    *,
    match: Match = "all",
    backend: str | None = None,
    embedding: QueryEmbedding | None = None,
) -> list[Hit]:
    """The ``top_k`` best current documents of ``kb`` for ``query`` (see the module
    docstring); [] for an unknown knowledge base or a query with no words."""
    if isinstance(kb, str):
        found = KnowledgeBase.objects.filter(name=kb).first()
        if found is None:
            return []
        kb = found
    return search_many([kb.pk], query, top_k, match=match, backend=backend, embedding=embedding)


def search_many(
    kb_ids: Sequence[int],
    query: str,
    top_k: int = 5,
    *,
    match: Match = "all",
    backend: str | None = None,
    embedding: QueryEmbedding | None = None,
) -> list[Hit]:
    """:func:`search` over several knowledge bases at once (the admin's search box)."""
    query = query[:MAX_QUERY_CHARS]
    top_k = max(1, min(int(top_k), MAX_TOP_K))
    if not kb_ids or not words(query):
        return []
    name = backend or settings.DJFLOW.get("KB_SEARCH_BACKEND", "fulltext")
    ranked = _BACKENDS[name](list(kb_ids), query, top_k, match, embedding)
    rows = KnowledgeDocument.objects.in_bulk([found.id for found in ranked])
    return [
        Hit(
            key=rows[found.id].key,
            version=rows[found.id].version,
            title=rows[found.id].title,
            content=rows[found.id].content,
            score=found.score,
            id=found.id,
            ranks=found.ranks,
        )
        for found in ranked
        if found.id in rows
    ]


def words(query: str) -> list[str]:
    """The words of ``query`` (runs of letters, digits and ``_``), at most MAX_TERMS."""
    return _WORD.findall(query[:MAX_QUERY_CHARS])[:MAX_TERMS]


# --- Postgres -----------------------------------------------------------------------------


def _postgres(
    kb_ids: Sequence[int], query: str, top_k: int, match: Match
) -> list[tuple[int, float]]:
    if match == "all":
        tsquery = SearchQuery(query, search_type="websearch", config=TEXT_SEARCH_CONFIG)
    else:
        tsquery = functools.reduce(
            operator.or_,
            (
                SearchQuery(word, search_type="plain", config=TEXT_SEARCH_CONFIG)
                for word in words(query)
            ),
        )
    ranked = (
        KnowledgeDocument.objects.filter(kb_id__in=kb_ids, current=True, search_vector=tsquery)
        .annotate(rank=SearchRank(F("search_vector"), tsquery))
        .order_by("-rank", "-id")
        .values_list("id", "rank")[:top_k]
    )
    return [(doc_id, float(rank)) for doc_id, rank in ranked]


# --- SQLite FTS5 ------------------------------------------------------------------------------


def fts5_expression(query: str, match: Match) -> str:
    """An FTS5 MATCH expression for ``query``, made of quoted words only ('' when it has no
    word). ``all``: words and "phrases" all required, ``or`` between two of them either,
    ``-word`` excluded (only beside something required: FTS5's NOT is binary); ``any``:
    the words joined by OR."""
    if match == "any":
        return " OR ".join(f'"{word}"' for word in words(query))
    required: list[str] = []
    excluded: list[str] = []
    pending_or = False
    count = 0
    for minus, phrase, bare in _TOKEN.findall(query[:MAX_QUERY_CHARS]):
        text = phrase if phrase else bare
        if not phrase and not minus and text.lower() == "or":
            pending_or = bool(required)
            continue
        found = _WORD.findall(text)[: MAX_TERMS - count]
        if not found:
            continue
        count += len(found)
        quoted = '"' + " ".join(found) + '"'
        if minus:
            excluded.append(quoted)
        elif pending_or:
            required[-1] = f"{required[-1]} OR {quoted}"
        else:
            required.append(quoted)
        pending_or = False
        if count >= MAX_TERMS:
            break
    if not required:
        return ""
    expression = " AND ".join(f"({group})" for group in required)
    return expression + "".join(f" NOT {term}" for term in excluded)


def _sqlite(kb_ids: Sequence[int], query: str, top_k: int, match: Match) -> list[tuple[int, float]]:
    expression = fts5_expression(query, match)
    if not expression:
        return []
    title_weight, content_weight = FTS_WEIGHTS
    marks = ", ".join("%s" for _ in kb_ids)
    sql = (
        f"SELECT d.id, -bm25({FTS_TABLE}, %s, %s) AS score "
        f"FROM {FTS_TABLE} JOIN workflows_knowledgedocument AS d ON d.id = {FTS_TABLE}.rowid "
        f"WHERE {FTS_TABLE} MATCH %s AND d.current AND d.kb_id IN ({marks}) "
        "ORDER BY score DESC, d.id DESC LIMIT %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [title_weight, content_weight, expression, *kb_ids, top_k])
        return [(doc_id, float(score)) for doc_id, score in cursor.fetchall()]


def _fulltext_pairs(
    kb_ids: Sequence[int], query: str, top_k: int, match: Match
) -> list[tuple[int, float]]:
    if connection.vendor == "sqlite":
        return _sqlite(kb_ids, query, top_k, match)
    return _postgres(kb_ids, query, top_k, match)


def _fulltext(
    kb_ids: Sequence[int],
    query: str,
    top_k: int,
    match: Match,
    embedding: QueryEmbedding | None = None,
) -> list[Ranked]:
    return [Ranked(doc_id, score) for doc_id, score in _fulltext_pairs(kb_ids, query, top_k, match)]


# --- Hybrid: full text and vectors, fused ----------------------------------------------------


def _hybrid(
    kb_ids: Sequence[int],
    query: str,
    top_k: int,
    match: Match,
    embedding: QueryEmbedding | None = None,
) -> list[Ranked]:
    candidates = max(HYBRID_CANDIDATES, top_k)
    text = [doc_id for doc_id, _ in _fulltext_pairs(kb_ids, query, candidates, match)]
    near: list[int] = []
    if embedding is not None and embedding.vector:
        found = kb_vectors.nearest(kb_ids, embedding.model, embedding.vector, candidates)
        near = [doc_id for doc_id, _ in found]
    fused = reciprocal_rank_fusion([text, near], top_k=top_k)
    return [Ranked(one.key, one.score, one.ranks) for one in fused]


register_backend("fulltext", _fulltext)
register_backend("hybrid", _hybrid)
