"""Factories for runs and the step journal.

Versions are saved through ``definition_save``, as the API and the builder save them, so a
run's pinned document is always one the validator accepted. Runs and step runs are built
straight into the tables in any status, with the timestamps and error that status implies;
they exercise the API and the admin, not the engine.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import factory
from django.utils import timezone

from runs.models import Run, StepRun
from runs.status import RUN_TERMINAL, STEP_TERMINAL, RunStatus, StepStatus
from workflows.models import WorkflowVersion
from workflows.services import definition_save

from ..moves import unchecked
from ..workflows.documents import SUPPORT_TICKET


def support_ticket_document(**changes: Any) -> dict[str, Any]:
    """The contract's example without its version: saved as the workflow's next version."""
    document = {k: v for k, v in copy.deepcopy(SUPPORT_TICKET).items() if k != "version"}
    document.update(changes)
    return document


class WorkflowVersionFactory(factory.Factory):
    """A saved version; the same document again is the same version (as the service says)."""

    class Meta:
        model = WorkflowVersion

    document = factory.LazyFunction(support_ticket_document)

    @classmethod
    def _create(cls, model_class: type, document: dict[str, Any], **kwargs: Any) -> Any:
        return definition_save(document=document, **kwargs).version


RUN_ERRORS = {
    RunStatus.FAILED: {"class": "fatal", "message": "the handler raised", "step": "send"},
    RunStatus.CANCELLED: {
        "class": "cancelled",
        "message": "cancelled by an operator",
        "step": None,
    },
    RunStatus.TIMED_OUT: {"class": "timeout", "message": "run_timeout_ms reached", "step": None},
}


def _started(status: str, created: Any) -> Any:
    return None if status == RunStatus.PENDING else created + timedelta(milliseconds=5)


class _Unchecked(factory.django.DjangoModelFactory):
    """Rows built straight into any status: not moves the engine makes (tests/moves.py)."""

    class Meta:
        abstract = True

    @classmethod
    def _create(cls, model_class: type, *args: Any, **kwargs: Any) -> Any:
        with unchecked():
            return super()._create(model_class, *args, **kwargs)


class RunFactory(_Unchecked):
    """A run in any status: ``RunFactory(status=RunStatus.FAILED)``."""

    class Meta:
        model = Run

    version = factory.SubFactory(WorkflowVersionFactory)
    workflow = factory.LazyAttribute(lambda o: o.version.workflow)
    status = RunStatus.RUNNING
    input = factory.LazyFunction(lambda: {"ticket": "Q: where is my parcel?"})
    created_at = factory.LazyFunction(timezone.now)
    started_at = factory.LazyAttribute(lambda o: _started(o.status, o.created_at))
    finished_at = factory.LazyAttribute(
        lambda o: o.created_at + timedelta(seconds=1) if o.status in RUN_TERMINAL else None
    )
    output = factory.LazyAttribute(
        lambda o: {"sent": True} if o.status == RunStatus.COMPLETED else None
    )
    error = factory.LazyAttribute(lambda o: copy.deepcopy(RUN_ERRORS.get(o.status)))


class StepRunFactory(_Unchecked):
    """One attempt of one step: ``StepRunFactory(run=run, step_id="send", attempt=2)``."""

    class Meta:
        model = StepRun

    run = factory.SubFactory(RunFactory)
    step_id = "classify"
    kind = "task"
    attempt = 1
    generation = factory.LazyAttribute(lambda o: o.run.generation)
    status = StepStatus.SUCCEEDED
    input = factory.LazyAttribute(lambda o: o.run.input)
    output = factory.LazyAttribute(
        lambda o: {"kind": "question"} if o.status == StepStatus.SUCCEEDED else None
    )
    error = factory.LazyAttribute(
        lambda o: (
            {"class": "fatal", "message": "boom", "traceback": "Traceback ..."}
            if o.status == StepStatus.FAILED
            else None
        )
    )
    worker = factory.LazyAttribute(
        lambda o: "" if o.status == StepStatus.SCHEDULED else "celery@worker-1"
    )
    scheduled_at = factory.LazyFunction(timezone.now)
    started_at = factory.LazyAttribute(
        lambda o: None if o.status == StepStatus.SCHEDULED else o.scheduled_at
    )
    finished_at = factory.LazyAttribute(
        lambda o: o.scheduled_at + timedelta(milliseconds=40) if o.status in STEP_TERMINAL else None
    )
