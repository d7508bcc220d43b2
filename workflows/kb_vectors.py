"""Embeddings of knowledge-base documents in pgvector: where they are stored, how the nearest
are found, and whether this database can hold them at all (CONTRACT section 10, hybrid
retrieval when ``DJFLOW_EMBEDDINGS_MODEL`` is set). Database only: the vectors are computed
by the workers (``workers.kb_embed``), through the providers.

Storage: :class:`~workflows.models.KnowledgeEmbedding`, a row per document version and
embeddings model and length, ``(document, model, dimensions, input_tokens, created_at)``,
unique on ``(document, model, dimensions)``, made by migration 0006 on every database; and
its ``embedding vector`` column, which Django does not know: :func:`install` adds it where
pgvector exists, and only this module reads or writes it. The column has no fixed length,
so a change of model or of ``DJFLOW_EMBEDDINGS_DIMENSIONS`` needs no migration; each
``(model, dimensions)`` gets its own HNSW index on cosine distance, a partial expression
index ``((embedding::vector(N)) vector_cosine_ops) WHERE model = '...' AND dimensions = N``
(:func:`ensure_index`, made before the first embedding of that pair is stored, named after
it). The nearest-neighbour query (:func:`nearest`) is written in that very shape, so the
planner uses the index (EXPLAIN shows an index scan on it: tests/workers/test_kb_hybrid.py).

The column exists only where the pgvector extension does: :func:`install` (migration 0006,
and again after every ``migrate``, so installing pgvector later needs only a ``migrate``)
creates the extension when PostgreSQL has it available and then the column; on SQLite, or
without the extension, it does nothing and :func:`unavailable` says why, in one sentence
that the system check (``workflows.checks``) and the fallback to full-text search (logged
once per process) both show.

Invariants:

- Rows never change; a version's embedding is written once, whole, by one INSERT (``ON
  CONFLICT DO NOTHING``: a duplicate task writes nothing).
- Only current versions are ever returned by :func:`nearest` (joined to their document);
  the rows of older versions stay, as the versions do, and are never retrieved.
- Model names reach SQL as literals quoted by the driver, never pasted in; dimensions are
  checked integers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Final

from django.db import DatabaseError, connection, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from pgvector import Vector

logger = logging.getLogger(__name__)

TABLE: Final = "workflows_knowledgeembedding"
# Not a field of the model: added only where pgvector exists (install).
COLUMN: Final = "embedding"
# What pgvector's HNSW index holds (vectors of at most 2,000 dimensions).
MAX_DIMENSIONS: Final = 2000
# The HNSW build parameters: pgvector's defaults, named so the index says what it was built
# with.
HNSW_M: Final = 16
HNSW_EF_CONSTRUCTION: Final = 64

# Why each process's answer to unavailable() is kept: asked at every retrieval, it would cost
# a query each time. Keyed by the database's name (a test database differs from the
# configured one).
_availability: dict[str, str | None] = {}
_versions: dict[str, tuple[int, ...]] = {}


def install(conn: BaseDatabaseWrapper | None = None) -> str | None:
    """Create the extension (when PostgreSQL has it available) and the table's vector column,
    if missing. Answers None when vectors can be stored, else why not. Idempotent; never
    raises for a missing extension or a refused ``CREATE EXTENSION`` (a role that may not
    create it): that is said by :func:`unavailable`."""
    conn = conn or connection
    forget()
    if conn.vendor != "postgresql" or unavailable(conn) is None:
        return unavailable(conn)
    forget()
    with conn.cursor() as cursor:
        # No table: migrated back before 0006, which adds the column when it runs again.
        cursor.execute(
            "SELECT to_regclass(%s) IS NOT NULL AND EXISTS (SELECT 1 FROM"
            " pg_available_extensions WHERE name = 'vector')",
            [TABLE],
        )
        if cursor.fetchone()[0]:
            try:
                with transaction.atomic(using=conn.alias):
                    cursor.execute("CREATE EXTENSION IF NOT EXISTS vector")
                    cursor.execute(f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {COLUMN} vector")
            except DatabaseError as error:
                logger.warning("knowledge-base embeddings: no vector column: %s", error)
    return unavailable(conn)


def uninstall(conn: BaseDatabaseWrapper | None = None) -> None:
    """Drop the vector column and its indexes (the extension stays: something else may use
    it)."""
    conn = conn or connection
    if conn.vendor == "postgresql":
        with conn.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {TABLE} DROP COLUMN IF EXISTS {COLUMN}")
    forget()


def unavailable(conn: BaseDatabaseWrapper | None = None) -> str | None:
    """None when this database stores embeddings, else one sentence why not (what to do
    included). Kept per process once known."""
    conn = conn or connection
    name = f"{conn.alias}:{conn.settings_dict.get('NAME')}"
    if name not in _availability:
        _availability[name] = _why_not(conn)
    return _availability[name]


def forget() -> None:
    """Ask again at the next :func:`unavailable` (after an install)."""
    _availability.clear()
    _versions.clear()


def _why_not(conn: BaseDatabaseWrapper) -> str | None:
    if conn.vendor != "postgresql":
        return (
            f"the {conn.vendor} database cannot store embeddings (pgvector needs PostgreSQL):"
            " knowledge-base retrieval stays full-text"
        )
    with conn.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT extversion FROM pg_extension WHERE extname = 'vector'),"
            " EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector'),"
            " EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s)"
            " AND attname = %s AND NOT attisdropped)",
            [TABLE, COLUMN],
        )
        version, available, table = cursor.fetchone()
    if version is None:
        where = "is available but not created" if available else "is not installed"
        return (
            f"the pgvector extension {where} in this PostgreSQL: install it (the"
            " postgresql-NN-pgvector package, or the pgvector/pgvector image), then run"
            " manage.py migrate; until then knowledge-base retrieval stays full-text"
        )
    if not table:
        return (
            f"the embeddings table {TABLE} has no vector column (pgvector {version} is"
            " installed):"
            " run manage.py migrate; until then knowledge-base retrieval stays full-text"
        )
    return None


def extension_version() -> tuple[int, ...]:
    """pgvector's version in this database, () without it; kept per process (asked at every
    retrieval, it would cost a round trip each)."""
    name = f"version:{connection.alias}:{connection.settings_dict.get('NAME')}"
    if name not in _versions:
        with connection.cursor() as cursor:
            cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            row = cursor.fetchone()
        found = tuple(int(part) for part in row[0].split(".") if part.isdigit()) if row else ()
        _versions[name] = found
    return _versions[name]


def index_name(model: str, dimensions: int) -> str:
    """The HNSW index of ``(model, dimensions)``: a digest of the model's name (any text,
    and an identifier is at most 63 bytes) and the length."""
    digest = hashlib.sha256(model.encode("utf-8")).hexdigest()[:12]
    return f"kb_embedding_hnsw_{digest}_{_checked(dimensions)}"


def _checked(dimensions: int) -> int:
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"dimensions must be a whole number, not {dimensions!r}")
    if not 1 <= dimensions <= MAX_DIMENSIONS:
        raise ValueError(f"dimensions must be from 1 to {MAX_DIMENSIONS}, not {dimensions}")
    return dimensions


def ensure_index(model: str, dimensions: int) -> bool:
    """Create the HNSW index of ``(model, dimensions)`` if it is missing (or left invalid by
    a build that failed); True when this call built it. ``CONCURRENTLY``: writes of other
    documents go on while it builds (inside a transaction, where that cannot be, a plain
    build: tests)."""
    name = index_name(model, dimensions)
    concurrently = "" if connection.in_atomic_block else " CONCURRENTLY"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return False
        if row is not None:
            cursor.execute(f"DROP INDEX{concurrently} IF EXISTS {name}")
        cursor.execute(
            f"CREATE INDEX{concurrently} IF NOT EXISTS {name} ON {TABLE} USING hnsw"
            f" (({COLUMN}::vector({dimensions})) vector_cosine_ops)"
            f" WITH (m = {HNSW_M}, ef_construction = {HNSW_EF_CONSTRUCTION})"
            " WHERE model = %s AND dimensions = %s",
            [model, dimensions],
        )
    logger.info("knowledge-base embeddings: built the HNSW index %s for %s", name, model)
    return True


def store(*, document_id: int, model: str, vector: Sequence[float], input_tokens: int) -> bool:
    """Write the embedding of a document version; False when it was there already."""
    dimensions = _checked(len(vector))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (document_id, model, dimensions, {COLUMN}, input_tokens,"
            " created_at) VALUES (%s, %s, %s, %s::vector, %s, now())"
            " ON CONFLICT (document_id, model, dimensions) DO NOTHING",
            [document_id, model, dimensions, _literal(vector), int(input_tokens)],
        )
        return bool(cursor.rowcount)


def stored(document_id: int, model: str) -> list[float] | None:
    """The embedding of a document version by ``model`` (any length), None when there is
    none."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {COLUMN}::text FROM {TABLE} WHERE document_id = %s AND model = %s"
            " ORDER BY id DESC LIMIT 1",
            [document_id, model],
        )
        row = cursor.fetchone()
    return None if row is None else Vector.from_text(row[0]).to_list()


