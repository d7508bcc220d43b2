"""``task`` and ``agent``: a worker runs the Python handler registered for the step (its
``handler`` name, else ``"<workflow id>.<step id>"``; see ``workflows.registry``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from workflows import registry
from workflows.kinds import Kind, Role, register


def handler_of(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any] | None:
    """The handler this process registered for the step, or None (the attempt goes to a
    worker that has it)."""
    return registry.lookup(workflow_id, step["id"], step.get("handler"))


TASK = register(Kind("task", Role.WORKER, needs_handler=True, body=handler_of))
AGENT = register(Kind("agent", Role.WORKER, needs_handler=True, body=handler_of))
