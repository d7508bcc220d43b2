"""Pages people click about runs: the runs list and the run inspector (``app_name`` runs:
``runs:list``, ``runs:inspect``, and the inspector's actions). The API's routes are in
``runs/urls.py``."""

from django.urls import path

from . import pages, run_list_page

app_name = "runs"

urlpatterns = [
    path("runs/", run_list_page.run_list_page, name="list"),
    path("runs/<uuid:run_id>/", pages.inspect, name="inspect"),
    # Before the generic action route, which would take "retry-from-step" as an action.
    path("runs/<uuid:run_id>/retry-from-step/", pages.rerun, name="rerun"),
    path("runs/<uuid:run_id>/<slug:action>/", pages.act, name="act"),
]
