"""A workflow with an ``on_failure`` handler (CONTRACT section 13), run on a real worker
(WORKFLOW_MODULES): ``charge`` fails; the handler's ``refund`` reads ``${error}`` and
``notify`` completes the run with its output, unless the input asks ``refund`` to fail too.
Each handler notes its execution in the side table (``flows.note``)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import StepFailure, workflow
from workflows.steps import task

from .flows import note

refunds = workflow("refund_on_failure", limits={"run_timeout_ms": 120_000})


@refunds.step("reserve")
def reserve(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"reserved": input["card"]}


@refunds.step("charge", retry={"max_attempts": 2, "backoff": "none"})
def charge(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    raise StepFailure(f"card {input['reserved']} declined", class_="retryable")


refunds.on_failure(
    task(
        "refund",
        input={
            "why": "${error.message}",
            "class": "${error.class}",
            "step": "${error.step}",
            "card": "${steps.reserve.output.reserved}",
        },
    ),
    task("notify"),
)


@refunds.handler("refund")
def refund(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    if input["card"] == "refunds-broken":
        raise StepFailure("the refund service is down", class_="fatal")
    return {"refunded": input["card"], "because": input["why"], "of": input["step"]}


@refunds.handler("notify")
def notify(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"notified": True, **input}
