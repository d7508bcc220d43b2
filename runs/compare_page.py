"""The inspector's compare page (CONTRACT section 16): two runs step by step at
``/runs/<a>/compare/<b>/`` (outputs, prompts, replies, cost), read by ``runs.compare``.

Whoever may read both runs sees it; a run they may not read is a 404 naming nothing of it,
as the inspector answers (the same page, the same status). Read only, no script: the
prompts and replies fold in ``<details>``, and the inspector's "Compare with…" form is a
plain GET to :func:`pick`, which sends the browser on here.
"""

from __future__ import annotations

import uuid

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods

from workflows.errors import FieldError, NotFound, echo

from . import compare, selectors
from .pages import problem


@login_required
@require_http_methods(["GET", "HEAD"])
def compare_runs(request: HttpRequest, run_id: uuid.UUID, other_id: uuid.UUID) -> HttpResponse:
    try:
        a = selectors.run_readable(run_id=run_id, user=request.user)
        b = selectors.run_readable(run_id=other_id, user=request.user)
        comparison = compare.compare(a, b, user=request.user)
    except NotFound as error:
        return problem(request, error)
    response = render(
        request, "runs/compare.html", {"cmp": comparison, "text_calls": compare.CALLS_WITH_TEXT}
    )
    # Either run may still move; a shared cache must not keep the page.
    add_never_cache_headers(response)
    return response


@login_required
@require_http_methods(["GET", "HEAD"])
def pick(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    """The inspector's "Compare with…" form: ``?with=<run id>`` to the compare page. Who may
    read which run is the compare page's to say, so an unreadable id answers as an unknown
    one does."""
    other = request.GET.get("with", "").strip()
    try:
        other_id = uuid.UUID(other)
    except ValueError:
        error = NotFound(errors=[FieldError("with", f"'{echo(other)}' is not a run id")])
        return problem(request, error)
    return redirect("runs:compare", run_id=run_id, other_id=other_id)
