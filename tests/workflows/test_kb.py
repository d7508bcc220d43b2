"""Knowledge bases: versioned writes (workflows.knowledge) and full-text search
(workflows.kb_search) on Postgres, and the FTS5 expression the embedded default's SQLite
matches, run against a real FTS5 table made by migration 0005's own statements."""

from __future__ import annotations

import importlib
import sqlite3
import threading
from typing import Any

import pytest
from django.db import connection, connections

from workflows import kb_search, knowledge
from workflows.errors import InvalidInput, NotFound
from workflows.models import KnowledgeBase, KnowledgeDocument

MIGRATION = importlib.import_module("workflows.migrations.0005_knowledge_bases")


def write(key: str = "t-1", content: str = "Clear the export cache.", **more: Any) -> Any:
    return knowledge.kb_write(kb=more.pop("kb", "answers"), key=key, content=content, **more)


# --- writes ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_first_write_creates_the_knowledge_base_and_version_1() -> None:
    written = write(title="Export crashes")
    assert written.created and written.document.version == 1 and written.document.current
    assert KnowledgeBase.objects.get(name="answers").created_by is None


@pytest.mark.django_db
def test_the_same_text_again_makes_no_version_and_answers_the_current_one() -> None:
    first = write(title="Export crashes")
    again = write(title="Export crashes")
    assert not again.created and again.document.pk == first.document.pk
    assert KnowledgeDocument.objects.count() == 1


@pytest.mark.django_db
def test_a_change_makes_the_next_version_current_and_keeps_the_old() -> None:
    write(title="Export crashes")
    retitled = write(title="Export crashes (fixed)")
    rewritten = write(title="Export crashes (fixed)", content="Update to 2.1.")
    assert (retitled.document.version, rewritten.document.version) == (2, 3)
    rows = list(KnowledgeDocument.objects.order_by("version").values_list("version", "current"))
    assert rows == [(1, False), (2, False), (3, True)]
    # Back to the first text: a new version, not the old row revived.
    assert write(title="Export crashes").document.version == 4


@pytest.mark.django_db
def test_keys_and_knowledge_bases_number_apart() -> None:
    write("a")
    write("a", content="two")
    assert write("b").document.version == 1
    assert write("a", kb="other").document.version == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kb": "Bad Name"}, "kb"),
        ({"kb": ""}, "kb"),
        ({"kb": "x" * 101}, "kb"),
        ({"key": ""}, "key"),
        ({"key": "k" * 201}, "key"),
        ({"title": "t" * 501}, "title"),
        ({"content": "x" * 102_401}, "content"),
        ({"content": "nul \x00 inside"}, "content"),
        # Postgres text refuses NUL, and UTF-8 a lone surrogate (SQLite's JSON keeps one):
        # each is named by its own field, not a database error.
        ({"key": "k\x00"}, "key"),
        ({"title": "t\x00"}, "title"),
        ({"key": "k\ud800"}, "key"),
        ({"title": "\udfff"}, "title"),
        ({"content": "half \ud83d a pair"}, "content"),
    ],
    ids=[
        "bad-name",
        "empty-name",
        "long-name",
        "empty-key",
        "long-key",
        "long-title",
        "big",
        "nul",
        "nul-key",
        "nul-title",
        "surrogate-key",
        "surrogate-title",
        "surrogate-content",
    ],
)
def test_a_bad_field_is_refused_naming_it_and_writes_nothing(
    fields: dict[str, Any], field: str
) -> None:
    arguments = {"kb": "answers", "key": "k", "content": "c", **fields}
    with pytest.raises(InvalidInput) as refused:
        knowledge.kb_write(**arguments)
    assert [error.field for error in refused.value.errors] == [field]
    assert not KnowledgeDocument.objects.exists()


@pytest.mark.django_db
def test_the_content_bound_is_the_setting(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "KB_MAX_CONTENT_BYTES": 10}
    with pytest.raises(InvalidInput, match="DJFLOW_KB_MAX_CONTENT_BYTES"):
        write(content="é" * 6)  # 12 bytes of UTF-8
    assert write(content="é" * 5).created


@pytest.mark.django_db
def test_a_write_that_may_not_create_needs_an_existing_knowledge_base() -> None:
    with pytest.raises(NotFound) as missing:
        write(create=False)
    assert missing.value.errors[0].field == "kb"
    write()
    assert write(content="new", create=False).document.version == 2


