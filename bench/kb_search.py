"""``python -m bench.kb_search``: retrieval latency of a recipe's context (issue 15), p50 and
p99 of ``kb_search.search(kb, query, top_k=5)`` over 10,000 and 100,000 documents, Postgres
full-text search beside SQLite FTS5.

- Each vendor is measured in a process of its own (Django is configured once per process):
  Postgres on the bench database (``DJFLOW_BENCH_DATABASE_URL``, default ``djflow_bench``,
  created and migrated on first use), SQLite in a fresh file under a temporary folder, as the
  embedded default makes it (migration 0005's FTS5 table and triggers).
- The corpus is synthetic and the same for both: a vocabulary of 5,000 made-up words drawn
  with a Zipf-like skew (a few words are everywhere, most are rare, as in real text), titles of
  5 words, contents of 60. Documents are inserted through the ORM in batches (the triggers
  index them on SQLite; Postgres's GIN index is maintained on insert), then ``ANALYZE``.
- Queries: 300 of 3 to 8 words from the same distribution, after 30 to warm up, in the two
  ways a search matches: ``any`` (a recipe's context) and ``all`` (the API's ``q``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCABULARY = 5_000
TITLE_WORDS = 5
CONTENT_WORDS = 60
QUERIES = 300
WARMUP = 30
BATCH = 2_000


def _words(rng: random.Random, count: int) -> list[str]:
    # Zipf-like: the rank of a word drawn is about exp(uniform * ln(VOCABULARY)).
    return [f"w{int(VOCABULARY ** rng.random())}x" for _ in range(count)]


def _fill(documents: int, seed: int = 7) -> Any:
    from workflows.models import KnowledgeBase, KnowledgeDocument

    rng = random.Random(seed)
    kb, _ = KnowledgeBase.objects.get_or_create(name=f"bench-{documents}")
    have = KnowledgeDocument.objects.filter(kb=kb).count()
    for start in range(have, documents, BATCH):
        KnowledgeDocument.objects.bulk_create(
            KnowledgeDocument(
                kb=kb,
                key=f"doc-{n}",
                version=1,
                title=" ".join(_words(rng, TITLE_WORDS)),
                content=" ".join(_words(rng, CONTENT_WORDS)),
            )
            for n in range(start, min(start + BATCH, documents))
        )
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return kb


def _measure(kb: Any, match: str, seed: int = 11) -> dict[str, float]:
    from workflows import kb_search

    rng = random.Random(seed)
    queries = [" ".join(_words(rng, rng.randint(3, 8))) for _ in range(WARMUP + QUERIES)]
    timings = []
    hits = 0
    for index, query in enumerate(queries):
        started = time.perf_counter()
        found = kb_search.search(kb, query, 5, match=match)  # type: ignore[arg-type]
        elapsed = (time.perf_counter() - started) * 1000
        if index >= WARMUP:
            timings.append(elapsed)
            hits += len(found)
    timings.sort()
    return {
        "p50_ms": statistics.median(timings),
        "p99_ms": timings[int(len(timings) * 0.99) - 1],
        "hits_per_query": hits / QUERIES,
    }


def _child(sizes: list[int]) -> None:
    """Runs in a process of its own, its database chosen by the environment."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    figures = []
    for size in sizes:
        started = time.perf_counter()
        kb = _fill(size)
        filled = time.perf_counter() - started
        for match in ("any", "all"):
            figures.append(
                {
                    "vendor": connection.vendor,
                    "documents": size,
                    "match": match,
                    "fill_s": round(filled, 1),
                    **_measure(kb, match),
                }
            )
    print(json.dumps(figures))


def _run(env: dict[str, str], sizes: list[int]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.kb_search", "--child", *map(str, sizes)],
        env={**env, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[10_000, 100_000])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["postgresql", "sqlite"])
    args = parser.parse_args()
    if args.child:
        _child(args.sizes)
        return
    from bench import common

    base = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DATABASE_"))}
    base.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    rows: list[dict[str, Any]] = []
    if args.only in (None, "postgresql"):
        common.configure()  # creates and migrates the bench database
        rows += _run({**base, "DATABASE_URL": common.DATABASE_URL}, args.sizes)
    if args.only in (None, "sqlite"):
        with tempfile.TemporaryDirectory() as var:
            rows += _run({**base, "DJFLOW_VAR_DIR": str(Path(var))}, args.sizes)
    print(f"{'vendor':<11} {'documents':>9} {'match':<5} {'p50 ms':>8} {'p99 ms':>8} {'hits':>5}")
    for row in rows:
        print(
            f"{row['vendor']:<11} {row['documents']:>9} {row['match']:<5} "
            f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['hits_per_query']:>5.1f}"
        )


if __name__ == "__main__":
    main()
