"""The workflow the schedules' end-to-end test starts on a schedule: one handler step that
writes each execution to the side table of ``tests.runs.flows`` (how many times it ran)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import workflow

from ..runs.flows import note

ticker = workflow(
    "ticker",
    input_schema={
        "type": "object",
        "required": ["region"],
        "properties": {"region": {"type": "string"}},
    },
    limits={"run_timeout_ms": 60_000},
)


@ticker.step("tick")
def tick(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"region": input["region"]}
