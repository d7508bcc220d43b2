"""A workflow whose recipe step, nested in a condition, names a stored recipe."""

from __future__ import annotations

from workflows.sdk import recipe, when, workflow

asks = workflow("sample_named_recipe")
asks.condition(
    "route",
    if_=when("input.ask", "eq", True),
    then=[recipe("ask", recipe="triage")],
)
