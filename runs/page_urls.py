"""Pages of runs people open in a browser (not the API): the run inspector. The runs list
joins them here."""

from django.urls import path

from . import pages

app_name = "runs"

urlpatterns = [
    path("runs/<uuid:run_id>/", pages.inspect, name="inspect"),
    path("runs/<uuid:run_id>/retry-from-step/", pages.rerun, name="rerun"),
    path("runs/<uuid:run_id>/<slug:action>/", pages.act, name="act"),
]
