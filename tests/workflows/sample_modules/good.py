"""Two valid workflows. The parent is defined first and calls the child as a subworkflow, so
syncing must save the child before the parent."""

from __future__ import annotations

from typing import Any

from workflows.sdk import when, workflow

parent = workflow("sample_parent", description="Calls sample_child.")
parent.subworkflow("call_child", workflow="sample_child", input={"n": "${input.n}"})
parent.output({"child": "${steps.call_child.output}"})

child = workflow("sample_child")


@child.step("double")
def double(ctx: Any, input: Any, prior: Any) -> Any:
    return {"n": input["n"] * 2}


child.sleep("rest", ms=10, when=when("steps.double.output.n", "gt", 100))
