"""Pre-flight (CONTRACT section 10): what starting a run checks of its document beyond the
input, before any step runs. Each kind says what it can know now (``Kind.preflight``): a
named recipe that does not exist, a model whose provider is not configured. Every problem is
named at once, by the step's field (``steps[1].recipe``); ``POST /runs`` answers 400 and
starts nothing.

What cannot be known at the start (a subworkflow's steps, a recipe saved or a provider
configured between the start and the step) fails the step when it runs, naming the cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import kinds
from .errors import FieldError
from .heartbeats import walk_steps
from .validation import field_path


def preflight_errors(document: Mapping[str, Any]) -> list[FieldError]:
    errors = []
    earlier: list[Mapping[str, Any]] = []
    for path, step in walk_steps(document.get("steps", []), ["steps"]):
        kind = kinds.get(str(step.get("kind")))
        if kind is not None and kind.preflight is not None:
            scope = kinds.PreflightScope(earlier=tuple(earlier))
            for field, message in kind.preflight(step, scope):
                errors.append(FieldError(field_path([*path, field]), message))
        earlier.append(step)
    return errors
