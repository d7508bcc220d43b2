"""``python -m bench.kb_search_raw``: the databases' own retrieval latency (issue 15).

Retrieval for a recipe's ``context`` (``top_k`` 5) over 10,000 and 100,000 documents, one
beside the other: Postgres full-text search, SQLite FTS5 (the embedded default), pgvector's
HNSW index (when the extension is installed) and the hybrid of full text and vectors fused
by reciprocal rank fusion (``workflows.kb_rank``, k=60).

The knowledge-base models are not what is measured: the bench builds plain tables of its
own, shaped like the models' (``bench.kb_search`` measures the engine's own search), so the
figures are the databases' (plus psycopg's and sqlite3's round trip), not the ORM's.

- Postgres, in a scratch database ``djflow_bench_kb`` (``DJFLOW_BENCH_KB_DATABASE_URL``
  overrides it; dropped and made again per corpus size): a ``tsvector`` column generated
  from the text (``english``) with a GIN index, queried with ``websearch_to_tsquery`` and
  ordered by ``ts_rank``; a ``vector(384)`` column of the stand-in's embeddings
  (``standin:hash``, through ``workers.providers.embed``) with an HNSW index on cosine
  distance (``m`` 16, ``ef_construction`` 64, pgvector's defaults), queried by ``<=>``.
- SQLite, in a temporary file: an FTS5 table (``porter unicode61``, like Postgres's English
  stemming) queried with ``MATCH`` and ordered by ``bm25()``.
- The corpus: ticket-like documents (a title and a body of 30 to 150 words) whose words are
  drawn from a vocabulary of 30,000 (about 150 support words, then made-up words) with
  Zipf-distributed frequencies (s 1.07), from a fixed seed, so every run measures the same
  text. Queries are two or three words drawn the same way, leaving out the 20 most common
  words (which act as stop words here), so they match from a handful to thousands of
  documents, as real questions do.
- Each query is run once to warm the caches, then ``--rounds`` times; every execution is
  timed on its own (``perf_counter`` around execute and fetch) and p50/p99 taken over all.
  The query's embedding (the stand-in, in-process) is not part of the vector figures; the
  hybrid figure includes both queries and the fusion.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from pgvector import Vector
from pgvector.psycopg import register_vector
from psycopg import sql

from workers import providers
from workflows.kb_rank import reciprocal_rank_fusion

T = TypeVar("T")

DATABASE_URL = os.environ.get(
    "DJFLOW_BENCH_KB_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/djflow_bench_kb"
)
EMBEDDINGS_MODEL = "standin:hash"
DIMENSIONS = 384
TOP_K = 5
# Each side of the hybrid offers this many candidates to the fusion.
CANDIDATES = 20
VOCABULARY = 30_000
ZIPF_S = 1.07
# The most common words match most documents: queries leave them out, as stop words.
QUERY_SKIPS_TOP = 20
EMBED_BATCH = 1_000
# Tickets are about something: each is about one of TOPICS topics, and about TOPIC_SHARE of
# its words come from that topic's TOPIC_WORDS words (the rest from the whole vocabulary).
TOPICS = 50
TOPIC_WORDS = 300
TOPIC_SHARE = 0.3
QUERY_TOPIC_SHARE = 0.8

_SUPPORT = """
printer invoice refund password login account order delivery email error payment card
subscription cancel upgrade download install update crash slow screen battery charger
laptop phone tablet network wifi vpn connection server timeout browser cookie session
shipping address tracking package damaged missing return exchange warranty repair
replacement discount coupon price charge billing receipt tax export import report
dashboard settings profile username reset verify code sms notification alert backup
restore sync calendar contact message attachment upload file folder permission access
admin user team invite license seat plan trial renewal contract quote purchase catalog
product stock inventory warehouse courier label customs invoice delay urgent broken
frozen blank black error disconnect reconnect firmware driver cable port bluetooth
keyboard mouse monitor headset microphone camera speaker volume audio video stream
meeting webinar ticket agent escalate priority manager feedback complaint survey
"""
SUPPORT_WORDS = _SUPPORT.split()


# --- the corpus ---------------------------------------------------------------------------
def vocabulary(rng: random.Random) -> list[str]:
    """Support words first (the most frequent), then made-up words of two or three
    syllables, distinct from them and from each other."""
    head = list(dict.fromkeys(SUPPORT_WORDS))
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    made_up = {"".join(rng.choices(syllables, k=rng.choice((2, 3)))) for _ in range(VOCABULARY)}
    tail = sorted(made_up - set(head))
    rng.shuffle(tail)
    return (head + tail)[:VOCABULARY]


def zipf_weights(size: int) -> list[float]:
    """Cumulative weights of ranks 1 .. ``size`` under Zipf's law."""
    return list(itertools.accumulate(1 / rank**ZIPF_S for rank in range(1, size + 1)))


