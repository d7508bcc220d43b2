"""Reads of runs and their journal that are more than a filter."""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import F, Prefetch, QuerySet

from workflows import access
from workflows.errors import FieldError, NotFound, echo

from .models import ModelCall, Run, RunAction, StepRun, ToolCall


def run_list(
    *, workflow: str | None = None, status: str | None = None, user: Any = None
) -> QuerySet[Run]:
    """Runs, newest first, optionally of one workflow and in one status, narrowed to those
    ``user`` may read (``None``: every run).

    Rows carry what a list shows (the version number, the parent's step id), not the journal
    or the children: those are for :func:`run_get`.
    """
    runs = Run.objects.select_related("version", "parent_step_run").order_by("-created_at", "-id")
    if workflow is not None:
        runs = runs.filter(workflow_id=workflow)
    if status is not None:
        runs = runs.filter(status=status)
    readable = access.run_filter(user)
    if readable is not None:
        runs = runs.filter(readable)
    return runs


def run_detail_queryset(user: Any = None) -> QuerySet[Run]:
    """Runs with their journal (every attempt, in the order it was written) and the children
    ``user`` may read (``None``: all): a child of a workflow they may not see is not theirs to
    know of, by id or status (CONTRACT section 8), though its output is their step's."""
    children = Run.objects.order_by("created_at", "id").only(
        "id", "workflow", "status", "parent_run", "created_by"
    )
    readable = access.run_filter(user)
    if readable is not None:
        children = children.filter(readable)
    return Run.objects.select_related("version", "parent_step_run").prefetch_related(
        Prefetch(
            "steps",
            queryset=StepRun.objects.order_by("id").prefetch_related(
                Prefetch(
                    "model_calls",
                    # The sizes of the prompt and reply, not their texts (the call's own
                    # resource has them).
                    queryset=ModelCall.objects.annotate(
                        prompt_size=F("prompt__size"), reply_size=F("reply__size")
                    ).order_by("id"),
                ),
                Prefetch(
                    "tool_calls",
                    queryset=ToolCall.objects.annotate(
                        arguments_size=F("arguments__size"), result_size=F("result__size")
                    ).order_by("id"),
                ),
            ),
        ),
        Prefetch("actions", queryset=RunAction.objects.order_by("created_at", "id")),
        Prefetch("children", queryset=children),
    )


def run_get(*, run_id: Any, user: Any = None) -> Run:
    """The run with its journal and children; a malformed or unknown id, or a run ``user`` may
    not read, is a 404 naming ``id``."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = run_detail_queryset(user).filter(id=key).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, run)
    return run


def model_call_get(*, run_id: Any, call_id: Any, user: Any = None) -> ModelCall:
    """One model call of a run with its prompt and reply; 404 naming ``id`` for a run the
    caller may not read, naming ``call`` for a call that is not the run's."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = Run.objects.only("id", "workflow_id", "created_by_id", "secrets").filter(id=key).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, run)
    call = (
        ModelCall.objects.select_related("prompt", "reply")
        .annotate(prompt_size=F("prompt__size"), reply_size=F("reply__size"))
        .filter(run_id=run.id, id=call_id)
        .first()
    )
    if call is None:
        raise NotFound(errors=[FieldError("call", f"run {run.id} has no model call {call_id}")])
    call.run = run
    return call
