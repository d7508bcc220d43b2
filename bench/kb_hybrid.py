"""``python -m bench.kb_hybrid``: hybrid knowledge-base retrieval through the engine (issue
15): the workers' embedding of each document version (``workers.kb_embed.embed_document``:
the checks, the stand-in's embedding, the insert, the HNSW index kept up) and the latency of
``kb_search.search(kb, query, 5, match="any")`` hybrid (full text 20 + HNSW 20, fused)
beside full text alone and the vector side alone (``kb_vectors.nearest``, 20), p50 and
p99.

Postgres with pgvector only: the database ``DJFLOW_BENCH_HYBRID_DATABASE_URL`` (default
``djflow_bench_hybrid`` on loopback), created and migrated on first use, its documents kept
between runs. The corpus is ``bench.kb_search``'s (made-up Zipf-distributed words, titles
of 5, contents of 60); the embeddings the stand-in's (``standin:hash``, 384 dimensions:
hashed bags of words, offline), so latency is the engine's and the database's, not a
provider's. The query's embedding is computed before the timer starts (a worker pays a
provider round trip for it: tens to hundreds of ms on a real one).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import time
from typing import Any

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/djflow_bench_hybrid"
MODEL = "standin:hash"
DIMENSIONS = 384
QUERIES = 300
WARMUP = 30


def _setup(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    os.environ["DJFLOW_EMBEDDINGS_MODEL"] = MODEL
    os.environ["DJFLOW_EMBEDDINGS_DIMENSIONS"] = str(DIMENSIONS)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            admin.execute(f'CREATE DATABASE "{name}"')
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _percentiles(timings: list[float]) -> tuple[float, float]:
    timings = sorted(timings)
    return statistics.median(timings), timings[max(0, int(len(timings) * 0.99) - 1)]


def _embed_all(kb: Any) -> tuple[list[float], float]:
    from workers import kb_embed
    from workflows.models import KnowledgeDocument, KnowledgeEmbedding

    todo = (
        KnowledgeDocument.objects.filter(kb=kb, current=True)
        .exclude(pk__in=KnowledgeEmbedding.objects.filter(model=MODEL).values("document_id"))
        .values_list("pk", flat=True)
    )
    timings = []
    started = time.perf_counter()
    for document_id in list(todo):
        one = time.perf_counter()
        assert kb_embed.embed_document(document_id) == "stored"
        timings.append((time.perf_counter() - one) * 1000)
    return timings, time.perf_counter() - started


def _search(kb: Any, backend: str, seed: int = 11) -> dict[str, float]:
    from bench.kb_search import _words
    from workers import providers
    from workflows import kb_search, kb_vectors

    rng = random.Random(seed)
    queries = [" ".join(_words(rng, rng.randint(3, 8))) for _ in range(WARMUP + QUERIES)]
    vectors = providers.embed(MODEL, queries, dimensions=DIMENSIONS).vectors
    timings, hits = [], 0
    for index, (query, vector) in enumerate(zip(queries, vectors, strict=True)):
        embedding = kb_search.QueryEmbedding(MODEL, vector) if backend == "hybrid" else None
        started = time.perf_counter()
        found: list[Any]
        if backend == "vector":
            found = kb_vectors.nearest([kb.pk], MODEL, vector, kb_search.HYBRID_CANDIDATES)
        else:
            found = kb_search.search(
                kb, query, 5, match="any", backend=backend, embedding=embedding
            )
        if index >= WARMUP:
            timings.append((time.perf_counter() - started) * 1000)
            hits += len(found)
    p50, p99 = _percentiles(timings)
    return {"p50_ms": p50, "p99_ms": p99, "hits": hits / QUERIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[10_000])
    args = parser.parse_args()
    _setup(os.environ.get("DJFLOW_BENCH_HYBRID_DATABASE_URL", DEFAULT_URL))
    from django.db import connection

    from bench.kb_search import _fill
    from workflows import kb_vectors

    why = kb_vectors.unavailable()
    if why is not None:
        raise SystemExit(f"no pgvector: {why}")
    print(f"{'documents':>9} {'what':<28} {'p50 ms':>8} {'p99 ms':>8} {'extra':>14}")
    for size in args.sizes:
        kb = _fill(size)
        timings, total = _embed_all(kb)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        if timings:
            p50, p99 = _percentiles(timings)
            extra = f"{len(timings)} in {total:.0f}s"
            print(
                f"{size:>9} {'embed one version (worker)':<28} {p50:>8.2f} {p99:>8.2f} {extra:>14}"
            )
        for backend in ("fulltext", "vector", "hybrid"):
            row = _search(kb, backend)
            what = "nearest 20 (HNSW)" if backend == "vector" else f"search {backend}, top_k 5"
            print(
                f"{size:>9} {what:<28} {row['p50_ms']:>8.2f}"
                f" {row['p99_ms']:>8.2f} {row['hits']:>9.1f} hits"
            )


if __name__ == "__main__":
    main()
