"""Pre-flight (CONTRACT section 10): what starting a run checks of its document beyond the
input, before any step runs. Each kind says what it can know now (``Kind.preflight``): a
named recipe that does not exist, a model whose provider is not configured. Every problem is
named at once, by the step's field (``steps[1].recipe``); ``POST /runs`` answers 400 and
starts nothing.

What cannot be known at the start (a subworkflow's steps, a recipe saved or a provider
configured between the start and the step) fails the step when it runs, naming the cause.

:func:`start_problems` is every check a start makes, in one place: ``POST /runs``
(``runs.services.run_start``), ``manage.py preflight`` and the admin's definition pages ask it,
so the three never disagree. Of workers they ask what a start needs: a worker that served
each handler within ``UNSERVABLE_SECONDS`` (a 400 otherwise). A handler no live worker serves
now, but one served in that window, is no problem: the run is accepted and waits for a worker
(CONTRACT section 14); :func:`start_waits` names those steps, and the command and the admin
show them as warnings, not as failed checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings

from . import kinds
from .errors import FieldError
from .heartbeats import StepHandler, unlive_steps, unserved_errors, waiting_message, walk_steps
from .inputs import input_errors
from .queues import version_queue_errors
from .validation import field_path

# ``input`` left out: the checks of the document alone (the command without --input, the admin).
NO_INPUT: Any = object()


def start_problems(version: Any, input: Any = NO_INPUT) -> list[FieldError]:
    """What stops a run of ``version`` (a ``WorkflowVersion``) from starting with ``input``:
    the input schema, then each kind's pre-flight, the queues its steps name, then (when
    ``START_CHECKS_WORKERS``) a handler no worker has served within ``UNSERVABLE_SECONDS``.
    Every problem at once; empty when it may start."""
    problems = [] if input is NO_INPUT else input_errors(version, input)
    problems += preflight_errors(version.document)
    # A version saved before DJFLOW_STEP_QUEUES (or before the list shrank) may name a queue
    # its author may no longer name: refused as its save would be now (workflows.queues).
    problems += version_queue_errors(version)
    if settings.DJFLOW["START_CHECKS_WORKERS"]:
        # A run no worker can take would wait, then fail as unservable: say so now. One that
        # a worker served a moment ago (restarting) is accepted and waits (start_waits).
        problems += unserved_errors(document=version.document)
    return problems


def start_waits(version: Any) -> list[StepHandler]:
    """The steps of ``version`` whose handler no live worker serves now, though one served
    it within ``UNSERVABLE_SECONDS`` (or none did: ask :func:`start_problems` first): a
    start is accepted and its run waits for a worker. Empty when ``START_CHECKS_WORKERS`` is
    off (no heartbeat is read at start then; the engine's own checks find the wait). After
    :func:`start_problems` it costs no query when live workers serve every step."""
    if not settings.DJFLOW["START_CHECKS_WORKERS"]:
        return []
    return unlive_steps(document=version.document)


def start_warnings(version: Any, problems: list[FieldError]) -> list[FieldError]:
    """:func:`start_waits` for people (the command, the admin): each step a run would wait
    for, by its ``handler`` field; steps among ``problems`` (what :func:`start_problems`
    answered) are refused, not warned of."""
    refused = {problem.field for problem in problems}
    return [
        FieldError(step.field, waiting_message(step))
        for step in start_waits(version)
        if step.field not in refused
    ]


def preflight_errors(document: Mapping[str, Any]) -> list[FieldError]:
    errors = []
    walked = [
        *walk_steps(document.get("steps", []), ["steps"]),
        *walk_steps(document.get("on_failure", []), ["on_failure"]),
    ]
    every = tuple(step for _, step in walked)
    memo: dict[str, Any] = {}
    for index, (path, step) in enumerate(walked):
        kind = kinds.get(str(step.get("kind")))
        if kind is not None and kind.preflight is not None:
            scope = kinds.PreflightScope(earlier=every[:index], steps=every, memo=memo)
            for field, message in kind.preflight(step, scope):
                errors.append(FieldError(field_path([*path, field]), message))
    return errors