@dataclass(frozen=True)
class Language:
    """The words of the corpus: all of them with Zipf weights, and each topic's own words
    (drawn from past the most common, with Zipf weights of their own)."""

    words: list[str]
    weights: list[float]
    topics: list[list[str]]
    topic_weights: list[float]


def language(seed: int) -> Language:
    rng = random.Random(seed)
    words = vocabulary(rng)
    topics = [rng.sample(words[QUERY_SKIPS_TOP:], TOPIC_WORDS) for _ in range(TOPICS)]
    return Language(words, zipf_weights(len(words)), topics, zipf_weights(TOPIC_WORDS))


def _draw(
    rng: random.Random, lang: Language, topic: int, count: int, share: float = TOPIC_SHARE
) -> list[str]:
    """``count`` words about ``topic``: each from the topic's words with probability
    ``share``, else from the whole vocabulary."""
    on_topic = sum(rng.random() < share for _ in range(count))
    drawn = rng.choices(lang.topics[topic], cum_weights=lang.topic_weights, k=on_topic)
    drawn += rng.choices(lang.words, cum_weights=lang.weights, k=count - on_topic)
    rng.shuffle(drawn)
    return drawn


def corpus(count: int, seed: int) -> list[str]:
    """``count`` ticket-like documents, each about one topic; the same for the same seed (a
    smaller corpus is the start of a larger one)."""
    rng = random.Random(seed)
    lang = language(seed)
    documents = []
    for number in range(1, count + 1):
        topic = rng.randrange(TOPICS)
        title = " ".join(_draw(rng, lang, topic, rng.randint(4, 8)))
        body = " ".join(_draw(rng, lang, topic, rng.randint(30, 150)))
        documents.append(f"Ticket {number}: {title}.\n{body}")
    return documents


def queries(count: int, seed: int) -> list[str]:
    """Two or three words about one topic, as a question about a ticket's subject would
    be: mostly the topic's words (QUERY_TOPIC_SHARE), leaving out the most common words of
    all (stop words here)."""
    rng = random.Random(seed + 1)
    lang = language(seed)
    common = set(lang.words[:QUERY_SKIPS_TOP])
    texts = []
    for _ in range(count):
        topic = rng.randrange(TOPICS)
        size = rng.choice((2, 3))
        chosen: list[str] = []
        while len(chosen) < size:
            drawn = _draw(rng, lang, topic, 1, QUERY_TOPIC_SHARE)
            chosen += [w for w in drawn if w not in common and w not in chosen]
        texts.append(" ".join(chosen))
    return texts


def embeddings(texts: Sequence[str]) -> Iterator[list[float]]:
    for start in range(0, len(texts), EMBED_BATCH):
        reply = providers.embed(
            EMBEDDINGS_MODEL, texts[start : start + EMBED_BATCH], dimensions=DIMENSIONS
        )
        yield from reply.vectors


# --- timing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    size: int
    engine: str
    build_s: float
    latencies_ms: list[float]
    # How many documents each query matched (full text): what its ranking had to score.
    matches: list[int] | None = None
    note: str = ""

    def percentile(self, p: float) -> float:
        return percentile(self.latencies_ms, p)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def timed(run: Callable[[str], object], texts: Sequence[str], rounds: int) -> list[float]:
    for text in texts:  # warm the caches and the plans
        run(text)
    latencies = []
    for _ in range(rounds):
        for text in texts:
            started = time.perf_counter()
            run(text)
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies


# --- Postgres -----------------------------------------------------------------------------
def fresh_database(url: str) -> None:
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def has_pgvector(conn: psycopg.Connection) -> bool:
    found = conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
    return found.fetchone() is not None


FTS_QUERY = """
SELECT id, ts_rank(tsv, query) AS rank
FROM kb_doc, websearch_to_tsquery('english', %s) AS query
WHERE tsv @@ query
ORDER BY rank DESC
LIMIT %s
"""
VECTOR_QUERY = "SELECT id FROM kb_doc ORDER BY embedding <=> %s LIMIT %s"