def missing(model: str, dimensions: int | None, *, limit: int, older_than_s: float) -> list[int]:
    """Current versions with no embedding by ``model`` (of ``dimensions`` when given),
    written more than ``older_than_s`` seconds ago (newer ones wait for their own message),
    oldest first, at most ``limit``."""
    condition = "e.model = %s" + (" AND e.dimensions = %s" if dimensions is not None else "")
    params: list[Any] = [model] + ([dimensions] if dimensions is not None else [])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT d.id FROM workflows_knowledgedocument d"
            " WHERE d.current AND d.created_at < clock_timestamp() - make_interval(secs => %s)"
            f" AND NOT EXISTS (SELECT 1 FROM {TABLE} e WHERE e.document_id = d.id AND {condition})"
            " ORDER BY d.id LIMIT %s",
            [float(older_than_s), *params, int(limit)],
        )
        return [row[0] for row in cursor.fetchall()]


def nearest(
    kb_ids: Sequence[int], model: str, vector: Sequence[float], limit: int
) -> list[tuple[int, float]]:
    """The ``limit`` current documents of ``kb_ids`` nearest to ``vector`` by cosine
    distance among those embedded by ``model`` at its length: ``[(document id, distance)]``,
    nearest first.

    The order is the HNSW index's (:func:`ensure_index`): its expression and predicate are
    written here exactly as the index has them. Versions that are not current, and other
    knowledge bases, are filtered after the index; pgvector 0.8's iterative scan
    (``strict_order``) walks on until ``limit`` rows pass the filter, so old versions do not
    crowd out current ones (before 0.8, fewer rows may come back)."""
    sql, params = _nearest_sql(kb_ids, model, vector, limit)
    iterative = extension_version() >= (0, 8)
    with transaction.atomic(), connection.cursor() as cursor:
        if iterative:
            cursor.execute("SET LOCAL hnsw.iterative_scan = strict_order")
        cursor.execute(sql, params)
        return [(doc_id, float(distance)) for doc_id, distance in cursor.fetchall()]


def explain_nearest(kb_ids: Sequence[int], model: str, vector: Sequence[float], limit: int) -> str:
    """The plan of :func:`nearest`'s query (for tests and operators)."""
    sql, params = _nearest_sql(kb_ids, model, vector, limit)
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def _nearest_sql(
    kb_ids: Sequence[int], model: str, vector: Sequence[float], limit: int
) -> tuple[str, list[Any]]:
    dimensions = _checked(len(vector))
    marks = ", ".join("%s" for _ in kb_ids)
    sql = (
        f"SELECT e.document_id, e.{COLUMN}::vector({dimensions}) <=> %s::vector({dimensions})"
        f" AS distance FROM {TABLE} e"
        " JOIN workflows_knowledgedocument d ON d.id = e.document_id"
        f" WHERE e.model = %s AND e.dimensions = %s AND d.current AND d.kb_id IN ({marks})"
        " ORDER BY distance LIMIT %s"
    )
    return sql, [_literal(vector), model, dimensions, *kb_ids, int(limit)]


def _literal(vector: Sequence[float]) -> str:
    """pgvector's text form, by its own package (the column is float32: so is ``Vector``)."""
    return Vector(vector).to_text()
