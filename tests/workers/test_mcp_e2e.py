"""``mcp_tool`` steps on real worker processes, calling real MCP servers (the SDK's
``MCPServer``): over streamable HTTP (uvicorn on loopback, in a thread of this process, which
counts its own TCP connections) and over stdio (a process the worker starts).

The web side (this process: pre-flight at the start) and the workers are configured apart
where a test needs a server to differ between them: a server the start found reachable but
the worker cannot reach, one the worker does not know at all, and the 25 servers of the pool
test, which point the worker at a second HTTP server so its connection count is the worker's
pool alone.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import pytest
from django.conf import settings

from runs import services
from runs.models import Run, StepRun, ToolCall
from tests.processes import wait_for
from tests.workers.mcp_servers import HttpMcpServer, free_port, stdio_config
from workers.kinds import mcp_tool
from workers.mcp import pool as mcp
from workflows.services import definition_save

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
NO_WAIT = {"max_attempts": 3, "backoff": "none"}
# Quick recovery for the kill test: a lost lease is noticed within a few seconds.
KNOBS = {
    "DJFLOW_LEASE_SECONDS": "3",
    "DJFLOW_RECONCILE_SECONDS": "2",
    "DJFLOW_LOST_MESSAGE_SECONDS": "2",
    "DJFLOW_DEADLINE_GRACE_SECONDS": "2",
    # An at_most_once call lost with its worker is in doubt this long, then fails.
    "DJFLOW_IN_DOUBT_SECONDS": "3",
}


@pytest.fixture(autouse=True)
def fresh_preflight() -> Any:
    mcp_tool.forget_listed_tools()
    yield
    mcp_tool.forget_listed_tools()
    mcp.pool().close_all()


def web_servers(monkeypatch: pytest.MonkeyPatch, servers: dict[str, Any]) -> None:
    """The servers this process (the web side: pre-flight at a start) is configured with."""
    monkeypatch.setitem(settings.DJFLOW, "MCP_SERVERS", servers)


def worker_env(servers: dict[str, Any], **more: str) -> dict[str, str]:
    return {"DJFLOW_MCP_SERVERS": json.dumps(servers), **more}


def finished(run_id: Any, logs: Any, timeout: float = 40.0) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def save(workflow_id: str, *steps: dict[str, Any], **document: Any) -> None:
    definition_save(
        document={
            "id": workflow_id,
            "limits": {"run_timeout_ms": 120_000, "max_steps": 200},
            "steps": list(steps),
            **document,
        }
    )


def start(workflow_id: str, input: Any = None) -> Run:
    return services.run_start(workflow=workflow_id, input=input).run


def attempts(run: Run, step_id: str) -> list[StepRun]:
    return list(run.steps.filter(step_id=step_id).order_by("attempt"))


def tool(
    step_id: str, server: str, name: str, arguments: Any = None, **more: Any
) -> dict[str, Any]:
    step = {"id": step_id, "kind": "mcp_tool", "server": server, "tool": name, **more}
    if arguments is not None:
        step["arguments"] = arguments
    return step


def test_tool_calls_answers_errors_and_retries(
    celery_worker, celery_processes, monkeypatch, api
) -> None:
    with HttpMcpServer() as server:
        live = {"url": server.url()}
        example = {"command": [sys.executable, "-m", "workflows.examples.mcp_server"]}
        web_servers(
            monkeypatch,
            {"web": live, "local": stdio_config(), "down": live, "ghost": live, "tickets": example},
        )
        celery_worker(
            env=worker_env(
                {
                    "web": live,
                    "local": stdio_config(),
                    # Reachable at the start (pre-flight), not from the worker.
                    "down": {"url": f"http://127.0.0.1:{free_port()}/mcp"},
                    "tickets": example,
                }
            ),
            workflow_modules=["workflows.examples.ticket_tools"],
            concurrency=1,
        )
        logs = celery_processes.logs

        # 1. Structured content over HTTP; the attempt shows the arguments as resolved.
        secret_schema = {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "key": {"type": "string", "writeOnly": True},
            },
        }
        save(
            "mcp_structured",
            tool("ask", "web", "echo", {"text": "${input.text} ${input.key}"}),
            input_schema=secret_schema,
        )
        run = finished(start("mcp_structured", {"text": "hello", "key": "k-123"}).id, logs)
        assert run.status == "completed", run.error
        [attempt] = attempts(run, "ask")
        # The tool got the secret's value (11 characters); the journal keeps its token.
        assert attempt.output["length"] == 11
        assert attempt.output["echo"].startswith("hello [secret:")
        assert attempt.input["server"] == "web" and attempt.input["tool"] == "echo"
        [call] = ToolCall.objects.filter(step_run=attempt).select_related("arguments", "result")
        assert (call.server, call.tool, call.status, call.error) == ("web", "echo", "ok", None)
        assert call.latency_ms >= 0
        # The run's secret is stored as its token, in what was sent and what came back.
        assert "k-123" not in json.dumps(call.arguments.body)
        assert call.arguments.body["text"].startswith("hello [secret:")
        assert "k-123" not in json.dumps(call.result.body)
        assert call.result.body["structured"]["length"] == 11
        # The run's resource lists the call, without its bodies, the secret masked.
        body = api.get(f"/api/v1/runs/{run.id}").json()
        [listed] = next(s for s in body["steps"] if s["step_id"] == "ask")["tool_calls"]
        assert (listed["server"], listed["tool"], listed["status"]) == ("web", "echo", "ok")
        assert listed["arguments_digest"] == call.arguments_id and listed["result_size"] > 0
        assert "k-123" not in json.dumps(body)

        # 2. Text only, over stdio: the text parts joined.
        save("mcp_text", tool("say", "local", "say", {"text": "hi"}))
        run = finished(start("mcp_text").id, logs)
        assert run.status == "completed", run.error
        assert run.output == "hi\n(2)"

        # 3. A tool error: fatal, never retried; recorded with what the tool said.
        save("mcp_broken", tool("bad", "web", "broken", {"message": "order 7 not found"}))
        run = finished(start("mcp_broken").id, logs)
        assert (run.status, run.error["class"]) == ("failed", "fatal"), run.error
        assert run.error["message"] == (
            "mcp_tool: broken on MCP server 'web' failed: "
            "Error executing tool broken: order 7 not found"
        )
        [failed] = attempts(run, "bad")
        assert failed.tool_calls.get().status == "fatal"
        assert server.calls["broken"] == 1

        # 4. A tool error the tool calls retryable (_meta): tried again, then answered.
        save("mcp_flaky", tool("try", "web", "flaky", {"key": "f1"}, retry=NO_WAIT))
        run = finished(start("mcp_flaky").id, logs)
        assert run.status == "completed", run.error
        first, second = attempts(run, "try")
        assert (first.status, first.error["class"], first.error["retry_after_ms"]) == (
            "failed",
            "retryable",
            0,
        )
        assert second.output == {"key": "f1", "calls": 2}

        # 5. A server the worker cannot reach: retried (3 attempts), then fails naming it.
        save("mcp_down", tool("call", "down", "echo", {"text": "x"}, retry=NO_WAIT))
        run = finished(start("mcp_down").id, logs)
        assert (run.status, run.error["class"]) == ("failed", "retryable"), run.error
        assert run.error["message"].startswith(
            "mcp_tool: echo on MCP server 'down': the server is unreachable: ConnectError"
        )
        assert [a.error["class"] for a in attempts(run, "call")] == ["retryable"] * 3

        # 6. A server the worker does not know: fatal, naming it.
        save("mcp_ghost", tool("call", "ghost", "echo", {"text": "x"}, retry=NO_WAIT))
        run = finished(start("mcp_ghost").id, logs)
        assert (run.status, run.error["class"]) == ("failed", "fatal"), run.error
        assert run.error["message"] == (
            "mcp_tool: MCP server 'ghost' is not configured (DJFLOW_MCP_SERVERS)"
        )
        assert len(attempts(run, "call")) == 1

        # 7. Arguments that resolve to no object: invalid_input naming the field.
        save("mcp_args", tool("call", "web", "echo", "${input.list}"))
        run = finished(start("mcp_args", {"list": [1]}).id, logs)
        assert (run.status, run.error["class"]) == ("failed", "invalid_input"), run.error
        assert "arguments: resolved to an array, not an object" in run.error["message"]

        # 8. The example: the bundled server over stdio, its structured answer read by a
        # condition.
        ticket = "The export crashes on big files. Can you fix it?"
        run = finished(start("ticket_tools", {"ticket": ticket}).id, logs)
        assert run.status == "completed", run.error
        assert run.output == {
            "stats": {"words": 10, "characters": 48, "lines": 1, "questions": 1, "urgent": True},
            "slug": "the-export-crashes-on-big-files-can-you",
            "urgent_slug": "urgent-the-export-crashes-on-big-files-can-you",
        }


def test_the_pool_holds_at_most_20_clients_and_closes_idle_ones(
    celery_worker, celery_processes, monkeypatch
) -> None:
    names = [f"p{i}" for i in range(25)]
    with HttpMcpServer() as for_preflight, HttpMcpServer() as measured:
        web_servers(monkeypatch, {n: {"url": for_preflight.url(f"?{n}")} for n in names})
        idle = 4.0
        celery_worker(
            env=worker_env(
                {n: {"url": measured.url(f"?{n}")} for n in names},
                DJFLOW_MCP_IDLE_SECONDS=str(idle),
            ),
            # One worker process: one pool.
            concurrency=1,
        )
        logs = celery_processes.logs
        save("mcp_many", *[tool(f"s_{n}", n, "echo", {"text": n}) for n in names])
        run = finished(start("mcp_many").id, logs, timeout=60)
        assert run.status == "completed", run.error
        assert measured.calls["echo"] == 25
        # The pool kept its clients open between calls, up to its bound, never past it.
        assert measured.most_connections == 20, measured.most_connections
        finished_at = max(s.finished_at for s in run.steps.all())
        wait_for(lambda: measured.open_connections == 0, timeout=idle + 10, message=logs)
        from django.utils import timezone

        assert (timezone.now() - finished_at).total_seconds() >= idle - 0.5


def test_a_worker_killed_mid_call(
    celery_worker, celery_beat, celery_processes, monkeypatch
) -> None:
    with HttpMcpServer() as server:
        servers = {"web": {"url": server.url()}}
        web_servers(monkeypatch, servers)
        env = worker_env(servers, **KNOBS)
        doomed = celery_worker(env=env, concurrency=2)
        celery_beat(env=KNOBS)
        logs = celery_processes.logs
        save("mcp_again", tool("call", "web", "hang_once", {"key": "again"}))
        save(
            "mcp_once",
            tool("call", "web", "hang_once", {"key": "once"}, effect="at_most_once"),
        )
        again, once = start("mcp_again"), start("mcp_once")
        wait_for(
            lambda: server.calls["hang_once:again"] == 1 and server.calls["hang_once:once"] == 1,
            timeout=20,
            message=logs,
        )
        doomed.kill(signal.SIGKILL)
        celery_worker(env=env, concurrency=1)
        # at_least_once: the lost attempt is offered again, and the tool answers this time.
        again = finished(again.id, logs, timeout=60)
        assert again.status == "completed", again.error
        lost, second = attempts(again, "call")
        assert lost.error["class"] == "lost"
        assert second.output == {"key": "again", "calls": 2}
        # at_most_once: it may have acted; it is in doubt instead of running twice, and its
        # deadline (DJFLOW_IN_DOUBT_SECONDS, nobody resolving it) fails it.
        once = finished(once.id, logs, timeout=60)
        assert (once.status, once.error["class"]) == ("failed", "in_doubt"), once.error
        assert server.calls["hang_once:once"] == 1
