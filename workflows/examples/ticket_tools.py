"""An MCP example (CONTRACT section 10, "MCP tools"): two ``mcp_tool`` steps call the bundled
example server (``workflows.examples.mcp_server``) on a ticket: ``ticket_stats`` answers
structured content, which a condition reads; ``slugify`` answers text.

It needs the server configured as ``tickets`` in ``DJFLOW_MCP_SERVERS``, over stdio::

    DJFLOW_MCP_SERVERS='{"tickets": {"command": [".venv/bin/python", "-m",
        "workflows.examples.mcp_server"]}}'

(or over streamable HTTP: ``{"tickets": {"url": "http://127.0.0.1:8765/mcp"}}``), on the
workers and on the web (a start checks that the server lists both tools). Load it with
``WORKFLOW_MODULES=workflows.examples.ticket_tools``.
"""

from __future__ import annotations

from workflows.sdk import mcp_tool, when, workflow

tools = workflow(
    "ticket_tools",
    description="MCP tools measure a ticket and name it; urgent tickets are flagged.",
    input_schema={
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string", "minLength": 1, "maxLength": 20000}},
    },
    limits={"max_steps": 20, "run_timeout_ms": 120_000},
)

tools.mcp_tool(
    "stats", server="tickets", tool="ticket_stats", arguments={"text": "${input.ticket}"}
)
tools.mcp_tool(
    "slug",
    server="tickets",
    tool="slugify",
    arguments={"text": "${input.ticket}", "max_length": 40},
)
tools.condition(
    "triage",
    if_=when("steps.stats.output.urgent", "eq", True),
    then=[
        mcp_tool(
            "urgent_slug",
            server="tickets",
            tool="slugify",
            arguments={"text": "urgent ${steps.slug.output}"},
        )
    ],
)
tools.output(
    {
        "stats": "${steps.stats.output}",
        "slug": "${steps.slug.output}",
        "urgent_slug": "${steps.urgent_slug.output}",
    }
)
