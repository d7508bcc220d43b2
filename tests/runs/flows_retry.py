"""A workflow for retry from a step with an edited input (``run_retry(from_step=, input=)``):
run on a real worker (WORKFLOW_MODULES) and in-process.

Each handler notes its execution in the side table (``flows.note``), so a test proves which
steps really ran again; ``two`` also proves it received the secret key (a digest of it),
which the edit left out and the run kept.
"""

from __future__ import annotations

import hashlib
from typing import Any

from workflows.sdk import workflow

from .flows import note

KEY = "sk-test-5b8e2c7d9a1f3e4b"
SCHEMA = {
    "type": "object",
    "required": ["topic", "key"],
    "additionalProperties": False,
    "properties": {
        "topic": {"type": "string", "minLength": 1},
        "key": {"type": "string", "writeOnly": True, "pattern": "^sk-"},
    },
}


def digest(value: Any) -> str:
    return hashlib.sha256(str(value).encode()).hexdigest()


rerun = workflow("rerun_flow", input_schema=SCHEMA, limits={"run_timeout_ms": 600_000})


@rerun.step("one", input={"topic": "${input.topic}"})
def one(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"first": input["topic"]}


@rerun.step("two", input={"topic": "${input.topic}", "key": "${input.key}"})
def two(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"second": input["topic"], "key": digest(input["key"])}


@rerun.step("three")
def three(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"third": input["second"], "first": prior["one"]["first"], "key": input["key"]}
