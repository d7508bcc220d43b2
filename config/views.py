"""Project-wide views: the home page, and JSON 404/500 for the API whatever the URL."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views import defaults
from django.views.decorators.http import require_http_methods

from approvals.selectors import inbox_for
from runs.selectors import run_list
from workflows import access
from workflows.selectors import workflow_list


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"errors": [{"message": "not found"}]}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"errors": [{"message": "internal server error"}]}, status=500)
    return defaults.server_error(request)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        if isinstance(exception, RequestDataTooBig):
            limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            message = f"is larger than {limit} bytes (DJFLOW_MAX_BODY_BYTES)"
            return JsonResponse({"errors": [{"field": "body", "message": message}]}, status=413)
        return JsonResponse({"errors": [{"message": "bad request"}]}, status=400)
    return defaults.bad_request(request, exception)


HOME_RUNS = 20
# The workflows listed with their start links (by id); the admin lists them all.
HOME_WORKFLOWS = 50


@login_required
@require_http_methods(["GET", "HEAD"])
def home(request: HttpRequest) -> HttpResponse:
    """``/``: where a signed-in person starts. What waits for their decision, the workflows
    they may start with their start pages (CONTRACT section 15), the newest runs they may see
    (workflows.access: the runs of workflows they view or operate, and those they started),
    and the way to the admin and the API docs. Anonymous visitors are sent to the sign-in
    page."""
    user = request.user
    pending, _ = inbox_for(user, history_limit=0)
    sees_all = access.run_filter(user) is None
    runs = run_list(user=user)
    startable = access.startable_workflows(user, workflow_list().order_by("id"))
    context = {
        "pending": pending,
        "startable": list(startable[: HOME_WORKFLOWS + 1]),
        "startable_shown": HOME_WORKFLOWS,
        "runs": list(runs[:HOME_RUNS]),
        "sees_all_runs": sees_all,
        "runs_in_admin": user.is_staff and access.has_any_role(user),
    }
    return render(request, "home.html", context)
