"""Workflows for the replay tests (tests/runs/test_replay.py): run through the ``djflow``
fixture, exported, and replayed by ``manage.py run_replay`` in another process, which imports
this module (WORKFLOW_MODULES) for the handlers a ``--live`` replay runs."""

from __future__ import annotations

from typing import Any

from workflows.sdk import workflow

DAY = 86_400

support = workflow("rp_support", limits={"run_timeout_ms": 10 * DAY * 1000})
support.task("classify", input={"text": "${input.q}"})
support.sleep("cool", ms=DAY * 1000)
support.recipe("draft", recipe="rp_reply", input={"question": "${input.q}"})
support.mcp_tool("lookup", server="crm", tool="find", arguments={"q": "${input.q}"})
support.http("fetch", method="GET", url="https://api.example.com/orders/${steps.lookup.output.id}")
support.approval("review", approvers={"emails": ["lead@example.com"]})
support.output(
    {
        "tier": "${steps.classify.output.tier}",
        "draft": "${steps.draft.output}",
        "order": "${steps.fetch.output.body}",
    }
)


@support.handler("classify")
def classify(ctx: Any, input: Any, prior: Any) -> Any:
    return {"tier": "gold" if "refund" in input["text"] else "silver"}


chain = workflow("rp_chain", limits={"max_steps": 200})
for index in range(100):
    chain.recipe(f"s{index}", prompt=f"step {index}: ${{input.q}}", model="openai:gpt-4o-mini")
chain.output({"last": "${steps.s99.output}"})


# Only its task reads the input: a replay with another input and --live runs the handler
# here and answers the model call from the recording.
graded = workflow("rp_graded")
graded.task("classify", input={"text": "${input.q}"})
graded.recipe("greet", prompt="Write a greeting", model="openai:gpt-4o-mini")
graded.output({"tier": "${steps.classify.output.tier}", "greeting": "${steps.greet.output}"})


@graded.handler("classify")
def grade(ctx: Any, input: Any, prior: Any) -> Any:
    return {"tier": "gold" if "refund" in input["text"] else "silver"}


# A retried failure, an event, a foreach and an approver named as a user.
eventful = workflow("rp_eventful", limits={"run_timeout_ms": 10 * DAY * 1000})
eventful.task(
    "flaky",
    retry={"max_attempts": 3, "backoff": "fixed", "initial_ms": 60_000},
)
eventful.wait_for("signal", event="paid", key="${input.order}", timeout_ms=DAY * 1000)
eventful.foreach("each", items="${input.items}", do={"id": "double", "kind": "task"})
eventful.approval("boss", approvers={"users": ["rp_boss"]})
eventful.output(
    {
        "flaky": "${steps.flaky.output}",
        "paid": "${steps.signal.output}",
        "doubled": "${steps.each.output}",
    }
)


# The offline stand-in model: a live call is made here without the network.
standin = workflow("rp_standin")
standin.recipe("say", prompt="Say ${input.q}", model="standin:echo")
standin.output({"said": "${steps.say.output}"})
