"""``subworkflow``: the step starts a run of another workflow (pinned to a version, or its
latest) and waits while it runs; the child's end is the step's (see the planner's
``_child_waiting``). The applier starts the child in the transaction that opens the row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workflows.kinds import Kind, Opening, Refused, Role, Scope, register

# The longest chain of subworkflows: a run this many subworkflows below its root starts none.
MAX_SUBWORKFLOW_DEPTH = 8


def open_subworkflow(step: Mapping[str, Any], scope: Scope) -> Opening:
    if scope.depth >= MAX_SUBWORKFLOW_DEPTH:
        raise Refused(
            f"workflow: '{step['workflow']}' would start a run {scope.depth + 1} subworkflows "
            f"below its root run; chains of subworkflows are at most {MAX_SUBWORKFLOW_DEPTH} "
            "deep"
        )
    child_input = scope.input(step)
    start = {"workflow": step["workflow"], "version": step.get("version"), "input": child_input}
    return Opening("waiting", input=child_input, start=start)


SUBWORKFLOW = register(Kind("subworkflow", Role.CHILD, open=open_subworkflow))
