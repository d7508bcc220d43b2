"""pgvector through Django on psycopg 3 (``pgvector.django``), with the stand-in's
embeddings: the column, the HNSW index on cosine distance and the ordering the hybrid
retrieval of knowledge bases will use.

Needs the pgvector extension in the PostgreSQL under test (the README says how to install
it); skipped, saying so, where it is not available (the embedded default's SQLite has none).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, models
from django.test.utils import isolate_apps
from pgvector.django import CosineDistance, HnswIndex, VectorField

from workers import providers

pytestmark = pytest.mark.django_db

TEXTS = [
    "printer jam in tray 2 after the firmware update",
    "refund for a damaged package, order 1182",
    "VPN drops every hour on the office wifi",
    "the printer shows a paper jam and stops",
]


@pytest.fixture
def vectors() -> Iterator[None]:
    if connection.vendor != "postgresql":
        pytest.skip("pgvector needs PostgreSQL")
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
        if cursor.fetchone() is None:
            pytest.skip("the pgvector extension is not installed in this PostgreSQL")
        cursor.execute("CREATE EXTENSION IF NOT EXISTS vector")
    yield


@isolate_apps("workflows")
def test_nearest_passages_by_cosine_distance_through_the_hnsw_index(vectors: None) -> None:
    class Passage(models.Model):
        text = models.TextField()
        embedding = VectorField(dimensions=16)

        class Meta:
            app_label = "workflows"
            indexes = [
                HnswIndex(
                    name="passage_embedding",
                    fields=["embedding"],
                    m=16,
                    ef_construction=64,
                    opclasses=["vector_cosine_ops"],
                )
            ]

        def __str__(self) -> str:
            return self.text

    with connection.schema_editor() as editor:
        editor.create_model(Passage)
    reply = providers.embed("standin:hash", TEXTS, dimensions=16)
    Passage.objects.bulk_create(
        Passage(text=text, embedding=vector)
        for text, vector in zip(TEXTS, reply.vectors, strict=True)
    )
    (query,) = providers.embed("standin:hash", ["printer paper jam"], dimensions=16).vectors

    nearest = list(
        Passage.objects.annotate(distance=CosineDistance("embedding", query))
        .order_by("distance")
        .values_list("text", "distance")[:2]
    )

    assert [text for text, _ in nearest] == [TEXTS[3], TEXTS[0]]
    assert 0 <= nearest[0][1] < nearest[1][1] < 1
    # Read back as floats (no numpy needed), as written.
    stored = Passage.objects.get(text=TEXTS[1]).embedding
    assert list(stored) == pytest.approx(reply.vectors[1], abs=1e-6)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = Passage.objects.order_by(CosineDistance("embedding", query)).explain()
    assert "passage_embedding" in plan
