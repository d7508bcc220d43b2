"""Workflows the approvals end-to-end tests run on a real worker (WORKFLOW_MODULES).

A handler step before and after each gate, so a decision's effect (the run resuming) is a
real worker running the next body; the handlers write to the side table of
``tests.runs.flows``, which proves how many times a body really ran.
"""

from __future__ import annotations

from typing import Any

from tests.runs.flows import note
from workflows import sdk
from workflows.sdk import workflow

# A release is drafted, approved by ann or the ops address, then shipped.
release = workflow("release", limits={"run_timeout_ms": 600_000})


@release.step("draft")
def draft(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"title": f"Release {input['version']}", "changes": input.get("changes", [])}


release.approval(
    "gate",
    approvers={"users": ["ann", "bob"], "emails": ["ops@example.com"]},
    message="Ship release ${input.version}?",
    timeout_ms=300_000,
)


@release.step("ship")
def ship(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"shipped": True, "approval": input}


# Two of three must approve.
pair = workflow("pair", limits={"run_timeout_ms": 600_000})
pair.approval(
    "gate",
    approvers={"users": ["ann", "bob", "cy"]},
    quorum=2,
    message="Merge ${input.pr}?",
    timeout_ms=300_000,
)


@pair.step("merge")
def merge(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return "merged"


# A gate whose deadline comes fast, for the race between a decision and the deadline timer.
hurry = workflow("hurry", limits={"run_timeout_ms": 60_000})
hurry.approval(
    "gate",
    approvers={"users": ["ann"]},
    message="Quick: ${input.n}?",
    timeout_ms=2_500,
)


@hurry.step("after")
def after(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return "after"


# Reminders every second until a 3.5 s deadline, then escalation to cy; the run goes on.
nudge = workflow("nudge", limits={"run_timeout_ms": 60_000})
nudge.approval(
    "gate",
    approvers={"users": ["ann"], "emails": ["ops@example.com"]},
    message="Still waiting on ${input.what}",
    timeout_ms=3_500,
    remind_after_ms=1_000,
    escalate_to={"users": ["cy"]},
    on_error="continue",
)


@nudge.step("afterwards", input={"gate": "${steps.gate.error.class}"})
def afterwards(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return input


# One approval per item, then a handler that pays what was approved.
batch = workflow("batch", limits={"run_timeout_ms": 600_000})
batch.foreach(
    "each",
    items="${input.bills}",
    do=sdk.approval("ok", approvers={"users": ["ann"]}, message="Pay ${item}?", timeout_ms=300_000),
)


@batch.step("pay", input="${steps.each.output}")
def pay(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return [decision["comment"] for decision in input]


# A subworkflow whose child waits for people.
inner = workflow("signoff", limits={"run_timeout_ms": 600_000})
inner.approval("sign", approvers={"users": ["bob"]}, message="Sign ${input.doc}?")

outer = workflow("contract", limits={"run_timeout_ms": 600_000})
outer.subworkflow("child", workflow="signoff", input={"doc": "${input.doc}"})


@outer.step("file", input="${steps.child.output}")
def file(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return input["by"]


# A hand-off to the on-call group, then an approval decided from the inbox.
escalate = workflow("oncall", limits={"run_timeout_ms": 600_000})
escalate.handoff("page", group="oncall", message="Disk full on ${input.host}")
escalate.approval("wipe", approvers={"groups": ["oncall"]}, message="Wipe /tmp on ${input.host}?")


@escalate.step("done")
def done(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return input
