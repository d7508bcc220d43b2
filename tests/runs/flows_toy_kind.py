"""A toy worker kind, ``shout``, declared in this one module and nowhere else: what adding a
worker kind takes (README, "Adding a step kind"). Workers load it through
``WORKFLOW_MODULES``; the test process registers it through the test's fixture, and imports
it only then. It defines no workflow: a builder here would be saved by every later
``sync_modules`` of the test process, kind registered or not.

Its step repeats its input text ``times`` times in capitals. Its default retry budget is
the kind's (two attempts), and an input asking for it fails the first attempt as retryable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from workflows.kinds import Kind, Role, register
from workflows.sdk import StepFailure


def shout_body(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any]:
    times = step["times"]

    def body(ctx: Any, input: Any, prior: Any) -> Any:
        if isinstance(input, dict) and input.get("stumble") and ctx.attempt == 1:
            raise StepFailure("a stumble on the first attempt", "retryable")
        text = input["text"] if isinstance(input, dict) else str(input)
        return {"text": " ".join([text.upper()] * times), "attempt": ctx.attempt}

    return body


SHOUT = register(
    Kind(
        "shout",
        Role.WORKER,
        max_attempts=2,
        schema={
            "description": "Repeats its input text in capitals.",
            "properties": {"times": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["times"],
        },
        body=shout_body,
    )
)
