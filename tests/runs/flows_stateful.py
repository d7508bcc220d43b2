"""The workflow of the stateful tests (``tests/runs/test_stateful.py``).

One run of it has every kind of stop an operator can meet: a worker step, a wait for an
event, an approval, then an ``at_most_once`` step. Its handlers write each execution to
``EXECUTIONS`` with the run's status at that moment, read in the same transaction: a body that
ran while its run had ended shows there.
"""

from __future__ import annotations

from typing import Any

from runs.models import Run
from workflows.sdk import workflow

WORKFLOW = "stateful_flow"
EVENT = "stateful_go"
APPROVER = "ada"
HOUR_MS = 3_600_000

# (run id, step id, attempt, the run's status when the body ran, the run's generation)
EXECUTIONS: list[tuple[str, str, int, str, int]] = []


def _ran(ctx: Any) -> None:
    status, generation = Run.objects.values_list("status", "generation").get(id=ctx.run_id)
    EXECUTIONS.append((str(ctx.run_id), ctx.step_id, ctx.attempt, status, generation))


flow = workflow(WORKFLOW, limits={"run_timeout_ms": 24 * HOUR_MS})


@flow.step("first")
def first(ctx: Any, input: Any, prior: Any) -> Any:
    _ran(ctx)
    return input["n"]


flow.wait_for("go", event=EVENT, key="${input.key}", timeout_ms=HOUR_MS)
flow.approval("gate", approvers={"users": [APPROVER]}, timeout_ms=HOUR_MS)


@flow.step(
    "last",
    input={"n": "${steps.first.output}", "event": "${steps.go.output}"},
    effect="at_most_once",
)
def last(ctx: Any, input: Any, prior: Any) -> Any:
    _ran(ctx)
    return input["n"] + input["event"]["value"]


flow.output({"result": "${steps.last.output}"})


def event_value(n: int) -> int:
    return 10 * n


def expected_output(n: int) -> dict[str, int]:
    return {"result": n + event_value(n)}