@pytest.mark.django_db(transaction=True)
def test_concurrent_writes_of_one_key_never_share_a_version_number() -> None:
    """Twelve threads, each its own connection, write different texts to one key at once
    (and six the same text): versions 1..13 with no gap and no duplicate, one current."""
    write("shared", content="seed")
    barrier = threading.Barrier(18)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            barrier.wait(timeout=10)
            write("shared", content=f"text {n}" if n < 12 else "same for all")
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(18)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    versions = sorted(
        KnowledgeDocument.objects.filter(key="shared").values_list("version", flat=True)
    )
    # 12 distinct texts and one "same for all" (written once, then found equal, unless another
    # text came between two of them: then it is written again as a newer version).
    assert versions == list(range(1, len(versions) + 1))
    assert 14 <= len(versions) <= 19
    assert KnowledgeDocument.objects.filter(key="shared", current=True).count() == 1


# --- search on Postgres ---------------------------------------------------------------------


@pytest.fixture
def corpus(db) -> KnowledgeBase:
    write("crash", title="Export crashes", content="Clear the export cache, then export again.")
    write("invoice", title="Where is my invoice", content="Invoices are under Billing, monthly.")
    write("login", title="Cannot sign in", content="Reset the password; export tokens expire.")
    write("other", kb="elsewhere", title="Export crashes", content="Not in this base.")
    return KnowledgeBase.objects.get(name="answers")


def test_search_ranks_a_title_match_above_a_content_match(corpus: KnowledgeBase) -> None:
    hits = kb_search.search("answers", "export", 5)
    assert [hit.key for hit in hits] == ["crash", "login"]
    assert hits[0].score > hits[1].score > 0
    assert hits[0].title == "Export crashes" and hits[0].version == 1


def test_search_reads_only_the_knowledge_base_asked(corpus: KnowledgeBase) -> None:
    assert {hit.key for hit in kb_search.search(corpus, "export crashes", 5)} == {"crash"}
    assert [hit.key for hit in kb_search.search("elsewhere", "export", 5)] == ["other"]
    assert kb_search.search("nowhere", "export", 5) == []


def test_search_sees_only_the_current_version(corpus: KnowledgeBase) -> None:
    write("crash", title="Export crashes", content="Update to version 2.1; the cache is gone.")
    assert [hit.key for hit in kb_search.search("answers", "update", 5)] == ["crash"]
    assert [hit.version for hit in kb_search.search("answers", "crashes", 5)] == [2]
    assert kb_search.search("answers", "again", 5) == []  # only the old text said it


def test_web_search_syntax_and_any_word_matching(corpus: KnowledgeBase) -> None:
    assert [h.key for h in kb_search.search("answers", "export -password", 5)] == ["crash"]
    assert [h.key for h in kb_search.search("answers", '"export cache"', 5)] == ["crash"]
    assert kb_search.search("answers", "export invoice", 5) == []  # every word must occur
    both = kb_search.search("answers", "export or invoice", 5)
    assert {h.key for h in both} == {"crash", "login", "invoice"}
    # A ticket's whole text as the query: any word may match, more of them ranking higher.
    ticket = "Hello! My export crashes every time, what should I clear?"
    assert kb_search.search("answers", ticket, 5, match="any")[0].key == "crash"


def test_top_k_bounds_the_hits(corpus: KnowledgeBase) -> None:
    assert len(kb_search.search("answers", "export or invoice", 2)) == 2
    assert len(kb_search.search("answers", "export or invoice", 0)) == 1  # at least one


# What search syntax looks like to Postgres's websearch parser and to FTS5: a search must
# treat it as text.
SYNTAX = ['"', "'", "(", ")", "*", "-", ":", "^", "NOT", "AND OR", 'a" OR "b']


@pytest.mark.parametrize("query", [*SYNTAX, "col:export", "\\", "&|!"])
def test_query_syntax_characters_never_fail(corpus: KnowledgeBase, query: str) -> None:
    for match in ("all", "any"):
        assert isinstance(kb_search.search("answers", query, 5, match=match), list)  # type: ignore[arg-type]


def test_a_long_query_is_cut_to_what_search_reads(corpus: KnowledgeBase) -> None:
    query = "export " + "x" * 5000
    assert kb_search.words(query) == ["export", "x" * (kb_search.MAX_QUERY_CHARS - 7)]
    assert kb_search.search("answers", query, 5, match="any")[0].key == "crash"


