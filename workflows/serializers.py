"""Shapes of definitions in the API. Input is the raw document; these only render output."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .kb_names import KEY_MAX_LENGTH
from .kb_search import MAX_QUERY_CHARS
from .models import KnowledgeBase, KnowledgeDocument, Recipe, Workflow, WorkflowVersion
from .selectors import SHOWN_RECIPE_VERSIONS


class SavedDefinitionSerializer(serializers.Serializer):
    """The answer to ``POST /definitions``, rendered from a ``services.SaveResult``."""

    id = serializers.CharField(source="version.workflow_id")
    version = serializers.IntegerField(source="version.number")
    created = serializers.BooleanField(
        help_text="true when this call stored a new version (201), false when it was known (200)"
    )
    created_at = serializers.DateTimeField(source="version.created_at")
    content_hash = serializers.CharField(source="version.content_hash")


class VersionSummarySerializer(serializers.ModelSerializer):
    version = serializers.IntegerField(source="number")
    created_by = serializers.CharField(
        source="created_by.get_username", default=None, allow_null=True
    )

    class Meta:
        model = WorkflowVersion
        fields = ["version", "content_hash", "description", "created_at", "created_by"]


class VersionSerializer(VersionSummarySerializer):
    id = serializers.CharField(source="workflow_id")
    document = serializers.JSONField()

    class Meta(VersionSummarySerializer.Meta):
        fields = ["id", *VersionSummarySerializer.Meta.fields, "document"]


class WorkflowListSerializer(serializers.ModelSerializer):
    latest_version = serializers.IntegerField(source="latest_number", allow_null=True)
    description = serializers.CharField(source="latest_description", allow_null=True)

    class Meta:
        model = Workflow
        fields = ["id", "latest_version", "description", "created_at"]


class WorkflowDetailSerializer(WorkflowListSerializer):
    versions = VersionSummarySerializer(many=True, read_only=True)
    document = serializers.SerializerMethodField()

    class Meta(WorkflowListSerializer.Meta):
        fields = [*WorkflowListSerializer.Meta.fields, "versions", "document"]

    def get_document(self, workflow: Workflow) -> dict[str, Any] | None:
        """The latest version's document."""
        latest = max(workflow.versions.all(), key=lambda v: v.number, default=None)
        return latest.document if latest else None


# --- recipes ---------------------------------------------------------------------------------


class SavedRecipeSerializer(serializers.Serializer):
    """The answer to ``POST /recipes``: ``{"recipe": Recipe, "created": bool}``."""

    name = serializers.CharField(source="recipe.name")
    version = serializers.IntegerField(source="recipe.version")
    created = serializers.BooleanField(
        help_text="true when this call stored a new version (201), false when it was known (200)"
    )
    created_at = serializers.DateTimeField(source="recipe.created_at")
    content_hash = serializers.CharField(source="recipe.content_hash")


class RecipeSummarySerializer(serializers.ModelSerializer):
    model = serializers.CharField(
        help_text="'<provider>:<model>', or empty when the recipe names none"
    )
    output = serializers.ChoiceField(choices=["text", "json"])
    created_by = serializers.CharField(
        source="created_by.get_username", default=None, allow_null=True
    )

    class Meta:
        model = Recipe
        fields = [
            "name",
            "version",
            "description",
            "model",
            "output",
            "content_hash",
            "created_at",
            "created_by",
        ]


class RecipeSerializer(RecipeSummarySerializer):
    document = serializers.JSONField()

    class Meta(RecipeSummarySerializer.Meta):
        fields = [*RecipeSummarySerializer.Meta.fields, "document"]


class RecipeDetailSerializer(RecipeSerializer):
    """The newest version; ``versions``, the newest version numbers, and ``versions_total``, how
    many there are (``context["versions"]``: a ``selectors.RecipeVersions``)."""

    versions = serializers.SerializerMethodField(
        help_text=f"the newest {SHOWN_RECIPE_VERSIONS} version numbers, newest first"
    )
    versions_total = serializers.SerializerMethodField(
        help_text="how many versions the recipe has (more than 'versions' lists when over "
        f"{SHOWN_RECIPE_VERSIONS})"
    )

    class Meta(RecipeSerializer.Meta):
        fields = [*RecipeSerializer.Meta.fields, "versions", "versions_total"]

    @extend_schema_field({"type": "array", "items": {"type": "integer"}})
    def get_versions(self, recipe: Recipe) -> list[int]:
        return self.context["versions"].numbers

    @extend_schema_field({"type": "integer"})
    def get_versions_total(self, recipe: Recipe) -> int:
        return int(self.context["versions"].total)


# --- knowledge bases (CONTRACT section 10) ----------------------------------------------------


class KnowledgeBaseSerializer(serializers.ModelSerializer):
    documents = serializers.IntegerField(
        source="document_count",
        read_only=True,
        help_text="how many documents (keys) it holds, each at its newest version",
    )
    created_by = serializers.CharField(
        source="created_by.get_username", default=None, allow_null=True
    )

    class Meta:
        model = KnowledgeBase
        fields = ["name", "documents", "created_at", "created_by"]
        read_only_fields = fields


class KnowledgeDocumentSerializer(serializers.ModelSerializer):
    kb = serializers.CharField(source="kb.name", read_only=True)
    created_by = serializers.CharField(
        source="created_by.get_username", default=None, allow_null=True
    )
    run = serializers.UUIDField(
        source="run_id", allow_null=True, help_text="the run whose write_kb step wrote it"
    )
    step_run = serializers.IntegerField(
        source="step_run_id", allow_null=True, help_text="the attempt that wrote it"
    )
    score = serializers.SerializerMethodField(
        help_text="with ?q=: how well it matches (larger is better; comparable within one "
        "search only); null otherwise"
    )

    class Meta:
        model = KnowledgeDocument
        fields = [
            "kb",
            "key",
            "version",
            "current",
            "title",
            "content",
            "score",
            "created_at",
            "created_by",
            "run",
            "step_run",
        ]
        read_only_fields = fields

    @extend_schema_field({"type": "number", "nullable": True})
    def get_score(self, document: KnowledgeDocument) -> float | None:
        return self.context.get("scores", {}).get(document.pk)


class KnowledgeDocumentQuerySerializer(serializers.Serializer):
    """The parameters of ``GET /kbs/{kb}/documents``."""

    q = serializers.CharField(
        required=False,
        max_length=MAX_QUERY_CHARS,
        trim_whitespace=False,
        help_text='search: every word must occur ("a phrase", or, -word); ranked results',
    )
    key = serializers.CharField(
        required=False,
        max_length=KEY_MAX_LENGTH,
        trim_whitespace=False,
        help_text="every version of this one document, newest first",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "q" in attrs and "key" in attrs:
            raise serializers.ValidationError(
                {"key": "give q (search) or key (versions), not both"}
            )
        return attrs
