"""Workflows with known outcomes for the metrics tests (tests/test_metrics*.py): one that
completes after a model-like span with usage, one whose step fails (class fatal)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import StepFailure, workflow

metered_ok = workflow("metered_ok", limits={"run_timeout_ms": 60_000})


@metered_ok.step("answer")
def answer(ctx: Any, input: Any, prior: Any) -> Any:
    # Usage on a model the price table knows: tokens and cost are counted.
    with ctx.span("model", kind="llm") as span:
        span.set_model("claude-sonnet-4", provider="anthropic")
        span.set_usage(input_tokens=100, output_tokens=10)
    return {"answered": True}


metered_fail = workflow("metered_fail", limits={"run_timeout_ms": 60_000})


@metered_fail.step("refuse")
def refuse(ctx: Any, input: Any, prior: Any) -> Any:
    raise StepFailure("refused on purpose", class_="fatal")
