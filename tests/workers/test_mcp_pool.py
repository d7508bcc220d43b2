"""The per-process MCP client pool (workers/mcp/pool.py) against real MCP servers (the SDK's
MCPServer over streamable HTTP on loopback, and over stdio): answers, errors, time-outs, the
size bound and least-recently-used eviction, idle closing and a broken client replaced, each
measured through the HTTP server's own count of open connections; and a pool used in a
parent and then in a forked child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.processes import wait_for
from tests.workers.mcp_servers import HttpMcpServer, free_port, stdio_config
from workers.mcp import pool as mcp


@pytest.fixture
def server() -> Iterator[HttpMcpServer]:
    with HttpMcpServer() as running:
        yield running


@pytest.fixture
def configure(settings) -> Any:
    def configure(servers: dict[str, Any], **knobs: Any) -> None:
        settings.DJFLOW = {**settings.DJFLOW, "MCP_SERVERS": servers, **knobs}

    return configure


@pytest.fixture
def pool() -> Iterator[mcp.Pool]:
    made = mcp.Pool()
    yield made
    made.shutdown()


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_answers_and_tool_errors_on_both_transports(
    transport: str, server: HttpMcpServer, configure: Any, pool: mcp.Pool
) -> None:
    config = {"url": server.url()} if transport == "http" else stdio_config()
    configure({"tools": config})
    assert set(pool.list_tools("tools", 10)) >= {"echo", "say", "broken", "flaky"}
    echoed = pool.call_tool("tools", "echo", {"text": "héllo"}, 10)
    assert (echoed.structured, echoed.is_error) == ({"echo": "héllo", "length": 5}, False)
    said = pool.call_tool("tools", "say", {"text": "hi"}, 10)
    assert (said.structured, said.texts) == (None, ["hi", "(2)"])
    failed = pool.call_tool("tools", "broken", {"message": "no such order"}, 10)
    assert failed.is_error and failed.texts == ["Error executing tool broken: no such order"]
    # One client served every call.
    assert pool.open_count() == 1


def test_unknown_server_and_time_out(server: HttpMcpServer, configure: Any, pool: mcp.Pool) -> None:
    configure({"tools": {"url": server.url()}})
    with pytest.raises(mcp.Unknown):
        pool.call_tool("nowhere", "echo", {}, 5)
    started = time.monotonic()
    with pytest.raises(mcp.TimedOut):
        pool.call_tool("tools", "slow", {"seconds": 5}, 0.5)
    assert time.monotonic() - started < 2
    # The timed-out client was discarded; a new one answers.
    wait_for(lambda: pool.open_count() == 0, timeout=5)
    assert pool.call_tool("tools", "echo", {"text": "x"}, 5).structured["echo"] == "x"


def test_size_bound_and_least_recently_used_first(
    server: HttpMcpServer, configure: Any, pool: mcp.Pool
) -> None:
    configure({f"p{i}": {"url": server.url(f"?n={i}")} for i in range(5)}, MCP_POOL_SIZE=3)
    for name in ("p0", "p1", "p2", "p0", "p3"):
        pool.call_tool(name, "echo", {"text": name}, 5)
    # p1 was the least recently used when p3 needed room.
    assert list(pool._held) == ["p2", "p0", "p3"]
    pool.call_tool("p4", "echo", {"text": "p4"}, 5)
    assert list(pool._held) == ["p0", "p3", "p4"]
    assert server.most_connections == 3
    wait_for(lambda: server.open_connections == 3, timeout=5)


def test_idle_clients_close(server: HttpMcpServer, configure: Any, pool: mcp.Pool) -> None:
    configure({"a": {"url": server.url()}, "b": {"url": server.url("?b")}}, MCP_IDLE_SECONDS=1.0)
    pool.call_tool("a", "echo", {"text": "a"}, 5)
    pool.call_tool("b", "echo", {"text": "b"}, 5)
    assert server.open_connections == 2
    started = time.monotonic()
    wait_for(lambda: server.open_connections == 0, timeout=5)
    assert 0.9 <= time.monotonic() - started <= 2.5
    assert pool.open_count() == 0


def test_a_client_still_opening_is_not_reaped(configure: Any, pool: mcp.Pool) -> None:
    # The reaper runs every 50 ms; starting a stdio server takes far longer.
    configure({"local": stdio_config()}, MCP_IDLE_SECONDS=0.2)
    assert pool.call_tool("local", "echo", {"text": "x"}, 10).structured["echo"] == "x"
    wait_for(lambda: pool.open_count() == 0, timeout=5)


def test_a_broken_client_is_replaced(configure: Any, pool: mcp.Pool) -> None:
    port = free_port()
    first = HttpMcpServer(port=port)
    configure({"tools": {"url": first.url()}})
    with first:
        assert pool.call_tool("tools", "echo", {"text": "1"}, 5).structured["echo"] == "1"
    with pytest.raises(mcp.Unreachable):
        pool.call_tool("tools", "echo", {"text": "2"}, 5)
    with HttpMcpServer(port=port):
        assert pool.call_tool("tools", "echo", {"text": "3"}, 5).structured["echo"] == "3"


def test_a_server_error_status_is_worth_another_try(
    server: HttpMcpServer, configure: Any, pool: mcp.Pool
) -> None:
    configure({"tools": {"url": server.url()}})
    assert pool.call_tool("tools", "echo", {"text": "up"}, 5).structured["echo"] == "up"
    server.status = 503
    with pytest.raises(mcp.Unreachable, match="it answered HTTP 503"):
        pool.call_tool("tools", "echo", {"text": "busy"}, 5)
    server.status = None
    assert pool.call_tool("tools", "echo", {"text": "back"}, 5).structured["echo"] == "back"


def test_headers_reach_the_server_and_never_show(configure: Any, pool: mcp.Pool) -> None:
    with HttpMcpServer(token="s3cr3t-t0ken") as guarded:
        configure(
            {
                "good": {"url": guarded.url(), "headers": {"Authorization": "Bearer s3cr3t-t0ken"}},
                "bad": {"url": guarded.url("?bad"), "headers": {"Authorization": "Bearer wrong"}},
            }
        )
        assert pool.call_tool("good", "echo", {"text": "in"}, 5).structured["echo"] == "in"
        with pytest.raises(mcp.Rejected) as refused:
            pool.call_tool("bad", "echo", {"text": "out"}, 5)
        assert guarded.refused >= 1
        assert str(refused.value) == "it answered HTTP 401"
        assert "wrong" not in str(refused.value) and "s3cr3t" not in str(refused.value)


def test_the_example_server_over_streamable_http(configure: Any, pool: mcp.Pool) -> None:
    port = free_port()
    command = [sys.executable, "-m", "workflows.examples.mcp_server", "--http", "--port", str(port)]
    example = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        configure({"tickets": {"url": f"http://127.0.0.1:{port}/mcp"}})

        def listed() -> list[str] | None:
            try:
                return pool.list_tools("tickets", 2)
            except mcp.Unreachable:
                return None

        assert sorted(wait_for(listed, timeout=20, interval=0.2)) == ["slugify", "ticket_stats"]
        stats = pool.call_tool("tickets", "ticket_stats", {"text": "Down again? ASAP"}, 5)
        assert stats.structured == {
            "words": 3,
            "characters": 16,
            "lines": 1,
            "questions": 1,
            "urgent": True,
        }
        slug = pool.call_tool("tickets", "slugify", {"text": "Ça marche!", "max_length": 5}, 5)
        assert (slug.structured, slug.texts) == (None, ["ca-ma"])
    finally:
        example.terminate()
        example.wait(10)


def test_a_pool_used_in_a_parent_works_in_a_forked_child(
    server: HttpMcpServer, configure: Any
) -> None:
    configure({"tools": {"url": server.url()}})
    parent = mcp.pool()
    try:
        assert parent.call_tool("tools", "echo", {"text": "parent"}, 5).structured
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (the child reports through the pipe)
            try:
                os.close(read)
                fresh = mcp.pool()
                answer = fresh.call_tool("tools", "echo", {"text": "child"}, 5)
                report = {"echo": answer.structured["echo"], "fresh": fresh is not parent}
            except BaseException as error:
                report = {"error": repr(error)}
            os.write(write, json.dumps(report).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(child, 0)
        with os.fdopen(read) as pipe:
            report = json.loads(pipe.read() or "{}")
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == {"echo": "child", "fresh": True}
        # The parent's pool was not disturbed by the child.
        assert parent.call_tool("tools", "echo", {"text": "again"}, 5).structured["echo"] == "again"
        assert parent.open_count() == 1
    finally:
        parent.shutdown()


def test_the_step_kinds_load_without_the_sdk() -> None:
    """Every worker, web process and command loads the step kinds, and so this module: the
    SDK (0.43 s of the 1.9 s a process spent importing) is loaded at the first client made
    or answer read, not with them."""
    probe = (
        "import sys, django; django.setup(); import workers.tasks, workers.kinds.mcp_tool; "
        "from workers.mcp import pool; pool.pool(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mcp', 'mcp_types'}))"
    )
    answer = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip().splitlines()[-1] == "[]"