@pytest.mark.django_db
def test_search_uses_the_gin_index_on_10000_rows() -> None:
    """EXPLAIN of the search's own SQL on 10,000 documents: the expression index is read
    (no sequential scan of the table)."""
    kb = KnowledgeBase.objects.create(name="big")
    KnowledgeDocument.objects.bulk_create(
        KnowledgeDocument(
            kb=kb,
            key=f"k{n}",
            version=1,
            title=f"Ticket {n}",
            # About the size of a short answer: 60 words, one of them rare.
            content=f"word{n % 997} " + " ".join(f"common{(n * k) % 50}" for k in range(59)),
        )
        for n in range(10_000)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflows_knowledgedocument")
    queryset = _search_queryset([kb.pk], "word42")
    plan = queryset.explain()
    assert "kb_document_search" in plan, plan
    assert "Seq Scan on workflows_knowledgedocument" not in plan, plan
    assert [hit.key for hit in kb_search.search(kb, "word42", 3)][:1] != []


def _search_queryset(kb_ids: list[int], query: str) -> Any:
    from django.contrib.postgres.search import SearchQuery

    tsquery = SearchQuery(query, search_type="websearch", config=kb_search.TEXT_SEARCH_CONFIG)
    return KnowledgeDocument.objects.filter(kb_id__in=kb_ids, current=True, search_vector=tsquery)


# --- SQLite FTS5 (the embedded default) ----------------------------------------------------


@pytest.mark.parametrize(
    ("query", "match", "expected"),
    [
        ("export crash", "all", '("export") AND ("crash")'),
        ('"export cache" now', "all", '("export cache") AND ("now")'),
        ("export or invoice", "all", '("export" OR "invoice")'),
        ("export -password", "all", '("export") NOT "password"'),
        ("-password", "all", ""),
        ("or", "all", ""),
        ('a" OR "b', "all", '("a" OR "b")'),
        ("col:export NEAR(x)", "all", '("col export") AND ("NEAR x")'),
        ("export crash", "any", '"export" OR "crash"'),
        ("*^()", "any", ""),
    ],
    ids=["and", "phrase", "or", "not", "only-not", "only-or", "quotes", "syntax", "any", "none"],
)
def test_fts5_expressions_are_quoted_words_only(query: str, match: str, expected: str) -> None:
    assert kb_search.fts5_expression(query, match) == expected  # type: ignore[arg-type]


@pytest.fixture
def fts5() -> Any:
    """An in-memory SQLite with the documents table's columns and migration 0005's FTS5 table
    and triggers (its very statements)."""
    db = sqlite3.connect(":memory:")
    db.execute(
        "CREATE TABLE workflows_knowledgedocument (id INTEGER PRIMARY KEY, kb_id INTEGER, "
        "key TEXT, version INTEGER, title TEXT, content TEXT, current BOOL)"
    )
    for statement in MIGRATION.SQLITE_FORWARD:
        db.execute(statement)
    rows = [
        (1, 1, "crash", 1, "Export crashes", "Clear the export cache.", 1),
        (2, 1, "login", 1, "Cannot sign in", "Reset the password; export tokens expire.", 1),
    ]
    db.executemany("INSERT INTO workflows_knowledgedocument VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    yield db
    db.close()


def _fts_keys(db: Any, query: str, match: str = "all") -> list[str]:
    expression = kb_search.fts5_expression(query, match)  # type: ignore[arg-type]
    if not expression:
        return []
    sql = (
        f"SELECT d.key FROM {kb_search.FTS_TABLE} JOIN workflows_knowledgedocument d "
        f"ON d.id = {kb_search.FTS_TABLE}.rowid WHERE {kb_search.FTS_TABLE} MATCH ? "
        f"AND d.current ORDER BY bm25({kb_search.FTS_TABLE}, 2.5, 1.0)"
    )
    return [key for (key,) in db.execute(sql, [expression])]


def test_fts5_ranks_title_matches_first_and_follows_current(fts5: Any) -> None:
    assert _fts_keys(fts5, "export") == ["crash", "login"]
    # A new version: the old row stops being current, the new one is inserted current.
    fts5.execute("UPDATE workflows_knowledgedocument SET current = 0 WHERE id = 1")
    fts5.execute(
        "INSERT INTO workflows_knowledgedocument VALUES (3, 1, 'crash', 2, 'Export crashes', "
        "'Update to 2.1.', 1)"
    )
    assert _fts_keys(fts5, "cache") == []
    assert _fts_keys(fts5, "update") == ["crash"]
    assert _fts_keys(fts5, "crashing") == ["crash"]  # the porter stemmer
    table = kb_search.FTS_TABLE
    fts5.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")


@pytest.mark.parametrize("query", [*SYNTAX, "col:x", "NEAR(a b)", "{a}"])
def test_fts5_never_sees_user_syntax(fts5: Any, query: str) -> None:
    for match in ("all", "any"):
        assert isinstance(_fts_keys(fts5, f"export {query}", match), list)
