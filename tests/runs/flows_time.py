"""Workflows the durable-time end-to-end tests run (tests/runs/test_timers_e2e.py).

Each sleeps, then runs a handler step, so a timer's firing reaches a real worker; the handler
writes to the side table of ``tests.runs.flows``, which proves how many times it really ran.
"""

from __future__ import annotations

from typing import Any

from workflows.sdk import workflow

from .flows import note

# A fixed sleep, then a handler.
napper = workflow("napper", limits={"run_timeout_ms": 60_000})
napper.sleep("nap", ms=2000)


@napper.step("after_nap")
def after_nap(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return "awake"


# A sleep until the run input's ``until`` (ISO-8601 or epoch ms), then a handler.
alarm = workflow("alarm", limits={"run_timeout_ms": 120_000})
alarm.sleep_until("until", until="${input.until}")


@alarm.step("ring")
def ring(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return "rang"
