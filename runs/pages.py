"""The run inspector (CONTRACT section 11, the run's ``inspect_url``): one run's graph,
timeline, attempts and audit for whoever may read it, its actions for whoever may operate it.

Server-rendered; while the run is live the page asks every few seconds for its ``live`` part
(``?part=live``) and swaps it in (``runs/static/runs/inspect.js``), and stops once the run has
ended. Reads go through ``runs.inspection`` (bounded whatever the run's size), writes through
``runs.services`` (which check the operator's role and record who acted), so a viewer who forges
the POST is refused (403) as the API would refuse them, and a stranger gets 404.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST

from workflows.errors import EngineError, FieldError, NotFound

from . import inspection, services

ACTIONS: dict[str, Callable[..., Any]] = {
    "cancel": services.run_cancel,
    "pause": services.run_pause,
    "resume": services.run_resume,
    "retry": services.run_retry,
}
# Seconds between two looks at a live run.
REFRESH_SECONDS = 2


def problem(request: HttpRequest, error: EngineError) -> HttpResponse:
    """A refusal as a page with its status (404 names nothing of the run)."""
    titles = {404: "No such run", 403: "You may not do that", 409: "Not possible now"}
    context = {
        "title": titles.get(error.status, "Not done"),
        "sentence": "; ".join(e.message for e in error.errors),
    }
    response = render(request, "problem.html", context, status=error.status)
    add_never_cache_headers(response)
    return response


@login_required
@require_http_methods(["GET", "HEAD"])
def inspect(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    try:
        run = inspection.run_for_page(run_id=run_id, user=request.user)
    except NotFound as error:
        return problem(request, error)
    context = {"page": inspection.page(run, request.user), "refresh": REFRESH_SECONDS}
    template = "runs/_live.html" if request.GET.get("part") == "live" else "runs/inspect.html"
    response = render(request, template, context)
    # A run's page is always read afresh (its status moves); a shared cache must not keep it.
    add_never_cache_headers(response)
    return response


@login_required
@require_POST
def act(request: HttpRequest, run_id: uuid.UUID, action: str) -> HttpResponse:
    service = ACTIONS.get(action)
    if service is None:
        error = NotFound(errors=[FieldError("action", f"unknown action '{action}'")])
        return problem(request, error)
    try:
        service(run_id=run_id, user=request.user)
    except EngineError as error:
        return problem(request, error)
    messages.success(request, f"Run {action} recorded.")
    return redirect("runs:inspect", run_id=run_id)
