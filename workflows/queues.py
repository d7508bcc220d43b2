"""The Celery queues a workflow's steps may name (a step's ``queue``; issue 36).

A step's queue decides which worker processes take its body, so it is a deployment's
resource, not an author's:

* The engine's own queues (every queue of ``CELERY_TASK_ROUTES``: ``engine``, ``timers``,
  ``mail``) carry planning, the clock, the reconciler and e-mail. A step there waits behind
  them and holds them up (three slow steps on ``timers`` made an unrelated 2-s run take 53 s).
  No document may name one, whoever saves it, and a version stored before this rule that
  names one is refused at start. The settings refuse to start when ``DJFLOW_STEP_QUEUES``
  lists one.
* A person saving a document may name only the queues the operator lists in
  ``DJFLOW_STEP_QUEUES``, plus ``default`` (where a step without ``queue`` goes anyway), so
  an author cannot put work on a queue the operator keeps for other teams' workers.
* Trusted saves (the deployment's own ``WORKFLOW_MODULES``, superusers: ``access.trusted``)
  may name any other queue: they are the operator's, and so are the workers that consume
  those queues. A start is held to the rule of whoever saved the version (its
  ``created_by``), so the start of a version a person saved before the list existed is
  refused the same way as its save would be.

Every problem names the step's field (``steps[2].queue``, ``steps[0].do[1].queue``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings

from . import access
from .errors import FieldError
from .validation import every_step

__all__ = ["engine_queues", "queue_errors", "step_queues", "version_queue_errors"]


def engine_queues() -> frozenset[str]:
    """The queues the engine's own tasks are routed to (``CELERY_TASK_ROUTES``), less the
    default queue that step bodies share."""
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    return frozenset(routed - {settings.CELERY_TASK_DEFAULT_QUEUE})


def step_queues() -> frozenset[str]:
    """The queues any author may name: ``DJFLOW_STEP_QUEUES`` and the default queue."""
    return frozenset({settings.CELERY_TASK_DEFAULT_QUEUE, *settings.DJFLOW["STEP_QUEUES"]})


def queue_errors(document: dict[str, Any], *, trusted: bool) -> list[FieldError]:
    """Each step of ``document`` (nested and ``on_failure`` ones too) whose ``queue`` it may
    not name: an engine queue for anyone, an unlisted one unless ``trusted``."""
    engine = engine_queues()
    allowed = step_queues()
    errors = []
    for step, where in every_step(document):
        queue = step.get("queue")
        if not isinstance(queue, str):
            continue  # no queue (the default one), or a shape the schema reports
        if queue in engine:
            errors.append(
                FieldError(
                    f"{where}.queue",
                    f"'{queue}' is one of the engine's own queues ({_listed(engine)}); steps "
                    f"may not run there. Queues steps may name: {_listed(allowed)}",
                )
            )
        elif not trusted and queue not in allowed:
            errors.append(
                FieldError(
                    f"{where}.queue",
                    f"'{queue}' is not a queue steps may name; the operator lists them in "
                    f"DJFLOW_STEP_QUEUES: {_listed(allowed)}",
                )
            )
    return errors


def version_queue_errors(version: Any, *, document: Any = None) -> list[FieldError]:
    """:func:`queue_errors` for a start (or a retry) of a stored ``WorkflowVersion``, held to
    the rule of whoever saved it: trusted when no person did (``created_by`` empty) or a
    superuser did. ``document`` is the version's, when the caller has it already: a document
    that names no queue then costs no query, not even the version's row."""
    document = version.document if document is None else document
    if not any(isinstance(step.get("queue"), str) for step, _ in every_step(document)):
        return []
    trusted = version.created_by_id is None or access.trusted(version.created_by)
    return queue_errors(document, trusted=trusted)


def _listed(queues: Iterable[str]) -> str:
    return ", ".join(sorted(queues))
