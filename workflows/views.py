"""The definitions API (contract section 7). Views parse and render; services decide."""

from __future__ import annotations

from typing import Any

from django.db.models import Prefetch
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.openapi import ERROR_BODY
from config.pagination import ContractCursorPagination, NewestFirstPagination

from . import access, kb_search, recipes, selectors, services
from .errors import FieldError, InvalidInput, NotFound, echo
from .kb_search import MAX_TOP_K
from .models import KnowledgeBase, WorkflowVersion
from .schema import document_body_schema, load_schema
from .selectors import SHOWN_RECIPE_VERSIONS
from .serializers import (
    KnowledgeBaseSerializer,
    KnowledgeDocumentQuerySerializer,
    KnowledgeDocumentSerializer,
    RecipeDetailSerializer,
    RecipeSerializer,
    RecipeSummarySerializer,
    SavedDefinitionSerializer,
    SavedRecipeSerializer,
    VersionSerializer,
    WorkflowDetailSerializer,
    WorkflowListSerializer,
)

ERRORS = OpenApiResponse(
    response=ERROR_BODY,
    description="Every problem, each naming its field where it has one.",
)


class DefinitionPagination(ContractCursorPagination):
    ordering = "id"


class DefinitionListView(APIView):
    pagination_class = DefinitionPagination

    @extend_schema(
        operation_id="definitions_list",
        parameters=[*DefinitionPagination.schema_parameters()],
        responses={200: WorkflowListSerializer(many=True), 400: ERRORS, 401: ERRORS},
    )
    def get(self, request: Request) -> Response:
        paginator = self.pagination_class()
        workflows = access.visible_workflows(request.user, selectors.workflow_list())
        page = paginator.paginate_queryset(workflows, request, view=self)
        data = WorkflowListSerializer(page, many=True).data
        return paginator.get_paginated_response(data)

    @extend_schema(
        operation_id="definitions_save",
        request={"application/json": document_body_schema()},
        description=(
            "Save a workflow document (see /api/v1/definition.schema.json). The same body again"
            " answers 200 with the existing version; a different body for an existing version"
            " is 409; an omitted version gets the next number (201)."
        ),
        responses={
            201: SavedDefinitionSerializer,
            200: SavedDefinitionSerializer,
            400: ERRORS,
            401: ERRORS,
            403: ERRORS,
            409: ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        result = services.definition_save(document=request.data, user=request.user)
        body = SavedDefinitionSerializer(result).data
        return Response(body, status=status.HTTP_201_CREATED if result.created else 200)


class DefinitionDetailView(APIView):
    @extend_schema(
        operation_id="definitions_read",
        responses={200: WorkflowDetailSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, workflow_id: str) -> Response:
        access.require_definition(request.user, workflow_id, field="id")
        workflow = selectors.workflow_get(workflow_id=workflow_id)
        versions = WorkflowVersion.objects.select_related("created_by").order_by("-number")
        workflow = (
            selectors.workflow_list()
            .prefetch_related(Prefetch("versions", queryset=versions))
            .get(pk=workflow.pk)
        )
        return Response(WorkflowDetailSerializer(workflow).data)


class DefinitionVersionView(APIView):
    @extend_schema(
        operation_id="definitions_version_read",
        parameters=[OpenApiParameter("version", int, OpenApiParameter.PATH)],
        responses={200: VersionSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, workflow_id: str, version: str) -> Response:
        access.require_definition(request.user, workflow_id, field="id")
        number = _version_number(version)
        found = selectors.version_get(
            workflow_id=workflow_id,
            number=number,
            versions=WorkflowVersion.objects.select_related("created_by"),
        )
        return Response(VersionSerializer(found).data)


class DefinitionSchemaView(APIView):
    """The JSON Schema of workflow documents: public, like any published schema."""

    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []

    @extend_schema(operation_id="definition_schema", responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        response = Response(load_schema())
        response["Content-Type"] = "application/schema+json"
        return response


# --- recipes (CONTRACT section 10) -------------------------------------------------------------
#
# Who may: workflows.access, "recipes". Reading needs workflows.view_recipe, add_recipe or
# change_recipe (else the list is 403 and an item 404); saving a new name add_recipe, a new
# version of an existing name change_recipe.


class RecipePagination(ContractCursorPagination):
    ordering = "name"


class RecipeListView(APIView):
    pagination_class = RecipePagination

    @extend_schema(
        operation_id="recipes_list",
        description="The newest version of every recipe, by name. Needs workflows.view_recipe,"
        " add_recipe or change_recipe.",
        parameters=[*RecipePagination.schema_parameters()],
        responses={200: RecipeSummarySerializer(many=True), 400: ERRORS, 401: ERRORS, 403: ERRORS},
    )
    def get(self, request: Request) -> Response:
        access.require_read_recipes(request.user)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(selectors.recipe_list(), request, view=self)
        data = RecipeSummarySerializer(page, many=True).data
        return paginator.get_paginated_response(data)

    @extend_schema(
        operation_id="recipes_save",
        request={"application/json": recipes.BODY_SCHEMA},
        description=(
            "Save a recipe {name, version?, description?, system?, prompt, model?, output?,"
            " output_schema?, temperature?, max_tokens?}. The same body again answers 200 with"
            " the existing version; a different body for an existing version is 409; an omitted"
            " version gets the next number (201). A new name needs workflows.add_recipe, a new"
            " version of an existing one workflows.change_recipe."
        ),
        responses={
            201: SavedRecipeSerializer,
            200: SavedRecipeSerializer,
            400: ERRORS,
            401: ERRORS,
            403: ERRORS,
            409: ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        recipe, created = services.recipe_save(document=request.data, user=request.user)
        body = SavedRecipeSerializer({"recipe": recipe, "created": created}).data
        return Response(body, status=status.HTTP_201_CREATED if created else 200)


class RecipeDetailView(APIView):
    @extend_schema(
        operation_id="recipes_read",
        description=(
            f"The newest version of the recipe, with the newest {SHOWN_RECIPE_VERSIONS}"
            " version numbers (versions) and how many there are (versions_total); any version"
            " is read by number."
        ),
        responses={200: RecipeDetailSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, name: str) -> Response:
        access.require_recipe(request.user, name)
        recipe = selectors.recipe_get(name=name)
        versions = selectors.recipe_versions(name=name)
        return Response(RecipeDetailSerializer(recipe, context={"versions": versions}).data)


class RecipeVersionView(APIView):
    @extend_schema(
        operation_id="recipes_version_read",
        parameters=[OpenApiParameter("version", int, OpenApiParameter.PATH)],
        responses={200: RecipeSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, name: str, version: str) -> Response:
        access.require_recipe(request.user, name)
        found = selectors.recipe_get(name=name, version=_version_number(version))
        return Response(RecipeSerializer(found).data)


# --- knowledge bases (CONTRACT section 10) -----------------------------------------------------
#
# Who may: workflows.access, "knowledge bases". The list holds the ones the caller may read; a
# knowledge base they may not read is a 404, as one that does not exist.

KB_PATH = OpenApiParameter(
    "kb", OpenApiTypes.STR, OpenApiParameter.PATH, description="the knowledge base's name"
)
DEFAULT_SEARCH_LIMIT = 10


class KnowledgeBasePagination(ContractCursorPagination):
    ordering = "name"


class KnowledgeBaseListView(APIView):
    pagination_class = KnowledgeBasePagination

    @extend_schema(
        operation_id="kbs_list",
        description="The knowledge bases the caller may read, by name, cursor-paginated.",
        parameters=[*KnowledgeBasePagination.schema_parameters()],
        responses={200: KnowledgeBaseSerializer(many=True), 400: ERRORS, 401: ERRORS},
    )
    def get(self, request: Request) -> Response:
        kbs = access.readable_kbs(request.user, selectors.kb_list())
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(kbs, request, view=self)
        return paginator.get_paginated_response(KnowledgeBaseSerializer(page, many=True).data)


class KnowledgeDocumentListView(APIView):
    pagination_class = NewestFirstPagination

    @extend_schema(
        operation_id="kbs_documents",
        description=(
            "Without `q`: the current version of each document, newest first, cursor-paginated;"
            " with `key`: every version of that document, newest first. With `q`: the best"
            f" `limit` (default {DEFAULT_SEARCH_LIMIT}; at most {MAX_TOP_K} are answered)"
            " current documents, best first, each with its `score` (`next` is null). Postgres"
            " full-text search, or SQLite FTS5 on the embedded default."
        ),
        parameters=[
            KB_PATH,
            KnowledgeDocumentQuerySerializer,
            *NewestFirstPagination.schema_parameters(),
        ],
        responses={
            200: KnowledgeDocumentSerializer(many=True),
            400: ERRORS,
            401: ERRORS,
            404: ERRORS,
        },
    )
    def get(self, request: Request, kb: str) -> Response:
        found = access.require_kb(request.user, kb)
        for name in ("q", "key"):
            # DRF reads an empty optional parameter as absent; a search for nothing is a mistake.
            if name in request.query_params and not request.query_params[name].strip():
                raise InvalidInput(errors=[FieldError(name, "must not be empty")])
        query = KnowledgeDocumentQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        if "q" in query.validated_data:
            return self._search(request, found, query.validated_data["q"])
        documents = selectors.kb_documents(kb=found, key=query.validated_data.get("key"))
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(documents, request, view=self)
        return paginator.get_paginated_response(KnowledgeDocumentSerializer(page, many=True).data)

    def _search(self, request: Request, kb: KnowledgeBase, q: str) -> Response:
        if "cursor" in request.query_params:
            raise InvalidInput(
                errors=[FieldError("cursor", "a search (q) answers one page: it takes no cursor")]
            )
        limit = _search_limit(request)
        hits = kb_search.search(kb, q, limit)
        rows = selectors.kb_documents(kb=kb).in_bulk([hit.id for hit in hits])
        scores = {hit.id: hit.score for hit in hits}
        documents = [rows[hit.id] for hit in hits if hit.id in rows]
        data = KnowledgeDocumentSerializer(documents, many=True, context={"scores": scores}).data
        return Response({"results": data, "next": None})


def _search_limit(request: Request) -> int:
    """The best ``limit`` a search answers, at most ``MAX_TOP_K``: ``limit`` has the bounds
    of the list's (1 to 500, as the OpenAPI document states it for both), and a search
    asked for more answers its best ``MAX_TOP_K``, never a 400 for a page size the list
    takes."""
    if request.query_params.get("limit") is None:
        return DEFAULT_SEARCH_LIMIT
    return min(NewestFirstPagination().get_page_size(request), MAX_TOP_K)


def _digits(text: str, *, most: int) -> int | None:
    """``text`` as a whole number of ASCII digits at most ``most``, else None. ASCII only:
    str.isdigit() accepts '¹', which int() refuses; and no more digits than ``most`` has, since
    int() refuses over 4,300 of them (a ValueError, a 500) and reading them is work."""
    if not text.isascii() or not text.isdigit() or len(text) > len(str(most)):
        return None
    number = int(text)
    return number if number <= most else None


def _version_number(text: str) -> int:
    number = _digits(text, most=2_147_483_647)
    if number is None or number == 0:
        raise NotFound(
            errors=[FieldError("version", f"'{echo(text)}' is not a version number (1, 2, ...)")]
        )
    return number
