"""Workflows of the tracing tests (tests/workers/test_tracing.py in one process,
tests/workers/test_tracing_e2e.py on real workers): handler spans nested in each other, a
log line, a fan-out, a retried step, a sleep (an attempt no worker runs), and a model call.
"""

from __future__ import annotations

from typing import Any

from workflows import registry
from workflows.sdk import RetryPolicy, StepFailure, task, workflow

LIMITS = {"run_timeout_ms": 120_000}

# fetch (two nested handler spans, a log line) → fan (a foreach of two items) → ask (a recipe).
traced = workflow("traced", limits=LIMITS)


@traced.step("fetch")
def fetch(ctx: Any, input: Any, prior: Any) -> Any:
    with ctx.span("lookup", source="catalogue") as outer:
        outer.set_attribute("rows", 2)
        with ctx.span("parse"):
            pass  # a span inside a span: nested in the trace as in the handler
    ctx.logger.info("fetched %d rows", 2)
    return {"items": ["a", "b"]}


traced.foreach("fan", items="${steps.fetch.output.items}", do=task("item", input="${item}"))


def item(ctx: Any, input: Any, prior: Any) -> Any:
    return f"{input}!"


registry.register("traced", "item", item)

# The model call's step: its model is the test's (a local server on real workers, the
# offline stand-in in one process), set by save_traced().
ASK = {
    "id": "ask",
    "kind": "recipe",
    "input": {"items": "${steps.fan.output}"},
    "prompt": "Summarise ${input.items}.",
    "max_tokens": 40,
}


def save_traced(model: str) -> None:
    from workflows.services import definition_save

    document = traced.document()
    document["steps"] = [*document["steps"], {**ASK, "model": model}]
    definition_save(document=document)


# flaky (fails once, retried after 100 ms) → nap (a sleep of 300 ms) → done.
retried = workflow("traced_retried", limits=LIMITS)


@retried.step(
    "flaky",
    retry=RetryPolicy(max_attempts=2, backoff="fixed", initial_ms=100, jitter=False),
)
def flaky(ctx: Any, input: Any, prior: Any) -> Any:
    if ctx.attempt == 1:
        raise StepFailure("not yet", class_="retryable")
    return "ok"


retried.sleep("nap", ms=300)


@retried.step("done")
def finish(ctx: Any, input: Any, prior: Any) -> Any:
    return "done"


# A secret (a writeOnly field) the handler puts on a span and into its error.
secretive = workflow(
    "traced_secret",
    limits=LIMITS,
    input_schema={
        "type": "object",
        "properties": {"key": {"type": "string", "writeOnly": True}},
    },
)


@secretive.step("use")
def use(ctx: Any, input: Any, prior: Any) -> Any:
    with ctx.span("call", key=input["key"], note=f"sent {input['key']}"):
        pass
    raise StepFailure(f"refused key {input['key']}", class_="fatal")
