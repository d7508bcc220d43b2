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
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST

from workflows import access, secrets
from workflows.errors import EngineError, FieldError, InvalidInput, NotFound
from workflows.json_limits import MAX_JSON_DEPTH, json_depth, loads_numbers_only, text_problems

from . import inspection, services
from .models import Run

ACTIONS: dict[str, Callable[..., Any]] = {
    "cancel": services.run_cancel,
    "pause": services.run_pause,
    "resume": services.run_resume,
    "retry": services.run_retry,
}
# Seconds between two looks at a live run; a run past BUSY_ATTEMPTS attempts is looked at
# less often (its live part is some 370 kB and 0.13 s of a web process at 10,000 attempts).
REFRESH_SECONDS = 2
BUSY_REFRESH_SECONDS = 10
BUSY_ATTEMPTS = 1_000


def problem(request: HttpRequest, error: EngineError, *, subject: str = "run") -> HttpResponse:
    """A refusal as a page with its status (404 names nothing of the run or workflow)."""
    titles = {404: f"No such {subject}", 403: "You may not do that", 409: "Not possible now"}
    context = {
        "title": titles.get(error.status, "Not done"),
        "sentence": "; ".join(e.message for e in error.errors),
    }
    response = render(request, "problem.html", context, status=error.status)
    add_never_cache_headers(response)
    return response


@dataclass
class Rerun:
    """The retry form as it was sent: what to show in it again, its errors, the dry run's
    answer."""

    from_step: str = ""
    input: str | None = None
    errors: list[FieldError] = field(default_factory=list)
    preview: services.RetryPreview | None = None

    @property
    def input_changes(self) -> list[tuple[str, str, str]]:
        """The dry run's input changes as (field, before, after), values as JSON."""
        changes = self.preview.input_changes if self.preview else []
        return [(c["field"], _json(c["before"]), _json(c["after"])) for c in changes]

    @property
    def step_inputs(self) -> list[tuple[str, str, str]]:
        """The dry run's first steps as (path and step id, input before, input after)."""
        changes = self.preview.step_inputs if self.preview else []
        return [
            (f"{c.get('path', '')}{c['step']}", _json(c["before"]), _json(c["after"]))
            for c in changes
        ]


def _json(value: Any) -> str:
    return inspection.show(value, 2_000).text or "null"


def _page(
    request: HttpRequest, run: Run, *, rerun: Rerun | None = None, status: int = 200
) -> HttpResponse:
    page = inspection.page(run, request.user)
    if rerun is not None and rerun.input is None:
        rerun.input = page.rerun_input
    context = {
        "page": page,
        "refresh": BUSY_REFRESH_SECONDS if page.total_attempts > BUSY_ATTEMPTS else REFRESH_SECONDS,
        "rerun": rerun or Rerun(input=page.rerun_input),
    }
    template = "runs/_live.html" if request.GET.get("part") == "live" else "runs/inspect.html"
    response = render(request, template, context, status=status)
    # A run's page is always read afresh (its status moves); a shared cache must not keep it.
    add_never_cache_headers(response)
    return response


@login_required
@require_http_methods(["GET", "HEAD"])
def inspect(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    try:
        run = inspection.run_for_page(run_id=run_id, user=request.user)
    except NotFound as error:
        return problem(request, error)
    return _page(request, run)


@login_required
@require_POST
def top_up(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    """Raise a budget_exceeded run's limit (``run_budget_add``, CONTRACT section 17): the
    step that waits goes on, or waits again if the top-up is still too small."""
    try:
        run = inspection.run_for_page(run_id=run_id, user=request.user)
        # Before reading the form: one who may not act learns nothing from a malformed one.
        access.require_operate_run(request.user, run)
        amount = _amount(request.POST.get("add_usd", ""))
        services.run_budget_add(run_id=run.id, add_usd=amount, user=request.user)
    except EngineError as error:
        return problem(request, error)
    messages.success(request, f"Run's budget raised by ${amount}.")
    return redirect("runs:inspect", run_id=run.id)


def _amount(text: str) -> Decimal:
    """The form's ``add_usd``: a positive amount of USD, as the API takes it."""
    try:
        amount = Decimal(text.strip())
    except (InvalidOperation, ValueError):
        amount = Decimal(-1)
    if not amount.is_finite() or not Decimal("0.000001") <= amount <= Decimal(1_000_000):
        raise InvalidInput(
            errors=[FieldError("add_usd", "must be an amount of USD from 0.000001 to 1000000")]
        )
    return amount.quantize(Decimal("0.000001"))


@login_required
@require_POST
def rerun(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    """Retry from a step with an edited input (``run_retry``), or its dry run: the page again
    with what the retry would do. The input box holds the run's input with secrets masked; a
    secret left masked keeps its value, and an input left as it was is no edit at all."""
    try:
        run = inspection.run_for_page(run_id=run_id, user=request.user)
        # Before reading the form: one who may not act learns nothing from a malformed one.
        access.require_operate_run(request.user, run)
    except EngineError as error:
        return problem(request, error)
    form = Rerun(from_step=request.POST.get("from_step", ""), input=request.POST.get("input", ""))
    # The form's two buttons say which; anything else (a script's POST without it) retries
    # nothing: a retry is never what a request gets by leaving a field out.
    mode = request.POST.get("mode")
    dry_run = mode == "preview"
    try:
        if mode not in ("preview", "retry"):
            raise InvalidInput(errors=[FieldError("mode", "must be 'preview' or 'retry'")])
        edited = _edited(run, form.input or "")
        answer = services.run_retry(
            run_id=run.id,
            user=request.user,
            from_step=form.from_step or None,
            input=edited,
            dry_run=dry_run,
        )
    except InvalidInput as error:
        # The form again, with what was typed and each field's problem.
        form.errors = error.errors
        return _page(request, run, rerun=form, status=error.status)
    except EngineError as error:
        return problem(request, error)
    if isinstance(answer, services.RetryPreview):
        form.preview = answer
        return _page(request, run, rerun=form)
    where = f" from {form.from_step}" if form.from_step else ""
    messages.success(request, f"Run retried{where} (generation {answer.generation}).")
    return redirect("runs:inspect", run_id=run.id)


def _edited(run: Run, text: str) -> Any:
    """The input the form sent, or None when it is the run's own (no edit): JSON, or a 400
    naming ``input`` (or the place in it). What the API refuses (``config.parsers``, its JSON
    field: NaN, Infinity and numbers past a float's range, nesting past ``MAX_JSON_DEPTH``,
    ``\\u0000`` or a lone surrogate) is refused here too: it would otherwise be a
    RecursionError, a page that cannot be encoded or a row Postgres refuses, a 500."""
    if not text.strip():
        return None
    too_deep = FieldError("input", f"is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        given = loads_numbers_only(text)
    except RecursionError:
        raise InvalidInput(errors=[too_deep]) from None
    except ValueError as error:
        raise InvalidInput(errors=[FieldError("input", f"is not JSON: {error}")]) from None
    if json_depth(given) > MAX_JSON_DEPTH:
        raise InvalidInput(errors=[too_deep])
    problems = text_problems({"input": given})
    if problems:
        raise InvalidInput(errors=problems)
    return None if given == secrets.shown(run.input) else given


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
