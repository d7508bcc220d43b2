"""The forecast of a run before it starts (contract section 17): ``workflows.forecast`` (pure)
given what only the database and the deployment know: the recipes a document names, the
documents of its subworkflows, the prices, and the workflow's history.

Prices and the token estimate are the workers' (``workers.pricing``, genai-prices and
``DJFLOW_PRICES``; ``workers.providers.estimate_input_tokens``): ``workers`` plugs them in
from its ``AppConfig.ready()`` (:func:`use_pricing`), as it plugs in its step kinds, so this
layer never imports the one above it. Without them (an app list without ``workers``) a
forecast counts steps only and says that its costs are unknown.

The history is bounded: the workflow's last :data:`HISTORY_RUNS` completed runs, read in two
queries (their own and their body runs' step costs per step id; their subworkflow children's
cost per subworkflow step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db.models import Case, F, Q, Sum, When

from workflows import access, recipes
from workflows.errors import InvalidDocument
from workflows.forecast import Forecast, Price, Sources, Tokens, forecast
from workflows.models import Recipe, WorkflowVersion
from workflows.selectors import version_get

from .models import Run, StepRun
from .status import RunStatus

# How many of the workflow's last completed runs ``expected`` is the median of.
HISTORY_RUNS = 20


@dataclass(frozen=True)
class Pricing:
    price: Price
    tokens: Tokens
    default_model: Callable[[], str | None]


_pricing: Pricing | None = None


def use_pricing(pricing: Pricing | None) -> None:
    """What prices calls and estimates prompts (``workers.apps``; None forgets it)."""
    global _pricing
    _pricing = pricing


def run_forecast(
    *, workflow: str, version: int | None = None, input: Any = None, input_given: bool, user: Any
) -> Forecast:
    """``POST /runs/forecast``: who may start runs of the workflow may ask (404 when it is
    not theirs to see, 403 when they may not start it, as ``POST /runs``)."""
    access.require_start(user, workflow)
    pinned = version_get(workflow_id=workflow, number=version)
    return version_forecast(pinned, input=input, input_given=input_given)


def version_forecast(
    version: WorkflowVersion, *, input: Any = None, input_given: bool = False
) -> Forecast:
    """The forecast of a run of ``version`` (the start page's, the admin's)."""
    per_step, totals = history(version.workflow_id)
    pricing = _pricing
    sources = Sources(
        price=pricing.price if pricing else None,
        recipe_of=_recipe_of,
        child_of=_child_of,
        tokens=pricing.tokens if pricing else Sources.tokens,
        history=per_step,
        history_totals=totals,
        input=input,
        input_given=input_given,
    )
    result = forecast(version.document, sources)
    if pricing is None:
        result.cost_max = None
        result.unbounded.append("no prices are configured here (the workers app is not loaded)")
    return result


def history(workflow_id: str) -> tuple[dict[str, list[Decimal]], list[Decimal]]:
    """Per step id, what each of the workflow's last completed runs spent on it (its own
    rows and its body runs' one level down; a subworkflow step's child runs summed into that
    step), and each run's total. Two queries, at most :data:`HISTORY_RUNS` runs."""
    runs = list(
        Run.objects.filter(workflow_id=workflow_id, status=RunStatus.COMPLETED, body="")
        .order_by("-created_at", "-id")
        .values_list("id", flat=True)[:HISTORY_RUNS]
    )
    if not runs:
        return {}, []
    # A body run (a do of several steps, one level down) is its parent's; a subworkflow's
    # child run (body "") is summed into the step that started it. A run of the workflow may
    # itself be a child (its parent is another workflow's run): its own rows are its own.
    owner = Case(When(run_id__in=runs, then=F("run_id")), default=F("run__parent_run_id"))
    rows = (
        StepRun.objects.filter(
            Q(run_id__in=runs) | Q(run__parent_run_id__in=runs, run__body__gt="")
        )
        .values("step_id", owner=owner)
        .annotate(spent=Sum("cost_usd"))
        .values_list("owner", "step_id", "spent")
    )
    children = (
        Run.objects.filter(parent_run_id__in=runs, body="")
        .values("parent_run_id", "parent_step_run__step_id")
        .annotate(spent=Sum("cost_usd"))
        .values_list("parent_run_id", "parent_step_run__step_id", "spent")
    )
    spent: dict[tuple[Any, str], Decimal] = {}
    totals: dict[Any, Decimal] = dict.fromkeys(runs, Decimal(0))
    for run_id, step_id, cost in [*rows, *children]:
        if run_id in totals and step_id:
            spent[(run_id, step_id)] = spent.get((run_id, step_id), Decimal(0)) + (cost or 0)
            totals[run_id] += cost or 0
    per_step: dict[str, list[Decimal]] = {}
    for (_, step_id), cost in spent.items():
        per_step.setdefault(step_id, []).append(cost)
    return per_step, list(totals.values())


def _recipe_of(step: Mapping[str, Any]) -> Mapping[str, Any] | None:
    stored = None
    if "recipe" in step:
        found = Recipe.objects.resolve(step["recipe"], step.get("recipe_version"))
        if found is None:
            return None
        stored = found.document
    try:
        recipe = recipes.recipe_of_step(step, stored)
    except InvalidDocument:
        return None
    if not recipe.get("model") and _pricing is not None:
        recipe["model"] = _pricing.default_model()
    return recipe


def _child_of(workflow_id: str, version: int | None) -> Mapping[str, Any] | None:
    found = WorkflowVersion.objects.resolve(workflow_id, version)
    return None if found is None else found.document
