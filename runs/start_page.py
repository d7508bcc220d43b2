"""``/workflows/<id>/start``: the page a person starts a run from (CONTRACT section 15).

A form made from the version's ``input_schema`` (``workflows.input_form``: the latest version,
or ``?version=N``); sent, it starts the run through ``runs.services.run_start``, the service
``POST /api/v1/runs`` calls, so the input schema, the pre-flight, the limits, the secrets and
the permission checks are the API's own. A refusal shows the form again, 400, with what was
typed (secrets aside) and each problem beside its field; a start goes to the run's inspector.
``?from=<run id>`` prefills the form with that run's input ("Run again" on the inspector).

Who: starters of the workflow (``access.require_start``): 404 for a workflow the user may not
see, 403 for one they may see but not start, as the API answers.

Above the form, the forecast of CONTRACT section 17 (``runs.forecasts``, as
``POST /api/v1/runs/forecast`` answers without an input): steps and cost, min to max.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods

from workflows import access, selectors
from workflows.errors import EngineError, FieldError, InvalidInput, NotFound, echo
from workflows.input_form import OMITTED, START_KEY, StartForm
from workflows.models import WorkflowVersion
from workflows.preflight import start_problems

from . import forecasts, inspection, services
from .models import Run
from .pages import problem

# A version number as the query string may give it (the column holds up to 2,147,483,647).
VERSION = re.compile(r"[1-9][0-9]{0,9}")
KEY = re.compile(r"[0-9a-f]{32}")


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def start(request: HttpRequest, workflow_id: str) -> HttpResponse:
    try:
        # Before anything else is read: one who may not start learns nothing of the versions.
        access.require_start(request.user, workflow_id)
        version = _version(request, workflow_id)
        source = _source(request, version) if request.method != "POST" else None
    except EngineError as error:
        # ?from= names a run: its refusal is a run's (inspection.run_for_page names "id").
        about_run = any(e.field in ("id", "from") for e in error.errors)
        return problem(request, error, subject="run" if about_run else "workflow")
    schema = version.document.get("input_schema")
    if request.method != "POST":
        form = StartForm(schema, input=source.input if source else OMITTED)
        return _page(request, version, form, key=uuid.uuid4().hex, source=source)
    form = StartForm(schema, request.POST)
    sent = request.POST.get(START_KEY, "")
    key = sent if KEY.fullmatch(sent) else None
    if not form.is_valid():
        # What did not parse stays unsent; the schema's and the pre-flight's word on the
        # rest is shown with it, every problem at once, as the API answers.
        form.refused(start_problems(version, form.input()))
        return _page(request, version, form, key=key or uuid.uuid4().hex, status=400)
    try:
        result = services.run_start(
            workflow=workflow_id,
            version=version.number,
            input=form.input(),
            idempotency_key=key,
            user=request.user,
            plan_now=services.inline_starts.take(),
        )
    except InvalidInput as error:
        form.refused(error.errors)
        return _page(request, version, form, key=key or uuid.uuid4().hex, status=error.status)
    except EngineError as error:
        return problem(request, error, subject="workflow")
    if result.created:
        messages.success(request, f"Run started (version {version.number}).")
    else:
        messages.info(request, "This form had already started this run; it was not started again.")
    return redirect("runs:inspect", run_id=result.run.id)


def _version(request: HttpRequest, workflow_id: str) -> WorkflowVersion:
    """The version the form is for: ``?version=N``, or the latest; 404 naming it."""
    pinned = request.GET.get("version")
    if pinned is None:
        return selectors.version_get(workflow_id=workflow_id)
    if not VERSION.fullmatch(pinned) or int(pinned) > 2_147_483_647:
        message = f"workflow '{workflow_id}' has no version '{echo(pinned)}'"
        raise NotFound(errors=[FieldError("version", message)])
    return selectors.version_get(workflow_id=workflow_id, number=int(pinned))


def _source(request: HttpRequest, version: WorkflowVersion) -> Run | None:
    """The run whose input prefills the form (``?from=``): one the user may read, of this
    workflow; 404 otherwise, as its inspector answers."""
    run_id = request.GET.get("from")
    if run_id is None:
        return None
    # One answer for a run that does not exist, one the user may not read and one of another
    # workflow: the same text, as the user typed it, so it tells nothing of which (a
    # normalised id said the run existed; security review).
    unknown = NotFound(errors=[FieldError("from", f"unknown run '{echo(run_id)}'")])
    try:
        run = inspection.run_for_page(run_id=run_id, user=request.user)
    except NotFound:
        raise unknown from None
    if run.workflow_id != version.workflow_id:
        raise unknown
    return run


def _page(
    request: HttpRequest,
    version: WorkflowVersion,
    form: StartForm,
    *,
    key: str,
    source: Run | None = None,
    status: int = 200,
) -> HttpResponse:
    latest = selectors.version_get(workflow_id=version.workflow_id)
    pinned = request.GET.get("version") is not None
    action = reverse("runs:start", kwargs={"workflow_id": version.workflow_id})
    context: dict[str, Any] = {
        "version": version,
        "latest": latest,
        "form": form,
        "action": f"{action}?version={version.number}" if pinned else action,
        "start_key": key,
        "start_key_name": START_KEY,
        "source": source,
        "secrets": any(getattr(f, "secret", False) for f in form.fields.values()),
        "forecast": forecasts.version_forecast(version).as_json(),
    }
    response = render(request, "runs/start.html", context, status=status)
    # A fresh start key each time the form is shown: a page kept by a cache would hand one
    # key to two starts, and the second would answer the first's run.
    add_never_cache_headers(response)
    return response
