"""Workflows of ``tests/test_flower_events.py`` (loaded with WORKFLOW_MODULES).

Every run's input carries ``SECRET``: the tests check it reaches no task event.
"""

from __future__ import annotations

import time
from typing import Any

from workflows.sdk import RetryPolicy, StepFailure, workflow

SECRET = "sk-live-do-not-show-me"
LIMITS = {"run_timeout_ms": 60_000}
# Long enough that each step's runtime is measurably its own (three of them chained).
STEP_SECONDS = 0.05


def _pause(ctx: Any, input: Any, prior: Any) -> Any:
    time.sleep(STEP_SECONDS)
    return {"step": ctx.step_id}


three = workflow("flower_three", limits=LIMITS)
for _step in ("fetch", "think", "reply"):
    three.step(_step, input="${input}")(_pause)


fails = workflow("flower_fails", limits=LIMITS)
fails.step("prepare", input="${input}")(_pause)


@fails.step("explode", input="${input}")
def _explode(ctx: Any, input: Any, prior: Any) -> Any:
    raise ValueError("the model answered nonsense")


# No back-off: the retry is due at once, so the same worker runs it inline.
retries = workflow("flower_retries", limits=LIMITS)


@retries.step("wobbly", input="${input}", retry=RetryPolicy(max_attempts=2, backoff="none"))
def _wobbly(ctx: Any, input: Any, prior: Any) -> Any:
    if ctx.attempt == 1:
        raise StepFailure("busy, try again", class_="retryable")
    return {"attempt": ctx.attempt}
