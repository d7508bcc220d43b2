"""Workflow definitions: a workflow is an id; its versions are immutable documents."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.search import SearchVectorField
from django.core.validators import RegexValidator
from django.db import models

from .kb_names import KEY_MAX_LENGTH as KB_KEY_MAX_LENGTH
from .kb_names import NAME_MAX_LENGTH as KB_NAME_MAX_LENGTH
from .kb_names import NAME_PATTERN as KB_NAME_PATTERN
from .kb_names import TITLE_MAX_LENGTH as KB_TITLE_MAX_LENGTH

ID_PATTERN = r"^[a-z][a-z0-9_]*$"


class Workflow(models.Model):
    id = models.CharField(primary_key=True, max_length=100, validators=[RegexValidator(ID_PATTERN)])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        # The roles of CONTRACT section 8, held per workflow as object permissions
        # (django-guardian) and granted through workflows.access. The names read as roles in
        # the admin.
        permissions = [
            ("author_workflow", "Author: save new versions, grant roles"),
            ("start_workflow", "Starter: start runs, operate the runs one started"),
            ("operate_workflow", "Operator: read and operate every run, send events"),
            ("read_workflow", "Viewer: read every run"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def latest_version(self) -> WorkflowVersion | None:
        return WorkflowVersion.objects.resolve(self.id)


class VersionQuerySet(models.QuerySet["WorkflowVersion"]):
    def resolve(self, workflow_id: str, number: int | None = None) -> WorkflowVersion | None:
        """The workflow's version ``number``, or its latest when ``number`` is None (a run
        started unpinned, a subworkflow step without ``version``); None when there is none.
        The one place "latest or pinned" is decided."""
        versions = self.filter(workflow_id=workflow_id)
        if number is None:
            return versions.order_by("-number").first()
        return versions.filter(number=number).first()


class WorkflowVersion(models.Model):
    """One immutable version of a workflow's document.

    ``content_hash`` is the SHA-256 of the canonical JSON of the document without its
    ``version`` field: the same body saved again finds its version by this hash.
    """

    workflow = models.ForeignKey(Workflow, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    document = models.JSONField()
    content_hash = models.CharField(max_length=64)
    # The secrets of the document's notify entries, by entry index, encrypted: the document
    # shows •••• in their place (workflows.notify).
    secrets = models.TextField(blank=True, default="", db_default="", editable=False)
    description = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = VersionQuerySet.as_manager()

    class Meta:
        ordering = ["workflow_id", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["workflow", "number"], name="workflow_version_unique"),
        ]
        indexes = [models.Index(fields=["workflow", "content_hash"], name="workflow_version_hash")]

    def __str__(self) -> str:
        return f"{self.workflow_id} v{self.number}"


class WorkerHeartbeat(models.Model):
    """A Celery worker's word on which handlers it serves, on which queues, and when it last
    said so. Written by the worker's main process (``workers.heartbeat``) when it starts and
    every ``WORKER_HEARTBEAT_SECONDS`` after; ``stopped_at`` is set at a clean shutdown. A
    worker killed outright just stops beating: it counts as gone once ``last_seen`` is older
    than ``WORKER_LIVE_BEATS`` beats (``workflows.heartbeats``).

    It lives here, at the bottom of the layers, because starting a run (``runs``) and saving
    a document (this app's admin) both ask it "does a live worker serve this handler?".
    """

    # The worker's node name (``-n``, e.g. ``celery@host``): one row per node, reused when
    # a node of that name starts again.
    hostname = models.CharField(primary_key=True, max_length=255)
    # Handler keys of the worker's registry (``workflows.registry.handler_names()``).
    handlers = models.JSONField(default=list)
    # The queues it consumes.
    queues = models.JSONField(default=list)
    pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["hostname"]

    def __str__(self) -> str:
        return self.hostname


class RecipeQuerySet(models.QuerySet["Recipe"]):
    def resolve(self, name: str, version: int | None = None) -> Recipe | None:
        """Recipe ``name`` at ``version``, or its newest when ``version`` is None; None when
        there is none. The one place "newest or pinned" is decided for recipes."""
        versions = self.filter(name=name)
        if version is None:
            return versions.order_by("-version").first()
        return versions.filter(version=version).first()


class Recipe(models.Model):
    """One immutable version of a recipe: a named prompt (CONTRACT section 10).

    ``document`` is what ``workflows.recipes.prepare_recipe`` returned, with ``name`` and
    ``version``; ``content_hash`` is the SHA-256 of its canonical JSON without ``version``,
    as for workflow versions: the same body saved again finds its version by it. Rows are
    written by ``workflows.services.recipe_save`` only and never change.
    """

    name = models.CharField(max_length=100, validators=[RegexValidator(ID_PATTERN)])
    version = models.PositiveIntegerField()
    document = models.JSONField()
    content_hash = models.CharField(max_length=64)
    description = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = RecipeQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["name", "version"], name="recipe_version_unique"),
        ]
        indexes = [models.Index(fields=["name", "content_hash"], name="recipe_hash")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    @property
    def model(self) -> str:
        return str(self.document.get("model", ""))

    @property
    def output(self) -> str:
        return str(self.document.get("output", "text"))


class KnowledgeBase(models.Model):
    """A named collection of documents that steps write (``write_kb``) and recipes read
    (``context``), CONTRACT section 10. Created by its first write (by a run, or by a person
    through the admin, who then holds both object permissions on it: ``workflows.access``).
    Nothing deletes one."""

    name = models.CharField(
        max_length=KB_NAME_MAX_LENGTH, unique=True, validators=[RegexValidator(KB_NAME_PATTERN)]
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "knowledge base"
        # Per knowledge base, as django-guardian object permissions (workflows.access).
        permissions = [
            ("read_knowledgebase", "Read and search its documents; name it in a recipe"),
            ("write_knowledgebase", "Write documents to it (new versions)"),
        ]

    def __str__(self) -> str:
        return self.name


class KnowledgeDocument(models.Model):
    """One version of one document of a knowledge base; rows never change but for
    ``current``.

    Invariants: versions of a ``(kb, key)`` are numbered 1, 2, ... with no gap and no
    duplicate (unique constraint); exactly the newest is ``current`` (a partial unique
    constraint keeps it to one), and search sees only current rows. A write whose title and
    content equal the current version's writes nothing (``workflows.knowledge.kb_write``).
    Who wrote it: ``run_id`` and ``step_run_id`` for a ``write_kb`` step (plain ids: this app
    sits below ``runs``), ``created_by`` for a person in the admin.

    Full-text search indexes (``search_vector`` and its GIN index on Postgres, an FTS5 table
    on SQLite) are made by migration 0005 for the vendor at hand: ``workflows.kb_search``.
    Embeddings, for hybrid search, are :class:`KnowledgeEmbedding` rows.
    """

    kb = models.ForeignKey(KnowledgeBase, on_delete=models.PROTECT, related_name="documents")
    key = models.CharField(max_length=KB_KEY_MAX_LENGTH)
    version = models.PositiveIntegerField()
    title = models.CharField(max_length=KB_TITLE_MAX_LENGTH, blank=True, default="")
    content = models.TextField()
    current = models.BooleanField(default=True)
    run_id = models.UUIDField(null=True, blank=True)
    step_run_id = models.BigIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # Postgres: the title (weight A) and content (weight B) as a tsvector, kept by a trigger
    # (migration 0005) whatever writes the row, and GIN-indexed over current rows. Stored, not
    # an expression index: ranking a match reads it instead of parsing the text again. Null
    # on SQLite, whose FTS5 table is its index.
    search_vector = SearchVectorField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["kb_id", "key", "-version"]
        verbose_name = "knowledge-base document"
        constraints = [
            models.UniqueConstraint(fields=["kb", "key", "version"], name="kb_document_version"),
            models.UniqueConstraint(
                fields=["kb", "key"], condition=models.Q(current=True), name="kb_document_current"
            ),
        ]
        indexes = [
            models.Index(fields=["kb", "current", "-created_at", "-id"], name="kb_document_newest"),
        ]

    def __str__(self) -> str:
        return f"{self.key} v{self.version}"


class KnowledgeEmbedding(models.Model):
    """The embedding of one document version by one model at one length (hybrid retrieval,
    ``DJFLOW_EMBEDDINGS_MODEL``), written by a worker after the version (``workers.kb_embed``)
    and never changed.

    The vector itself is the ``embedding vector`` column, which this model does not declare:
    it exists only where PostgreSQL has the pgvector extension, added by
    ``workflows.kb_vectors.install`` (migration 0006 and every ``migrate``), and only that
    module reads or writes it. Rows are inserted there, whole, never through the ORM; the
    table exists everywhere so that migrations are the same on every database."""

    document = models.ForeignKey(
        KnowledgeDocument, on_delete=models.CASCADE, related_name="embeddings"
    )
    model = models.CharField(max_length=200)
    dimensions = models.PositiveIntegerField()
    input_tokens = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "knowledge-base embedding"
        constraints = [
            models.UniqueConstraint(
                fields=["document", "model", "dimensions"], name="kb_embedding_once"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model} ({self.dimensions}) of document {self.document_id}"