def postgres_figures(
    documents: Sequence[str], texts: Sequence[str], rounds: int, vectors: bool
) -> list[Figure]:
    size = len(documents)
    fresh_database(DATABASE_URL)
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        vectors = vectors and has_pgvector(conn)
        embedding_column = ""
        if vectors:
            conn.execute("CREATE EXTENSION vector")
            register_vector(conn)
            embedding_column = f", embedding vector({DIMENSIONS})"
        conn.execute(
            "CREATE TABLE kb_doc (id bigint PRIMARY KEY, body text NOT NULL,"
            " tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', body)) STORED"
            f"{embedding_column})"
        )
        embedding = Stopwatch()
        started = time.perf_counter()
        if vectors:
            columns = "id, body, embedding"
            rows: Iterator[tuple[object, ...]] = zip(
                itertools.count(1), documents, embedding.over(embeddings(documents))
            )
        else:
            columns, rows = "id, body", zip(itertools.count(1), documents)
        with conn.cursor().copy(f"COPY kb_doc ({columns}) FROM STDIN WITH (FORMAT BINARY)") as copy:
            copy.set_types(["bigint", "text", "vector"][: len(columns.split(","))])
            for row in rows:
                copy.write_row(row)
        conn.execute("CREATE INDEX kb_doc_tsv ON kb_doc USING gin (tsv)")
        conn.execute("VACUUM ANALYZE kb_doc")
        # The stand-in's time is not the database's.
        fts_build = time.perf_counter() - started - embedding.seconds

        def full_text(text: str, limit: int = TOP_K) -> list[int]:
            return [row[0] for row in conn.execute(FTS_QUERY, (text, limit)).fetchall()]

        matches = list(
            _count(
                conn,
                "SELECT count(*) FROM kb_doc WHERE tsv @@ websearch_to_tsquery('english', %s)",
                text,
            )
            for text in texts
        )
        figures = [
            Figure(
                size,
                "Postgres full text (GIN, ts_rank)",
                fts_build,
                timed(full_text, texts, rounds),
                matches,
            )
        ]
        if vectors:
            figures += _vector_figures(conn, size, texts, rounds, full_text, embedding.seconds)
    return figures


def _count(conn: psycopg.Connection, query: str, text: str) -> int:
    row = conn.execute(query, (text,)).fetchone()
    return int(row[0]) if row else 0


