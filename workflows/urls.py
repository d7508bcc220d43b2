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
]
