"""``/runs/``: the runs a signed-in person may see, newest first, filtered and searched.

The page answers to the one permission model (``selectors.run_list(user=...)`` narrows to the
runs the user may read, whatever the filters say): a run of someone else's is not listed, and
not found by searching its id, correlation or idempotency key either. A page is one bounded
read: the user's permissions, one page of runs (``config.pagination``, the API's cursor), and
the workflow names offered in the filter. Bad filter values are named on the page with a 400,
never a 500; nothing here writes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlparse

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from rest_framework.request import Request

from config.pagination import NewestFirstPagination
from workflows import access
from workflows.errors import EngineError
from workflows.models import Workflow

from . import selectors
from .models import Run
from .status import RunStatus

# The most workflow names the filter offers to pick from (typing any other still works).
WORKFLOW_CHOICES = 200

SEARCH_CHOICES = [
    (selectors.SEARCH_ANY, "id, correlation or key"),
    (selectors.SEARCH_ID, "run id"),
    (selectors.SEARCH_CORRELATION, "correlation"),
    (selectors.SEARCH_IDEMPOTENCY_KEY, "idempotency key"),
]
WHEN_FORMAT = "YYYY-MM-DD or YYYY-MM-DDTHH:MM[:SS], in UTC unless an offset is given"


class _When(forms.DateTimeField):
    # The browser's datetime-local control reads and writes this form (seconds included, so
    # a bound value shown again keeps them).
    widget = forms.DateTimeInput(attrs={"type": "datetime-local", "step": "1"})
    default_error_messages = {"invalid": f"Enter a date and time: {WHEN_FORMAT}."}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, **kwargs)
        self.widget.format = "%Y-%m-%dT%H:%M:%S"

    def to_python(self, value: Any) -> datetime | None:
        when = super().to_python(value)
        if when is None:
            return None
        try:
            # The same instant in UTC: Python reads offsets up to ±23:59, Postgres refuses
            # those past ±15:59 (a 500). Past the calendar's ends in UTC, it is no date.
            return when.astimezone(UTC)
        except OverflowError:
            raise forms.ValidationError(self.error_messages["invalid"], code="invalid") from None


class _Cost(forms.DecimalField):
    widget = forms.NumberInput(attrs={"min": "0", "step": "any", "inputmode": "decimal"})

    def __init__(self, **kwargs: Any) -> None:
        # The bounds of the column (runs.models.Run.cost_usd): a longer number is no cost.
        super().__init__(
            required=False, min_value=Decimal(0), max_digits=14, decimal_places=6, **kwargs
        )


class RunListFilters(forms.Form):
    """The query string of ``/runs/``. Every field is optional and bounded; ``cursor`` and
    ``limit`` are the paginator's and checked by it."""

    q = forms.CharField(
        required=False, max_length=255, label="Search", widget=forms.TextInput({"type": "search"})
    )
    search_in = forms.ChoiceField(required=False, choices=SEARCH_CHOICES, label="Search in")
    workflow = forms.CharField(required=False, max_length=100)
    status = forms.ChoiceField(required=False, choices=[("", "any"), *RunStatus.choices])
    account = forms.CharField(required=False, max_length=150)
    created_after = _When(label="Created from")
    created_before = _When(label="Created before")
    cost_min = _Cost(label="Cost from (USD)")
    cost_max = _Cost(label="Cost to (USD)")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        after, before = data.get("created_after"), data.get("created_before")
        if after is not None and before is not None and after >= before:
            self.add_error("created_before", "Must be later than “Created from”.")
        low, high = data.get("cost_min"), data.get("cost_max")
        if low is not None and high is not None and low > high:
            self.add_error("cost_max", "Must not be less than “Cost from”.")
        text = data.get("q") or ""
        if data.get("search_in") == selectors.SEARCH_ID and text:
            try:
                uuid.UUID(text)
            except ValueError:
                self.add_error(
                    "q", "A run id is a whole UUID, like 0b7c25f2-8f9e-4a0e-9f3e-5d1f0c2a9b41."
                )
        return data

    def run_list_filters(self) -> dict[str, Any]:
        """The cleaned values as ``selectors.run_list`` keywords; blank fields filter nothing."""
        data = self.cleaned_data
        chosen = {
            "workflow": data["workflow"] or None,
            "status": data["status"] or None,
            "account": data["account"] or None,
            "created_after": data["created_after"],
            "created_before": data["created_before"],
            "cost_min": data["cost_min"],
            "cost_max": data["cost_max"],
            "search": data["q"] or None,
        }
        return {**chosen, "search_in": data["search_in"] or selectors.SEARCH_ANY}


class RunPagePagination(NewestFirstPagination):
    """The API's cursor (``GET /api/v1/runs``): a page's ``?cursor=`` works in both."""


@dataclass(frozen=True)
class RunRow:
    run: Run
    duration: str


@login_required
@require_http_methods(["GET", "HEAD"])
def run_list_page(request: HttpRequest) -> HttpResponse:
    form = RunListFilters(request.GET)
    context: dict[str, Any] = {
        "form": form,
        "rows": [],
        "problems": [],
        "next_page": None,
        "previous_page": None,
        "filtered": any(request.GET.get(name) for name in RunListFilters.base_fields),
        "workflows": _workflow_names(request.user),
    }
    if not form.is_valid():
        context["problems"] = [
            f"{form.fields[name].label or name.capitalize()}: {message}"
            if name in form.fields
            else message
            for name, messages in form.errors.items()
            for message in messages
        ]
        return render(request, "runs/list.html", context, status=400)
    runs = selectors.run_list(**form.run_list_filters(), user=request.user)
    paginator = RunPagePagination()
    try:
        page = paginator.paginate_queryset(runs, Request(request))
    except EngineError as error:
        # A cursor this site did not give out, or a bad ?limit=.
        context["problems"] = [f"{e.field or 'Page'}: {e.message}" for e in error.errors]
        return render(request, "runs/list.html", context, status=error.status)
    context["rows"] = [RunRow(run, _duration(run)) for run in page or []]
    context["next_page"] = _relative(request, paginator.get_next_link())
    context["previous_page"] = _relative(request, paginator.get_previous_link())
    return render(request, "runs/list.html", context)


def _workflow_names(user: Any) -> list[str]:
    """The workflows offered in the filter: those whose definition the user may see."""
    workflows = access.visible_workflows(user, Workflow.objects.order_by("id"))
    return list(workflows.values_list("id", flat=True)[:WORKFLOW_CHOICES])


def _relative(request: HttpRequest, link: str | None) -> str | None:
    """The paginator's absolute link as a link to this page (DRF keeps the other filters)."""
    if link is None:
        return None
    query = urlparse(link).query
    return f"{request.path}?{query}" if query else request.path


def _duration(run: Run) -> str:
    """How long the run has taken (so far, while it is live): 850 ms, 12.4 s, 3 min 20 s,
    2 h 5 min, 3 d 4 h."""
    if run.started_at is None:
        return "—"
    end = run.finished_at or timezone.now()
    return _span(max(end - run.started_at, timedelta(0)))


def _span(elapsed: timedelta) -> str:
    seconds = elapsed.total_seconds()
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s"
