"""Workflows whose input holds secrets (``writeOnly`` fields), for the secrets tests: run on
a real worker (WORKFLOW_MODULES) and in-process.

The handlers prove what they received without storing it: they answer digests of the values
(the test knows the plaintext and compares), and echo the value into their output, an error
message, a span and a log line, which the engine must store and show masked.
"""

from __future__ import annotations

import hashlib
from typing import Any

from workflows.sdk import workflow

SECRET_SCHEMA = {
    "type": "object",
    "required": ["ticket", "creds"],
    "additionalProperties": False,
    "properties": {
        "ticket": {"type": "string"},
        "creds": {
            "type": "object",
            "properties": {
                "api_key": {"type": "string", "writeOnly": True, "pattern": "^sk-"},
                "user": {"type": "string"},
            },
        },
        "pins": {"type": "array", "items": {"type": "integer", "writeOnly": True}},
    },
}


def digest(value: Any) -> str:
    return hashlib.sha256(str(value).encode()).hexdigest()


# A child run that gets the key through its input: its own schema marks nothing, the secret
# comes with the parent's tokens.
child = workflow("vault_child", limits={"run_timeout_ms": 600_000})


@child.step("use_key")
def use_key(ctx: Any, input: Any, prior: Any) -> Any:
    return {"sha": digest(input["key"])}


vault = workflow("vault_flow", input_schema=SECRET_SCHEMA, limits={"run_timeout_ms": 600_000})


@vault.step(
    "call",
    input={
        "auth": "Bearer ${input.creds.api_key}",
        "key": "${input.creds.api_key}",
        "ticket": "${input.ticket}",
        "pins": "${input.pins}",
    },
)
def call(ctx: Any, input: Any, prior: Any) -> Any:
    ctx.logger.info("calling the service with key %s", input["key"])
    with ctx.span("service_call", kind="tool", key=input["key"]):
        pass
    return {
        "sha": digest(input["key"]),
        "bearer": input["auth"] == f"Bearer {input['key']}",
        "pins": input["pins"],
        "echo": f"used {input['key']}",
    }


@vault.step("again")
def again(ctx: Any, input: Any, prior: Any) -> Any:
    # Its input is the previous output, whose echo of the key is stored as a token.
    return {"echo": digest(input["echo"]), "prior": digest(prior["call"]["echo"])}


vault.approval(
    "gate",
    approvers={"users": ["ann"]},
    message="Use key ${input.creds.api_key} for ${input.ticket}?",
    timeout_ms=300_000,
)

vault.subworkflow("child", workflow="vault_child", input={"key": "${input.creds.api_key}"})


@vault.step("boom", on_error="continue", input={"key": "${input.creds.api_key}"})
def boom(ctx: Any, input: Any, prior: Any) -> Any:
    raise RuntimeError(f"the service refused key {input['key']}")


vault.output(
    {
        "sha": "${steps.call.output.sha}",
        "echo": "${steps.call.output.echo}",
        "child": "${steps.child.output.sha}",
        "ticket": "${input.ticket}",
    }
)
