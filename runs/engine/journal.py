"""Read a run's journal into the planner's views, and its pinned document.

Documents are immutable per version, so each process keeps the parsed ones it has seen.
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings

from workflows.models import WorkflowVersion

from ..models import Run, StepRun
from .plan import AttemptView, RunView, Settings

_JOURNAL_FIELDS = (
    "id",
    "step_id",
    "path",
    "kind",
    "attempt",
    "generation",
    "status",
    "branch",
    "output",
    "error",
    "effect",
    "finished_at",
    "lease_expires_at",
    "deadline_at",
    "cost_usd",
)


@lru_cache(maxsize=512)
def document_of(version_id: int) -> dict[str, Any]:
    """The document of a workflow version. Versions never change, so caching is safe."""
    return WorkflowVersion.objects.values_list("document", flat=True).get(id=version_id)


def run_view(run: Run) -> RunView:
    return RunView(
        id=str(run.id),
        status=run.status,
        input=run.input,
        correlation=run.correlation,
        generation=run.generation,
        started_at=run.started_at,
        deadline_at=run.deadline_at,
    )


def journal_of(run_id: Any) -> list[AttemptView]:
    rows = StepRun.objects.filter(run_id=run_id).order_by("id").values_list(*_JOURNAL_FIELDS)
    views = []
    for row in rows:
        values = dict(zip(_JOURNAL_FIELDS, row, strict=True))
        values["cost_usd"] = float(values["cost_usd"])
        views.append(AttemptView(**values))
    return views


def planner_settings() -> Settings:
    return Settings(
        deadline_grace=timedelta(seconds=settings.DJFLOW["DEADLINE_GRACE_SECONDS"]),
    )


@lru_cache(maxsize=512)
def steps_of(version_id: int) -> dict[str, dict[str, Any]]:
    """Every step of a version's document by id, nested ones included (ids are unique)."""
    found: dict[str, dict[str, Any]] = {}

    def visit(steps: list[dict[str, Any]]) -> None:
        for step in steps:
            found[step["id"]] = step
            for name in ("then", "else"):
                visit(step.get(name, []))
            for body in [*step.get("branches", {}).values(), step.get("do")]:
                if isinstance(body, list):
                    visit(body)
                elif isinstance(body, dict):
                    visit([body])

    visit(document_of(version_id)["steps"])
    return found
