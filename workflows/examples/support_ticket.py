"""The contract's example (sections 1 and 6): classify a ticket, draft an answer, wait for
approval on bugs, send.

Load it with ``WORKFLOW_MODULES=workflows.examples.support_ticket``.
"""

from __future__ import annotations

from typing import Any

from workflows.sdk import RetryPolicy, StepFailure, when, workflow


def deliver(text: str, key: str) -> bool:
    """The example's stand-in for a mail relay: a real one would send ``text``, passing ``key``
    as its idempotency key so a retried step never sends twice. Answers whether the relay
    accepted the message; this stand-in always does."""
    return True


# Section 6 writes ``workflow("support_ticket")``; the top-level fields below make the stored
# document the one of contract section 1. ``limits`` matters: the approval wait (7 days) must
# fit in ``run_timeout_ms`` (default 5 minutes) or the document is rejected at save.
support = workflow(
    "support_ticket",
    description="Classify a ticket, draft an answer, wait for approval on bugs, send.",
    input_schema={
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string"}},
    },
    limits={
        "max_steps": 50,
        "run_timeout_ms": 691200000,
        "step_timeout_ms": 60000,
        "max_cost_usd": 2.0,
    },
)


@support.step("classify")
def classify(ctx: Any, input: Any, prior: Any) -> Any:
    return {"kind": "question" if input["ticket"].startswith("Q") else "bug"}


@support.agent("draft", input={"kind": "${steps.classify.output.kind}"})
def draft(ctx: Any, input: Any, prior: Any) -> Any:
    with ctx.span("model_call", kind="model_generation") as span:
        # No model is called: the span is labelled the offline stand-in's (standin:echo,
        # priced at 0), its usage made up. Contract section 6 writes claude-sonnet-4 by
        # anthropic here, which priced every run's made-up usage as real spend ($1.50 after
        # a load test of 500 runs, issue 37).
        span.set_model("echo", "standin")
        span.set_usage(input_tokens=812, output_tokens=37)
        return f"an answer to a {input['kind']}"


support.wait_for(
    "approval",
    event="approved",
    key="${input.ticket}",
    timeout_ms=7 * 24 * 3_600_000,
    when=when("steps.classify.output.kind", "eq", "bug"),
)


@support.step(
    "send",
    input={"text": "${steps.draft.output}"},
    effect="at_most_once",
    retry=RetryPolicy(max_attempts=3, backoff="exponential", initial_ms=500),
)
def send(ctx: Any, input: Any, prior: Any) -> Any:
    if not deliver(input["text"], ctx.idempotency_key):
        raise StepFailure("mail relay busy", class_="retryable", retry_after_ms=2_000)
    return {"sent": True}


support.output({"sent": "${steps.send.output.sent}"})
