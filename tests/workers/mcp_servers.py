"""MCP servers for the tests, built on the official SDK's ``MCPServer``: one tool set, served
over streamable HTTP by uvicorn on a free loopback port in a thread of the test process
(:class:`HttpMcpServer`, which counts its own open TCP connections), or over stdio
(``python -m tests.workers.mcp_servers``, :func:`stdio_config`).

Nothing here imports Django: the stdio server runs in a process of its own.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel
from uvicorn.protocols.http.h11_impl import H11Protocol

BASE_DIR = Path(__file__).resolve().parent.parent.parent


class Echoed(BaseModel):
    echo: str
    length: int


def build(calls: Counter[str] | None = None) -> MCPServer:
    """The tools: ``echo`` (structured), ``say`` (text only), ``broken`` (a tool error),
    ``flaky`` (a retryable tool error on the first call of a key), ``hang_once`` (hangs on
    the first call of a key), ``slow`` (sleeps)."""
    server = MCPServer("djflow-tests")
    counts = calls if calls is not None else Counter()

    @server.tool()
    def echo(text: str) -> Echoed:
        """Echo the text, with its length."""
        counts["echo"] += 1
        return Echoed(echo=text, length=len(text))

    @server.tool(structured_output=False)
    def say(text: str) -> list[TextContent]:
        """Two text parts: the text, then its length."""
        counts["say"] += 1
        return [
            TextContent(type="text", text=text),
            TextContent(type="text", text=f"({len(text)})"),
        ]

    @server.tool()
    def broken(message: str) -> str:
        """Always fails, with the message."""
        counts["broken"] += 1
        raise ToolError(message)

    @server.tool()
    def flaky(key: str) -> CallToolResult:
        """Fails, saying it is worth another try, on the first call of a key."""
        counts[f"flaky:{key}"] += 1
        if counts[f"flaky:{key}"] == 1:
            return CallToolResult(
                content=[TextContent(type="text", text="busy, try again")],
                is_error=True,
                _meta={"retryable": True, "retry_after_ms": 0},
            )
        return CallToolResult(
            content=[TextContent(type="text", text="done")],
            structured_content={"key": key, "calls": counts[f"flaky:{key}"]},
        )

    @server.tool()
    async def hang_once(key: str) -> dict[str, Any]:
        """Hangs (a minute) on the first call of a key; answers the later ones."""
        counts[f"hang_once:{key}"] += 1
        if counts[f"hang_once:{key}"] == 1:
            await asyncio.sleep(60)
        return {"key": key, "calls": counts[f"hang_once:{key}"]}

    @server.tool(structured_output=False)
    def big(size: int) -> str:
        """A text of ``size`` characters."""
        counts["big"] += 1
        return "x" * size

    @server.tool()
    async def slow(seconds: float) -> dict[str, Any]:
        counts["slow"] += 1
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpMcpServer:
    """The tools over streamable HTTP, on ``127.0.0.1:<free port>/mcp``, in a daemon thread.

    ``open_connections`` and ``most_connections`` are the server's own count of TCP
    connections (uvicorn's protocol instances made and lost). Keep-alive is held for ten
    minutes, so a connection closes because its client closed it, not because the server
    timed it out.
    """

    def __init__(self, token: str | None = None, port: int | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.refused = 0
        self.port = port or free_port()
        self.open_connections = 0
        self.most_connections = 0
        self._lock = threading.Lock()
        counting = self

        class Counting(H11Protocol):
            def connection_made(self, transport: Any) -> None:  # type: ignore[override]
                with counting._lock:
                    counting.open_connections += 1
                    counting.most_connections = max(
                        counting.most_connections, counting.open_connections
                    )
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                with counting._lock:
                    counting.open_connections -= 1
                super().connection_lost(exc)

        app = build(self.calls).streamable_http_app(
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
        )
        # An HTTP status every request is answered with instead of MCP (None: MCP).
        self.status: int | None = None
        app = self._guarded(app, f"Bearer {token}" if token is not None else None)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            http=Counting,
            timeout_keep_alive=600,
            log_level="warning",
            lifespan="on",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, daemon=True, name="mcp-test-server"
        )

    def _guarded(self, app: Any, authorization: str | None) -> Any:
        """``app`` behind a check of the Authorization header (401 without it), answering
        ``self.status`` instead when it is set."""

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                sent = dict(scope["headers"]).get(b"authorization", b"").decode()
                status = self.status
                if status is None and authorization is not None and sent != authorization:
                    self.refused += 1
                    status = 401
                if status is not None:
                    await send({"type": "http.response.start", "status": status, "headers": []})
                    await send({"type": "http.response.body", "body": b"not now"})
                    return
            await app(scope, receive, send)

        return guarded

    def url(self, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/mcp{query}"

    def reset_most(self) -> None:
        with self._lock:
            self.most_connections = self.open_connections

    def __enter__(self) -> HttpMcpServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def stdio_config() -> dict[str, Any]:
    """A ``DJFLOW_MCP_SERVERS`` entry that starts these tools over stdio."""
    return {
        "command": [sys.executable, "-m", "tests.workers.mcp_servers"],
        # The server process gets only the SDK's safe variables and these.
        "env": {"PYTHONPATH": str(BASE_DIR)},
    }


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    build().run()
