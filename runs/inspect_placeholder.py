"""A stand-in for the run inspector (``runs:inspect``, ``/runs/<id>/``) until the inspector's
own page is merged (branch wt-inspector, ``runs/pages.py``), which replaces this module and
its route in ``runs/page_urls.py``. It exists so that the runs list, the admin and the API's
``inspect_url`` have their target: the run's id, workflow and status for whoever may read
it, 404 for anyone else (the one permission model, as every page)."""

from __future__ import annotations

import uuid

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from workflows.errors import NotFound

from . import selectors


@login_required
@require_http_methods(["GET", "HEAD"])
def inspect(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    try:
        run = selectors.run_get(run_id=run_id, user=request.user)
    except NotFound:
        raise Http404("no such run") from None
    return render(request, "runs/inspect_placeholder.html", {"run": run})