class Stopwatch:
    """The time spent producing the items of an iterator."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def over(self, items: Iterator[T]) -> Iterator[T]:
        while True:
            started = time.perf_counter()
            item = next(items, None)
            self.seconds += time.perf_counter() - started
            if item is None:
                return
            yield item


def _vector_figures(
    conn: psycopg.Connection,
    size: int,
    texts: Sequence[str],
    rounds: int,
    full_text: Callable[[str, int], list[int]],
    embed_s: float,
) -> list[Figure]:
    started = time.perf_counter()
    # Room for the graph of 100,000 vectors in memory (pgvector warns and slows without).
    conn.execute("SET maintenance_work_mem = '1GB'")
    conn.execute(
        "CREATE INDEX kb_doc_embedding ON kb_doc USING hnsw (embedding vector_cosine_ops)"
        " WITH (m = 16, ef_construction = 64)"
    )
    conn.execute("VACUUM ANALYZE kb_doc")
    hnsw_build = time.perf_counter() - started
    query_vectors = {
        text: Vector(vector) for text, vector in zip(texts, embeddings(texts), strict=True)
    }

    def nearest(text: str, limit: int = TOP_K) -> list[int]:
        rows = conn.execute(VECTOR_QUERY, (query_vectors[text], limit)).fetchall()
        return [row[0] for row in rows]

    def hybrid(text: str) -> list[int]:
        fused = reciprocal_rank_fusion(
            [full_text(text, CANDIDATES), nearest(text, CANDIDATES)], top_k=TOP_K
        )
        return [item.key for item in fused]

    hnsw = timed(nearest, texts, rounds)
    recall = _recall(conn, texts, nearest, query_vectors)
    plan = "\n".join(
        row[0] for row in conn.execute("EXPLAIN " + VECTOR_QUERY, (query_vectors[texts[0]], TOP_K))
    )
    # On a small table the planner prefers a scan to the index: say which one was timed.
    scan = "index scan" if "kb_doc_embedding" in plan else "no index: a scan"
    return [
        Figure(
            size,
            "pgvector HNSW (cosine)",
            hnsw_build,
            hnsw,
            note=f"{scan}; recall@5 against an exact scan {recall:.2f};"
            f" stand-in embeddings {embed_s:.0f} s",
        ),
        Figure(
            size,
            f"hybrid: full text + HNSW, {CANDIDATES} each, RRF",
            0.0,
            timed(hybrid, texts, rounds),
        ),
    ]


def _recall(
    conn: psycopg.Connection,
    texts: Sequence[str],
    nearest: Callable[[str], list[int]],
    query_vectors: dict[str, Vector],
) -> float:
    """The share of the index's top 5 that is as near as the exact top 5's fifth (a scan
    without the index), as ann-benchmarks counts it: documents at equal distances are
    equally right, whichever of them the scan happened to list."""
    found = 0
    for text in texts:
        vector = query_vectors[text]
        approximate = nearest(text)
        distances = conn.execute(
            "SELECT embedding <=> %s FROM kb_doc WHERE id = ANY(%s)", (vector, approximate)
        ).fetchall()
        with conn.transaction():
            conn.execute("SET LOCAL enable_indexscan = off")
            exact = conn.execute(
                "SELECT embedding <=> %s AS d FROM kb_doc ORDER BY d LIMIT %s", (vector, TOP_K)
            ).fetchall()
        fifth = exact[-1][0] + 1e-6
        found += sum(distance <= fifth for (distance,) in distances)
    return found / (TOP_K * len(texts))


# --- SQLite -------------------------------------------------------------------------------
FTS5_QUERY = (
    "SELECT rowid, bm25(kb_fts) FROM kb_fts WHERE kb_fts MATCH ? ORDER BY bm25(kb_fts) LIMIT ?"
)


def fts5_query(text: str) -> str:
    """Every word quoted (FTS5 reads bare words as its own syntax), all of them required,
    like ``websearch_to_tsquery`` of plain words."""
    return " ".join('"' + word.replace('"', '""') + '"' for word in text.split())


def sqlite_figure(documents: Sequence[str], texts: Sequence[str], rounds: int) -> Figure:
    with tempfile.TemporaryDirectory(prefix="djflow-bench-kb-") as folder:
        conn = sqlite3.connect(Path(folder) / "kb.sqlite3")
        try:
            started = time.perf_counter()
            conn.execute(
                "CREATE VIRTUAL TABLE kb_fts USING fts5(body, tokenize='porter unicode61')"
            )
            with conn:
                conn.executemany(
                    "INSERT INTO kb_fts (rowid, body) VALUES (?, ?)", enumerate(documents, 1)
                )
            conn.execute("INSERT INTO kb_fts (kb_fts) VALUES ('optimize')")
            conn.commit()
            build = time.perf_counter() - started

            def search(text: str) -> list[int]:
                rows = conn.execute(FTS5_QUERY, (fts5_query(text), TOP_K)).fetchall()
                return [row[0] for row in rows]

            matches = list(
                conn.execute(
                    "SELECT count(*) FROM kb_fts WHERE kb_fts MATCH ?", (fts5_query(text),)
                ).fetchone()[0]
                for text in texts
            )
            return Figure(
                len(documents), "SQLite FTS5 (bm25)", build, timed(search, texts, rounds), matches
            )
        finally:
            conn.close()


# --- the table ----------------------------------------------------------------------------
def format_table(figures: Sequence[Figure]) -> str:
    header = (
        "documents",
        "retrieval, top_k 5",
        "p50 ms",
        "p99 ms",
        "build s",
        "matches p50 / p99 / none",
        "",
    )
    cells = [header] + [
        (
            f"{figure.size:,}",
            figure.engine,
            f"{figure.percentile(50):.2f}",
            f"{figure.percentile(99):.2f}",
            f"{figure.build_s:.1f}" if figure.build_s else "",
            _matches(figure.matches) if figure.matches is not None else "",
            figure.note,
        )
        for figure in figures
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in cells]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines)


def _matches(counts: list[int]) -> str:
    none = sum(count == 0 for count in counts) / len(counts)
    return f"{percentile(counts, 50):,.0f} / {percentile(counts, 99):,.0f} / {none:.0%}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="corpus sizes, comma-separated")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the queries")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--no-vectors", action="store_true", help="full text only")
    options = parser.parse_args(argv)
    sizes = sorted(int(size) for size in options.sizes.split(","))
    started = time.perf_counter()
    documents = corpus(max(sizes), options.seed)
    texts = queries(options.queries, options.seed)
    print(
        f"corpus of {len(documents):,} documents in {time.perf_counter() - started:.1f} s;"
        f" {sum(len(d.split()) for d in documents) / len(documents):.0f} words each on"
        f" average; {len(texts)} queries, e.g. {texts[:3]}"
    )
    figures: list[Figure] = []
    for size in sizes:
        figures += postgres_figures(documents[:size], texts, options.rounds, not options.no_vectors)
        figures.append(sqlite_figure(documents[:size], texts, options.rounds))
        print(format_table(figures[-4:] if not options.no_vectors else figures[-2:]), flush=True)
    print()
    print(format_table(figures))


if __name__ == "__main__":
    main()
