"""The builder's client: saves documents, starts runs and sends events from Python code.

This is the one module of ``workflows`` that imports ``runs`` (``tests/workflows/
test_sdk_split.py`` holds every other to that), and it calls only the public services that the
REST API calls too, so a run started here is the run ``POST /api/v1/runs`` would start.

The services are imported when called, not when this module is: they import Django models,
and the builder (which imports this module) must stay importable from a settings or Celery
module, before the app registry is ready.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    from runs.models import Run

    from .services import SaveResult

__all__ = ["document_save", "run_start", "send_event"]


def document_save(*, document: dict[str, Any], user: AbstractBaseUser | None = None) -> SaveResult:
    """Save ``document`` as a version: the same body again returns the same version."""
    from .services import definition_save

    return definition_save(document=document, user=user)


def run_start(
    *,
    workflow: str,
    input: Any,
    version: int | None,
    idempotency_key: str | None,
    priority: int | None = None,
) -> Run:
    """Start a run of ``workflow`` at ``version``, as ``POST /api/v1/runs`` does; returns
    the run (the one started before, for an ``idempotency_key`` seen before)."""
    from runs.services import run_start as start

    return start(
        workflow=workflow,
        input=input,
        version=version,
        idempotency_key=idempotency_key,
        priority=priority,
    ).run


def send_event(name: str, key: str, payload: Any = None) -> int:
    """Deliver an event to the runs waiting for (``name``, ``key``), as ``POST
    /api/v1/events`` does: it is stored (a wait reached later still takes it) and the number
    of waits it resumed is returned."""
    from runs.services import event_send

    return event_send(name=name, key=key, payload=payload)[1]
