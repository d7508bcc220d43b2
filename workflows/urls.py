from django.urls import path

from . import views

urlpatterns = [
    path("definitions", views.DefinitionListView.as_view(), name="definitions"),
    path(
        "definitions/<str:workflow_id>",
        views.DefinitionDetailView.as_view(),
        name="definition",
    ),
    path(
        "definitions/<str:workflow_id>/versions/<str:version>",
        views.DefinitionVersionView.as_view(),
        name="definition-version",
    ),
    path(
        "definition.schema.json",
        views.DefinitionSchemaView.as_view(),
        name="definition-schema",
    ),
    path("kbs", views.KnowledgeBaseListView.as_view(), name="kbs"),
    path("kbs/<str:kb>/documents", views.KnowledgeDocumentListView.as_view(), name="kb-documents"),
    path("recipes", views.RecipeListView.as_view(), name="recipes"),
    path("recipes/<str:name>", views.RecipeDetailView.as_view(), name="recipe"),
    path(
        "recipes/<str:name>/versions/<str:version>",
        views.RecipeVersionView.as_view(),
        name="recipe-version",
    ),
]
