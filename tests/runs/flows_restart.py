"""The workflow of ``test_start_restart_e2e.py``: two steps whose bodies each write their
execution to the side table of ``tests.runs.flows``, which proves each ran once."""

from __future__ import annotations

from typing import Any

from workflows.sdk import workflow

from .flows import done, note

restarting = workflow("restarting", limits={"run_timeout_ms": 120_000})


@restarting.step("one")
def one(ctx: Any, input: Any, prior: Any) -> Any:
    done(note(ctx))
    return 1


@restarting.step("two")
def two(ctx: Any, input: Any, prior: Any) -> Any:
    done(note(ctx))
    return prior["one"] + 1
