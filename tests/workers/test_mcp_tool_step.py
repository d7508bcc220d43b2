"""The ``mcp_tool`` body in this process (the worker's half without a worker): what it
answers and records for a result too large to keep, and for a text-only answer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.workers.mcp_servers import HttpMcpServer
from workers.context import StepContext
from workers.kinds import mcp_tool
from workers.mcp import pool as mcp
from workflows.failures import StepFailure


@pytest.fixture
def server(settings) -> Iterator[HttpMcpServer]:
    with HttpMcpServer() as running:
        settings.DJFLOW = {**settings.DJFLOW, "MCP_SERVERS": {"web": {"url": running.url()}}}
        yield running
    mcp.pool().close_all()


def context() -> StepContext:
    return StepContext(
        run_id="r",
        step_id="call",
        attempt=1,
        idempotency_key="k",
        workflow_id="w",
        logger=logging.LoggerAdapter(logging.getLogger("test"), {}),
        step_run_id=7,
    )


def given(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"server": "web", "tool": tool, "arguments": arguments}


def test_a_text_answer_is_the_output_and_is_recorded(server: HttpMcpServer) -> None:
    ctx = context()
    assert mcp_tool.call(ctx, given("say", {"text": "hi"})) == "hi\n(2)"
    [use] = ctx.tool_calls
    assert (use.server, use.tool, use.status, use.step_run_id) == ("web", "say", "ok", 7)
    assert use.arguments == {"text": "hi"}
    assert use.result == {"is_error": False, "text": "hi\n(2)"}


def test_a_result_over_a_mib_fails_and_is_not_stored(server: HttpMcpServer) -> None:
    ctx = context()
    with pytest.raises(StepFailure) as failed:
        mcp_tool.call(ctx, given("big", {"size": 1_100_000}))
    assert failed.value.error_class == "invalid_input"
    assert failed.value.message.startswith(
        "mcp_tool: the result of big on MCP server 'web' is over 1048576 bytes as JSON"
    )
    [use] = ctx.tool_calls
    assert (use.status, use.result) == ("invalid_input", None)
    # Just under the bound passes.
    assert len(mcp_tool.call(context(), given("big", {"size": 1_000_000}))) == 1_000_000


def test_arguments_must_resolve_to_an_object() -> None:
    class Scope:
        def resolve(self, template: Any, field: str) -> Any:
            return template

    step = {"id": "s", "kind": "mcp_tool", "server": "a", "tool": "t"}
    assert mcp_tool.prepare(step, Scope())["arguments"] == {}  # type: ignore[arg-type]
    with pytest.raises(mcp_tool.Refused, match="arguments: resolved to a string, not an object"):
        mcp_tool.prepare({**step, "arguments": "x"}, Scope())  # type: ignore[arg-type]


def test_a_response_past_the_read_bound_is_not_read_whole(server: HttpMcpServer) -> None:
    """The 1 MiB bound on a result is checked on what was read; the read itself is bounded
    too (``pool.MAX_RESPONSE_BYTES``), or a server answering a gigabyte would have the worker
    hold it all (and more, parsed) before refusing it."""
    ctx = context()
    with pytest.raises(StepFailure) as failed:
        mcp_tool.call(ctx, given("big", {"size": mcp.MAX_RESPONSE_BYTES + 1}))
    assert failed.value.error_class == "invalid_input"
    assert failed.value.message == (
        "mcp_tool: the result of big on MCP server 'web' is over "
        f"{mcp.MAX_RESPONSE_BYTES} bytes: not read further"
    )
    [use] = ctx.tool_calls
    assert (use.status, use.result) == ("invalid_input", None)
    # The client stays usable.
    assert mcp_tool.call(context(), given("say", {"text": "hi"})) == "hi\n(2)"
