"""A workflow for the run-end webhook and all_settled end-to-end test: a parallel step in
``all_settled`` mode whose branches succeed, fail and run a body of two steps."""

from __future__ import annotations

from typing import Any

from workflows import registry
from workflows.sdk import StepFailure, workflow
from workflows.steps import task

settled = workflow("settled_e2e", limits={"run_timeout_ms": 60_000})
settled.parallel(
    "par",
    mode="all_settled",
    branches={
        "good": task("good", input={"n": "${input.n}"}),
        "bad": task("bad"),
        "pair": [task("first", input={"n": "${input.n}"}), task("second")],
    },
)


@settled.step("after", input="${steps.par.output}")
def _after(ctx: Any, input: Any, prior: Any) -> Any:
    return {name: outcome["status"] for name, outcome in input.items()}


def _bad(ctx: Any, input: Any, prior: Any) -> Any:
    raise StepFailure("this branch fails", class_="fatal")


registry.register("settled_e2e", "good", lambda ctx, input, prior: input["n"] * 10)
registry.register("settled_e2e", "bad", _bad)
registry.register("settled_e2e", "first", lambda ctx, input, prior: input["n"] + 1)
registry.register("settled_e2e", "second", lambda ctx, input, prior: {"got": input})
