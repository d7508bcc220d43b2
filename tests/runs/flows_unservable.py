"""A workflow whose last handler goes away with its worker (``test_unservable_e2e.py``)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import workflow

vanishing = workflow("vanishing")


@vanishing.step("first")
def first(ctx: Any, input: Any, prior: Any) -> Any:
    return "first"


# The worker that serves ``last`` is stopped while the run sleeps here.
vanishing.sleep("nap", ms=3000)


@vanishing.step("last")
def last(ctx: Any, input: Any, prior: Any) -> Any:
    return "last"


# Nobody's handler but this module's: a worker without it hands it back.
orphaned = workflow("orphaned")


@orphaned.step("greet")
def greet(ctx: Any, input: Any, prior: Any) -> Any:
    return "hello"
