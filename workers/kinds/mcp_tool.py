"""``mcp_tool``: a worker calls ``tool`` on the configured MCP ``server`` with ``arguments``
through the official ``mcp`` SDK, and answers the tool's structured content, else its text
(CONTRACT section 10, "MCP tools").

Invariants:

- The attempt's stored input is the call as made: :func:`prepare` (the planner, pure)
  resolves ``arguments`` afresh for every attempt into ``{"server", "tool", "arguments"}``;
  arguments that resolve to anything but an object (or null: no arguments) fail the attempt
  with class ``invalid_input`` naming ``arguments``. The step's ``input`` plays no part.
- The call goes through the process's pool of clients (``workers.mcp.pool``) and ends a
  little inside the attempt's ``timeout_ms`` (a second is kept for recording it), so a slow
  server fails the attempt ``retryable`` before the worker's own alarm would end it.
- Classes: a server not in ``DJFLOW_MCP_SERVERS`` is ``fatal``, naming it; a server that
  cannot be reached, a broken connection and a time-out are ``retryable``; a protocol error
  the server answers (arguments its schema refuses, say) is ``fatal``. A tool result with
  ``isError`` is ``fatal``, unless the tool says it is worth another try: ``"retryable":
  true`` in the result's ``_meta`` or in its structured content (then ``retry_after_ms``
  beside it, an integer of milliseconds, is honoured, at most an hour).
- Every call made is recorded on the attempt (``runs.models.ToolCall``: server, tool,
  arguments, result, status, latency), in the transaction that records the attempt; what it
  sent and got is stored with the run's secrets as their tokens.
- Messages name the server and the tool, never a header of the server's configuration (they
  hold credentials) nor its URL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from runs.engine import calls
from runs.engine.plan import MAX_VALUE_BYTES
from workflows.failures import StepFailure
from workflows.kinds import Kind, PreflightScope, Refused, Role, Scope, register
from workflows.templates import TooLarge, check_size

from ..context import StepContext
from ..mcp import pool as mcp
from .http import _clean, _type_name

RETRY_AFTER_CAP_MS = 3_600_000
# Time kept back from the attempt's deadline for recording the call after it.
_RECORD_SECONDS = 1.0
# The most of a failed tool's text an error message quotes.
_ERROR_TEXT_CHARS = 500


# --- the planner's half (pure) ---------------------------------------------------------------


def prepare(step: Mapping[str, Any], scope: Scope) -> dict[str, Any]:
    arguments = scope.resolve(step["arguments"], "arguments") if "arguments" in step else None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise Refused(f"arguments: resolved to {_type_name(arguments)}, not an object")
    return {"server": step["server"], "tool": step["tool"], "arguments": arguments}


# --- pre-flight (the web process, at POST /runs) --------------------------------------------

_listed_lock = threading.Lock()
# server -> (when the answer goes stale, monotonic; the tools it listed, or why it could not)
_listed: dict[str, tuple[float, frozenset[str] | str]] = {}
# How long a server that could not be asked stays so: a start naming it in several steps, or
# starts in quick succession, wait for it once, not each time (it may be back soon, though).
_UNREACHABLE_SECONDS = 5.0


def preflight(step: Mapping[str, Any], scope: PreflightScope) -> list[tuple[str, str]]:
    """The named server is configured and reachable, and lists the tool. A server's list of
    tools is kept ``DJFLOW_MCP_PREFLIGHT_CACHE_SECONDS`` (that it could not be reached, at most
    5 s); asking for it waits at most ``DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS`` (a start must
    not hang on a server). The first step's check asks every configured server the document
    names at once, so a start waits that long once, however many servers it names."""
    server, tool = str(step.get("server")), str(step.get("tool"))
    if server not in mcp.servers():
        return [("server", f"MCP server '{server}' is not configured (DJFLOW_MCP_SERVERS)")]
    tools = _tools_for_start(server, scope)
    if isinstance(tools, str):
        return [("server", f"MCP server '{server}' is unreachable: {tools}")]
    if tool not in tools:
        return [("tool", f"MCP server '{server}' lists no tool '{tool}'")]
    return []


def _tools_for_start(server: str, scope: PreflightScope) -> frozenset[str] | str:
    """The tools ``server`` lists, or why it could not be asked, learnt once per start for
    every configured server the document names (``scope.memo``)."""
    listed: dict[str, frozenset[str] | str] = scope.memo.setdefault("mcp_tool", {})
    if server not in listed:
        named = {str(other.get("server")) for other in scope.every_of("mcp_tool")} | {server}
        configured = mcp.servers()
        listed.update(_tools_of([n for n in sorted(named) if n in configured and n not in listed]))
    return listed[server]


def _tools_of(servers: list[str]) -> dict[str, frozenset[str] | str]:
    """The tools each of ``servers`` lists, or why it could not be asked; the ones not in the
    cache asked at once, within one time-out."""
    answers: dict[str, frozenset[str] | str] = {}
    now = time.monotonic()
    with _listed_lock:
        for server in servers:
            cached = _listed.get(server)
            if cached is not None and cached[0] > now:
                answers[server] = cached[1]
    missing = [server for server in servers if server not in answers]
    if not missing:
        return answers
    ttl = float(settings.DJFLOW["MCP_PREFLIGHT_CACHE_SECONDS"])
    timeout = float(settings.DJFLOW["MCP_PREFLIGHT_TIMEOUT_SECONDS"])
    try:
        asked = mcp.pool().list_tools_of(missing, timeout)
    except mcp.TimedOut as error:
        asked = dict.fromkeys(missing, error)
    for server in missing:
        answer = asked[server]
        if isinstance(answer, (mcp.Unreachable, mcp.TimedOut, mcp.Rejected)):
            answers[server], lasts = str(answer), min(ttl, _UNREACHABLE_SECONDS)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            answers[server], lasts = frozenset(answer), ttl
        with _listed_lock:
            _listed[server] = (time.monotonic() + lasts, answers[server])
    return answers


def forget_listed_tools() -> None:
    """Drop the cached lists of tools (tests that change a server's tools)."""
    with _listed_lock:
        _listed.clear()


# --- the worker's half -----------------------------------------------------------------------


def mcp_tool_body(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any]:
    """Every worker can run an mcp_tool step (no handler to have)."""
    return call


def call(ctx: StepContext, given: Any, prior: Any = None) -> Any:
    if not isinstance(given, Mapping) or not isinstance(given.get("arguments"), Mapping):
        raise StepFailure("mcp_tool: the attempt's input is not a prepared call", "fatal")
    server, tool = str(given["server"]), str(given["tool"])
    arguments = dict(given["arguments"])
    if server not in mcp.servers():
        raise StepFailure(
            f"mcp_tool: MCP server '{server}' is not configured (DJFLOW_MCP_SERVERS)", "fatal"
        )
    seconds = _seconds_left(ctx)
    with ctx.span("mcp_tool", "client", server=server, tool=tool) as span:
        started = time.monotonic()

        def made(status: str, result: Any = None, error: dict[str, Any] | None = None) -> None:
            ctx.tool_calls.append(
                calls.ToolUse(
                    step_run_id=ctx.step_run_id,
                    run_id=ctx.run_id,
                    server=server,
                    tool=tool,
                    arguments=ctx.conceal(arguments),
                    result=ctx.conceal(result) if result is not None else None,
                    status=status,
                    error=ctx.conceal(error) if error is not None else None,
                    latency_ms=int((time.monotonic() - started) * 1000),
                )
            )

        try:
            answer = mcp.pool().call_tool(server, tool, arguments, seconds)
        except mcp.TooLarge as too_large:
            message = f"mcp_tool: the result of {tool} on MCP server '{server}' is {too_large}"
            made("invalid_input", error={"class": "invalid_input", "message": message})
            raise StepFailure(message, "invalid_input") from None
        except (mcp.Unreachable, mcp.TimedOut, mcp.Rejected, mcp.Unknown) as error:
            failure = _failure(server, tool, error)
            made(
                failure.error_class,
                error={"class": failure.error_class, "message": failure.message},
            )
            raise failure from None
        except BaseException as interrupted:
            # The attempt's time limit (SIGALRM) or anything else cut the call short.
            made(
                "interrupted", error={"class": "interrupted", "message": type(interrupted).__name__}
            )
            raise
        text = "\n".join(answer.texts)
        result = _recorded(answer, text)
        try:
            check_size(result, MAX_VALUE_BYTES)
        except TooLarge as too_large:
            # Neither passed on nor stored: the journal keeps values of at most 1 MiB.
            message = f"mcp_tool: the result of {tool} on MCP server '{server}' is {too_large}"
            made("invalid_input", error={"class": "invalid_input", "message": message})
            raise StepFailure(message, "invalid_input") from None
        if answer.is_error:
            failure = _tool_failed(server, tool, answer, text)
            made(
                failure.error_class,
                result,
                {"class": failure.error_class, "message": failure.message},
            )
            span.set_attribute("is_error", True)
            raise failure
        made("ok", result)
    return result["structured"] if "structured" in result else result["text"]


def _recorded(answer: mcp.ToolResult, text: str) -> dict[str, Any]:
    """What is kept of an answer: its structured content, else its text (the text of a
    failed call too: it says why), with NUL and lone surrogates replaced (jsonb refuses
    them)."""
    result: dict[str, Any] = {"is_error": answer.is_error}
    if answer.structured is not None:
        result["structured"] = _clean(answer.structured)
    if answer.structured is None or answer.is_error:
        result["text"] = _clean(text)
    return result


def _failure(server: str, tool: str, error: BaseException) -> StepFailure:
    where = f"mcp_tool: {tool} on MCP server '{server}'"
    if isinstance(error, mcp.Unknown):
        return StepFailure(
            f"mcp_tool: MCP server '{server}' is not configured (DJFLOW_MCP_SERVERS)", "fatal"
        )
    if isinstance(error, mcp.Unreachable):
        return StepFailure(f"{where}: the server is unreachable: {error}", "retryable")
    if isinstance(error, mcp.TimedOut):
        return StepFailure(f"{where}: timed out: {error}", "retryable")
    return StepFailure(f"{where}: the server refused the call: {error}", "fatal")


def _tool_failed(server: str, tool: str, answer: mcp.ToolResult, text: str) -> StepFailure:
    said = text[:_ERROR_TEXT_CHARS] or "(no text)"
    message = f"mcp_tool: {tool} on MCP server '{server}' failed: {said}"
    hint: Mapping[str, Any] = answer.meta
    if hint.get("retryable") is not True and isinstance(answer.structured, Mapping):
        hint = answer.structured
    if hint.get("retryable") is not True:
        return StepFailure(message, "fatal")
    wait = hint.get("retry_after_ms")
    if not isinstance(wait, int) or isinstance(wait, bool):
        wait = None
    else:
        wait = max(0, min(wait, RETRY_AFTER_CAP_MS))
    return StepFailure(message, "retryable", retry_after_ms=wait)


def _seconds_left(ctx: StepContext) -> float:
    if ctx.deadline_at is None:
        return 60.0
    left = (ctx.deadline_at - datetime.now(UTC)).total_seconds() - _RECORD_SECONDS
    return max(left, 0.5)


MCP_TOOL = register(
    Kind(
        "mcp_tool",
        Role.WORKER,
        max_attempts=3,
        prepare=prepare,
        preflight=preflight,
        body=mcp_tool_body,
    )
)
