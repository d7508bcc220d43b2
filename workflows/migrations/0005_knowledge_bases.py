"""Knowledge bases and their versioned documents, and the full-text index search reads:
on Postgres the weighted ``tsvector`` column kept by a trigger and a GIN index over the
current rows; on SQLite an FTS5 table over the current versions, kept by triggers (rows
change only in ``current``)."""

import django.contrib.postgres.search

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

# The search vector: the title (weight A) and the content (weight B) in the english
# configuration, set by a trigger on every insert and on a change of either, whatever writes
# the row; a GIN index over the current rows, which are the only ones searched.
_VECTOR = (
    "setweight(to_tsvector('english'::regconfig, COALESCE(NEW.title, '')), 'A') || "
    "setweight(to_tsvector('english'::regconfig, COALESCE(NEW.content, '')), 'B')"
)
POSTGRES_FORWARD = [
    "CREATE FUNCTION workflows_kb_search_vector() RETURNS trigger LANGUAGE plpgsql AS $$ "
    f"BEGIN NEW.search_vector := {_VECTOR}; RETURN NEW; END $$",
    "CREATE TRIGGER kb_search_vector BEFORE INSERT OR UPDATE OF title, content "
    "ON workflows_knowledgedocument FOR EACH ROW EXECUTE FUNCTION workflows_kb_search_vector()",
    "CREATE INDEX kb_document_search ON workflows_knowledgedocument USING gin (search_vector) "
    "WHERE current",
]
POSTGRES_BACKWARD = [
    "DROP INDEX IF EXISTS kb_document_search",
    "DROP TRIGGER IF EXISTS kb_search_vector ON workflows_knowledgedocument",
    "DROP FUNCTION IF EXISTS workflows_kb_search_vector()",
]

_FTS = "workflows_knowledgedocument_fts"
_ADD = f"INSERT INTO {_FTS}(rowid, title, content) SELECT new.id, new.title, new.content"
_REMOVE = (
    f"INSERT INTO {_FTS}({_FTS}, rowid, title, content) "
    "SELECT 'delete', old.id, old.title, old.content"
)
SQLITE_FORWARD = [
    f"CREATE VIRTUAL TABLE {_FTS} USING fts5(title, content, "
    "content='workflows_knowledgedocument', content_rowid='id', "
    "tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER kb_fts_insert AFTER INSERT ON workflows_knowledgedocument "
    f"WHEN new.current BEGIN {_ADD}; END",
    # One trigger, so the old row leaves the index before the new one enters it.
    "CREATE TRIGGER kb_fts_update AFTER UPDATE ON workflows_knowledgedocument "
    f"BEGIN {_REMOVE} WHERE old.current; {_ADD} WHERE new.current; END",
    "CREATE TRIGGER kb_fts_delete AFTER DELETE ON workflows_knowledgedocument "
    f"WHEN old.current BEGIN {_REMOVE}; END",
]
SQLITE_BACKWARD = [
    "DROP TRIGGER IF EXISTS kb_fts_insert",
    "DROP TRIGGER IF EXISTS kb_fts_update",
    "DROP TRIGGER IF EXISTS kb_fts_delete",
    f"DROP TABLE IF EXISTS {_FTS}",
]


def _run(statements: dict[str, list[str]]):
    def run(apps, schema_editor):
        for statement in statements.get(schema_editor.connection.vendor, []):
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("workflows", "0004_recipe"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="KnowledgeBase",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        max_length=100,
                        unique=True,
                        validators=[django.core.validators.RegexValidator("^[a-z0-9][a-z0-9_-]*$")],
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "verbose_name": "knowledge base",
                "ordering": ["name"],
                "permissions": [
                    ("read_knowledgebase", "Read and search its documents; name it in a recipe"),
                    ("write_knowledgebase", "Write documents to it (new versions)"),
                ],
            },
        ),
        migrations.CreateModel(
            name="KnowledgeDocument",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=200)),
                ("version", models.PositiveIntegerField()),
                ("title", models.CharField(blank=True, default="", max_length=500)),
                ("content", models.TextField()),
                ("current", models.BooleanField(default=True)),
                ("run_id", models.UUIDField(blank=True, null=True)),
                ("step_run_id", models.BigIntegerField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("embedding_model", models.CharField(blank=True, default="", max_length=200)),
                ("embedding", models.JSONField(blank=True, editable=False, null=True)),
                (
                    "search_vector",
                    django.contrib.postgres.search.SearchVectorField(
                        blank=True, editable=False, null=True
                    ),
                ),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "kb",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="documents",
                        to="workflows.knowledgebase",
                    ),
                ),
            ],
            options={
                "verbose_name": "knowledge-base document",
                "ordering": ["kb_id", "key", "-version"],
                "indexes": [
                    models.Index(
                        fields=["kb", "current", "-created_at", "-id"], name="kb_document_newest"
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("kb", "key", "version"), name="kb_document_version"
                    ),
                    models.UniqueConstraint(
                        condition=models.Q(("current", True)),
                        fields=("kb", "key"),
                        name="kb_document_current",
                    ),
                ],
            },
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRES_FORWARD, "sqlite": SQLITE_FORWARD}),
            _run({"postgresql": POSTGRES_BACKWARD, "sqlite": SQLITE_BACKWARD}),
        ),
    ]
