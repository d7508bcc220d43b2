"""Pages people click about runs: the runs list and the run inspector (``app_name`` runs:
``runs:list``, ``runs:inspect``). The API's routes are in ``runs/urls.py``."""

from django.urls import path

from . import inspect_placeholder, run_list_page

app_name = "runs"

urlpatterns = [
    path("runs/", run_list_page.run_list_page, name="list"),
    path("runs/<uuid:run_id>/", inspect_placeholder.inspect, name="inspect"),
]
