"""Reads of workflow definitions that are more than a filter."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, Exists, Max, OuterRef, Q, QuerySet, Subquery

from .errors import FieldError, NotFound, echo
from .models import KnowledgeBase, KnowledgeDocument, Recipe, Workflow, WorkflowVersion


def workflow_list() -> QuerySet[Workflow]:
    latest = WorkflowVersion.objects.filter(workflow=OuterRef("pk")).order_by("-number")
    return Workflow.objects.annotate(
        latest_number=Max("versions__number"),
        latest_description=Subquery(latest.values("description")[:1]),
    )


def workflow_get(*, workflow_id: str) -> Workflow:
    workflow = workflow_list().filter(id=workflow_id).first()
    if workflow is None:
        raise NotFound(errors=[FieldError("id", f"unknown workflow '{workflow_id}'")])
    return workflow


def version_get(
    *,
    workflow_id: str,
    number: int | None = None,
    versions: QuerySet[WorkflowVersion] | None = None,
) -> WorkflowVersion:
    """The given version of a workflow, or its latest when ``number`` is None; 404 (naming
    the version or the workflow) when there is none. ``versions`` says what else to read
    (the API shows the author: ``select_related("created_by")``)."""
    versions = WorkflowVersion.objects.all() if versions is None else versions
    version = versions.resolve(workflow_id, number)
    if version is None:
        if number is not None and WorkflowVersion.objects.filter(workflow_id=workflow_id).exists():
            raise NotFound(
                errors=[FieldError("version", f"workflow '{workflow_id}' has no version {number}")]
            )
        raise NotFound(errors=[FieldError("workflow", f"unknown workflow '{workflow_id}'")])
    return version


# --- recipes ---------------------------------------------------------------------------------


def recipe_list() -> QuerySet[Recipe]:
    """The newest version of every recipe name (one row per name)."""
    newer = Recipe.objects.filter(name=OuterRef("name"), version__gt=OuterRef("version"))
    return Recipe.objects.filter(~Exists(newer)).select_related("created_by")


def recipe_get(*, name: str, version: int | None = None) -> Recipe:
    """Recipe ``name`` at ``version``, or its newest; 404 naming the version or the name."""
    found = Recipe.objects.select_related("created_by").resolve(name, version)
    if found is None:
        if version is not None and Recipe.objects.filter(name=name).exists():
            raise NotFound(
                errors=[FieldError("version", f"recipe '{echo(name)}' has no version {version}")]
            )
        raise NotFound(errors=[FieldError("name", f"unknown recipe '{echo(name)}'")])
    return found


# How many version numbers a recipe's API item and admin page list: the newest ones. A recipe
# saved by a script on every deploy gathers thousands; older versions stay readable by number.
SHOWN_RECIPE_VERSIONS = 100


@dataclass(frozen=True)
class RecipeVersions:
    """The newest ``SHOWN_RECIPE_VERSIONS`` versions of a recipe, newest first, as ``(pk,
    number)``; ``total`` counts them all."""

    newest: list[tuple[int, int]]
    total: int

    @property
    def numbers(self) -> list[int]:
        return [number for _, number in self.newest]


def recipe_versions(*, name: str, limit: int = SHOWN_RECIPE_VERSIONS) -> RecipeVersions:
    """The newest ``limit`` versions of recipe ``name`` and how many it has (two queries on
    the (name, version) index, whatever the count)."""
    versions = Recipe.objects.filter(name=name)
    newest = versions.order_by("-version").values_list("pk", "version")[:limit]
    return RecipeVersions(newest=list(newest), total=versions.count())


# --- knowledge bases ----------------------------------------------------------------------------


def kb_list() -> QuerySet[KnowledgeBase]:
    """Knowledge bases with how many documents (current versions) each holds."""
    return KnowledgeBase.objects.select_related("created_by").annotate(
        document_count=Count("documents", filter=Q(documents__current=True))
    )


def kb_documents(*, kb: KnowledgeBase, key: str | None = None) -> QuerySet[KnowledgeDocument]:
    """The current version of each document of ``kb``; with ``key``, every version of that one
    document."""
    documents = KnowledgeDocument.objects.filter(kb=kb).select_related("kb", "created_by")
    return documents.filter(key=key) if key is not None else documents.filter(current=True)
