"""Documents shared by the workflow tests."""

from __future__ import annotations

import copy
from typing import Any

# The contract's example (section 1), verbatim.
SUPPORT_TICKET: dict[str, Any] = {
    "id": "support_ticket",
    "version": 3,
    "description": "Classify a ticket, draft an answer, wait for approval on bugs, send.",
    "input_schema": {
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string"}},
    },
    "limits": {
        "max_steps": 50,
        "run_timeout_ms": 691200000,
        "step_timeout_ms": 60000,
        "max_cost_usd": 2.0,
    },
    "steps": [
        {"id": "classify", "kind": "task"},
        {"id": "draft", "kind": "agent", "input": {"kind": "${steps.classify.output.kind}"}},
        {
            "id": "approval",
            "kind": "wait_event",
            "event": "approved",
            "key": "${input.ticket}",
            "timeout_ms": 604800000,
            "when": {"path": "steps.classify.output.kind", "op": "eq", "value": "bug"},
        },
        {
            "id": "send",
            "kind": "task",
            "input": {"text": "${steps.draft.output}"},
            "effect": "at_most_once",
            "retry": {"max_attempts": 3, "backoff": "exponential", "initial_ms": 500},
        },
    ],
    "output": {"sent": "${steps.send.output.sent}"},
}


def support_ticket(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(SUPPORT_TICKET)
    doc.update(changes)
    return doc


# One of every kind, nested bodies included: valid, and a base to break one rule at a time.
EVERY_KIND: dict[str, Any] = {
    "id": "every_kind",
    "description": "One step of every kind.",
    "input_schema": {
        "type": "object",
        "properties": {"urls": {"type": "array"}, "ticket": {"type": "string"}},
    },
    "limits": {"max_steps": 500, "run_timeout_ms": 86400000, "max_cost_usd": 1.5},
    "steps": [
        {
            "id": "fetch",
            "kind": "http",
            "method": "GET",
            "url": "https://example.test/${input.ticket}",
        },
        {
            "id": "summarise",
            "kind": "recipe",
            "input": "${steps.fetch.output}",
            "prompt": "Summarise the page",
            "output": "json",
            # The query reads the step input, as the prompt does.
            "context": {"kb": "docs", "query": "${input.body}", "top_k": 3},
        },
        {"id": "nap", "kind": "sleep", "ms": 1000},
        {"id": "later", "kind": "sleep_until", "until": "${input.when}"},
        {
            "id": "ping",
            "kind": "wait_event",
            "event": "pinged",
            "key": "${run.id}",
            "timeout_ms": 60000,
        },
        {
            "id": "review",
            "kind": "approval",
            "approvers": {"users": ["ada"], "groups": ["ops"], "emails": ["boss@example.com"]},
            "quorum": 2,
            "timeout_ms": 3600000,
            "message": "Approve ${steps.summarise.output}?",
        },
        {
            "id": "fan",
            "kind": "parallel",
            "branches": {
                "left": {"id": "left_task", "kind": "task", "handler": "left"},
                "right": [
                    {"id": "right_a", "kind": "agent"},
                    {"id": "right_b", "kind": "task", "input": "${steps.right_a.output}"},
                ],
            },
        },
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.urls}",
            "max_items": 50,
            "concurrency": 3,
            "do": {"id": "each_get", "kind": "http", "method": "GET", "url": "${item}"},
        },
        {
            "id": "again",
            "kind": "loop",
            "max_iterations": 5,
            "do": {"id": "again_try", "kind": "task", "input": {"n": "${iter.index}"}},
            "until": {"path": "steps.again_try.output.done", "op": "eq", "value": True},
        },
        {"id": "child", "kind": "subworkflow", "workflow": "every_kind", "input": {"x": 1}},
        {
            "id": "branch",
            "kind": "condition",
            "if": {"any": [{"path": "steps.fan.output.left", "op": "exists"}]},
            "then": [
                {
                    "id": "note",
                    "kind": "write_kb",
                    "kb": "notes",
                    "key": "${run.id}",
                    "content": "done",
                }
            ],
            "else": [{"id": "tell", "kind": "handoff", "group": "ops", "message": "look"}],
        },
        {
            "id": "tool",
            "kind": "mcp_tool",
            "server": "files",
            "tool": "read",
            "arguments": {"p": "${steps.note.output.key}"},
        },
    ],
    "output": {"fan": "${steps.fan.output}", "each": "${steps.each.output.0}"},
}


def every_kind() -> dict[str, Any]:
    return copy.deepcopy(EVERY_KIND)


def support_ticket_body() -> dict[str, Any]:
    """Contract section 1 without its ``version``: what the builder and a first save write."""
    return {k: v for k, v in support_ticket().items() if k != "version"}
