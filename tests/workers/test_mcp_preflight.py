"""Pre-flight of ``mcp_tool`` steps at ``POST /api/v1/runs`` (CONTRACT section 10): the named
server is configured, reachable and lists the tool, else 400 naming ``steps[i].server`` or
``steps[i].tool`` and nothing starts; the list of tools is kept briefly, and asking for it is
bounded."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runs.models import Run
from tests.workers.mcp_servers import HttpMcpServer, free_port
from workers.kinds import mcp_tool
from workers.mcp import pool as mcp
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


@pytest.fixture
def server() -> Iterator[HttpMcpServer]:
    mcp_tool.forget_listed_tools()
    with HttpMcpServer() as running:
        yield running
    mcp_tool.forget_listed_tools()
    mcp.pool().close_all()


@pytest.fixture
def configure(settings) -> Any:
    def configure(servers: dict[str, Any], **knobs: Any) -> None:
        settings.DJFLOW = {**settings.DJFLOW, "MCP_SERVERS": servers, **knobs}

    return configure


def save(*steps: dict[str, Any]) -> None:
    definition_save(document={"id": "mcp_checked", "steps": list(steps)})


def start(api: Any) -> Any:
    return api.post("/api/v1/runs", {"workflow": "mcp_checked", "input": {}}, format="json")


def step(server: str, tool: str, step_id: str = "call") -> dict[str, Any]:
    return {"id": step_id, "kind": "mcp_tool", "server": server, "tool": tool}


def test_unknown_server_and_unknown_tool_are_named(
    api: Any, server: HttpMcpServer, configure: Any
) -> None:
    configure({"tools": {"url": server.url()}})
    save(
        step("tools", "echo", "fine"),
        step("elsewhere", "echo", "lost"),
        step("tools", "fly", "wished"),
        {"id": "each", "kind": "foreach", "items": "${input.xs}", "do": step("tools", "swim", "x")},
    )
    response = start(api)
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == [
        {
            "field": "steps[1].server",
            "message": "MCP server 'elsewhere' is not configured (DJFLOW_MCP_SERVERS)",
        },
        {"field": "steps[2].tool", "message": "MCP server 'tools' lists no tool 'fly'"},
        {"field": "steps[3].do.tool", "message": "MCP server 'tools' lists no tool 'swim'"},
    ]
    assert not Run.objects.exists()


def test_an_unreachable_server_is_named_and_nothing_starts(api: Any, configure: Any) -> None:
    mcp_tool.forget_listed_tools()
    configure({"gone": {"url": f"http://127.0.0.1:{free_port()}/mcp"}})
    save(step("gone", "echo"))
    response = start(api)
    assert response.status_code == 400, response.content
    [error] = response.json()["errors"]
    assert error["field"] == "steps[0].server"
    assert error["message"].startswith("MCP server 'gone' is unreachable: ConnectError")
    assert not Run.objects.exists()


def test_a_server_that_never_answers_is_waited_for_a_bounded_time(api: Any, configure: Any) -> None:
    mcp_tool.forget_listed_tools()
    # Connections are accepted (the backlog) but never answered.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}/mcp"
        configure({"mute": {"url": url}}, MCP_PREFLIGHT_TIMEOUT_SECONDS=1.0)
        # Three steps name it: it is waited for once.
        save(*[step("mute", "echo", f"call_{n}") for n in range(3)])
        started = time.monotonic()
        response = start(api)
        took = time.monotonic() - started
    assert response.status_code == 400, response.content
    errors = response.json()["errors"]
    assert [e["field"] for e in errors] == [f"steps[{n}].server" for n in range(3)]
    assert all("unreachable" in e["message"] for e in errors)
    assert 1.0 <= took < 2.5
    mcp.pool().close_all()


def test_servers_a_start_names_are_asked_at_once_not_one_after_another(
    api: Any, configure: Any
) -> None:
    """A start (or the admin's page of a definition) waits for the slowest server it names,
    not for the sum of them: one request must not wait once per configured server."""
    mcp_tool.forget_listed_tools()
    mutes = [socket.socket() for _ in range(3)]
    try:
        for mute in mutes:
            mute.bind(("127.0.0.1", 0))
            mute.listen(8)
        configure(
            {
                f"mute{n}": {"url": f"http://127.0.0.1:{mute.getsockname()[1]}/mcp"}
                for n, mute in enumerate(mutes)
            },
            MCP_PREFLIGHT_TIMEOUT_SECONDS=1.0,
        )
        save(*[step(f"mute{n}", "echo", f"call_{n}") for n in range(3)])
        started = time.monotonic()
        response = start(api)
        took = time.monotonic() - started
    finally:
        for mute in mutes:
            mute.close()
    assert response.status_code == 400, response.content
    errors = response.json()["errors"]
    assert [e["field"] for e in errors] == [f"steps[{n}].server" for n in range(3)]
    assert all("unreachable" in e["message"] for e in errors)
    assert 1.0 <= took < 2.5, took
    mcp.pool().close_all()


def test_the_list_of_tools_is_kept_briefly(api: Any, configure: Any) -> None:
    mcp_tool.forget_listed_tools()
    port = free_port()
    configure({"tools": {"url": f"http://127.0.0.1:{port}/mcp"}}, MCP_PREFLIGHT_CACHE_SECONDS=1.0)
    save(step("tools", "echo"))
    with HttpMcpServer(port=port):
        assert start(api).status_code == 201
    mcp.pool().close_all()
    # The server is gone, but its list is still fresh: the start goes ahead (the step would
    # find out, and retry).
    assert start(api).status_code == 201
    time.sleep(1.1)
    refused = start(api)
    assert refused.status_code == 400, refused.content
    assert "unreachable" in refused.json()["errors"][0]["message"]
