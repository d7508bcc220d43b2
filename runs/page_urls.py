"""Pages people click about runs: the runs list, the run inspector (``app_name`` runs:
``runs:list``, ``runs:inspect``, and the inspector's actions), the comparison of two runs
(``runs:compare``) and the start form (``runs:start``). The API's routes are in
``runs/urls.py``."""

from django.urls import path, re_path

from . import compare_page, pages, run_list_page, start_page

app_name = "runs"

urlpatterns = [
    path("runs/", run_list_page.run_list_page, name="list"),
    path("runs/<uuid:run_id>/", pages.inspect, name="inspect"),
    # Before the generic action route, which would take "retry-from-step" (or "compare") as
    # an action.
    path("runs/<uuid:run_id>/retry-from-step/", pages.rerun, name="rerun"),
    path("runs/<uuid:run_id>/top-up/", pages.top_up, name="top-up"),
    path("runs/<uuid:run_id>/compare/", compare_page.pick, name="compare-pick"),
    path(
        "runs/<uuid:run_id>/compare/<uuid:other_id>/",
        compare_page.compare_runs,
        name="compare",
    ),
    path("runs/<uuid:run_id>/<slug:action>/", pages.act, name="act"),
    # The path of CONTRACT section 15, without a trailing slash; only a workflow id's own
    # characters (workflows.models.ID_PATTERN, 100 at most) reach the view.
    re_path(
        r"^workflows/(?P<workflow_id>[a-z][a-z0-9_]{0,99})/start\Z", start_page.start, name="start"
    ),
]
