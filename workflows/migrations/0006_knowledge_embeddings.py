"""Embeddings of knowledge-base documents (hybrid retrieval): the KnowledgeEmbedding table
on every database, and its vector column where PostgreSQL has pgvector
(``workflows.kb_vectors.install``, which ``migrate`` also runs each time: pgvector installed
later needs only a ``migrate``). The unused JSON seam on the documents goes."""

import django.db.models.deletion
from django.db import migrations, models


def add_vector_column(apps, schema_editor):
    from workflows import kb_vectors

    kb_vectors.install(schema_editor.connection)


def drop_vector_column(apps, schema_editor):
    from workflows import kb_vectors

    kb_vectors.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("workflows", "0005_knowledge_bases"),
    ]

    operations = [
        migrations.RemoveField(
            model_name="knowledgedocument",
            name="embedding",
        ),
        migrations.RemoveField(
            model_name="knowledgedocument",
            name="embedding_model",
        ),
        migrations.CreateModel(
            name="KnowledgeEmbedding",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("model", models.CharField(max_length=200)),
                ("dimensions", models.PositiveIntegerField()),
                ("input_tokens", models.PositiveIntegerField(default=0)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "document",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="embeddings",
                        to="workflows.knowledgedocument",
                    ),
                ),
            ],
            options={
                "verbose_name": "knowledge-base embedding",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("document", "model", "dimensions"), name="kb_embedding_once"
                    )
                ],
            },
        ),
        migrations.RunPython(add_vector_column, drop_vector_column),
    ]
