"""A per-process pool of MCP clients (CONTRACT section 10, "MCP tools").

MCP sessions belong to the event loop that made them (the SDK is anyio: its task groups and
streams are bound to one loop, and a client's task group must be left by the task that
entered it). So each process keeps ONE event loop, run by a daemon thread, made on first use;
synchronous callers (a step's body, pre-flight in a web request) hand it coroutines with
``asyncio.run_coroutine_threadsafe`` and wait a bounded time. Nothing runs ``asyncio.run()``
per call: a client outlives the call that opened it. Measured here (a tool answering at
once, loopback): a pooled call takes 2.1 ms (p50) over streamable HTTP and 1.4 ms over stdio;
a new client per call (``asyncio.run``) took 31 ms and 852 ms (the stdio server's start).

Invariants:

- At most ``DJFLOW_MCP_POOL_SIZE`` clients are open at once in a process (20 by default).
  Opening one more first closes the least recently used client no call is using; when every
  open client is in use, the opener waits (within its own time bound) for one to be free.
- A client no call has used for ``DJFLOW_MCP_IDLE_SECONDS`` (60 by default) is closed by the
  loop's reaper.
- A client whose call failed on its connection (refused, reset, a closed stream, a stdio
  server that exited, a time-out) is discarded: the next use opens a new one. It leaves the
  count at once and is closed in the background (its connection is likely gone already);
  a client closed to make room is closed before the new one opens.
- Each client lives in a task of its own (:class:`_Held`), which enters the SDK's ``Client``
  and leaves it again when told to close: entering and leaving happen in one task, as anyio
  requires.
- After ``fork()`` the child starts with no loop and no clients (``os.register_at_fork``):
  a prefork Celery child (or a gunicorn worker) must never touch its parent's loop, whose
  thread does not exist in it, nor its parent's connections. What the parent had open is
  kept referenced in the child, never closed there: closing would act on the parent's
  sockets and pipes from a loop that is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import httpx2
from django.conf import settings

if TYPE_CHECKING:
    from mcp import Client
    from mcp_types import CallToolResult

# The SDK (``mcp``, ``mcp_types``) is imported where a client is made or an answer read, not
# here: it took 0.43 s of the 1.9 s every worker, web process and command spends importing
# (``python -X importtime``), since the step kinds load this module, and most never call a
# tool.

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Time a closing client gets to shut down (a stdio server is sent EOF, then terminated).
_CLOSE_SECONDS = 5.0
# The most of one JSON response over streamable HTTP a client reads: a result is kept only up
# to 1 MiB as JSON (``workers.kinds.mcp_tool``), and the SDK reads a JSON response whole
# before parsing it; this leaves room for the envelope and escapes. (An SSE event the SDK
# bounds itself, at 1 MiB.)
MAX_RESPONSE_BYTES = 4 * 1_048_576


class Unknown(LookupError):
    """The server is not in ``DJFLOW_MCP_SERVERS``."""


class Unreachable(Exception):
    """The server could not be reached, or the connection broke: worth another try."""


class TimedOut(Exception):
    """The exchange did not end in the time it was given."""


class Rejected(Exception):
    """The server answered with a protocol error (bad arguments, an unknown method): the same
    call would be refused again."""


class TooLarge(Exception):
    """The server's response was longer than ``MAX_RESPONSE_BYTES``: not read further."""


class _ResponseTooLarge(httpx2.StreamError):
    # A StreamError: the SDK turns it into the request's error instead of hanging the call.
    pass


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, on_over: Callable[[], None]):
        self._inner, self._limit, self._on_over = inner, limit, on_over

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                self._on_over()
                raise _ResponseTooLarge(f"the response is over {self._limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedTransport(httpx2.AsyncBaseTransport):
    """Reads at most ``MAX_RESPONSE_BYTES`` of a JSON response (the SDK reads one whole);
    event streams are left to the SDK's own bound on an event."""

    def __init__(self, on_over: Callable[[], None]) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._on_over = on_over

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if "json" in response.headers.get("content-type", "").lower():
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _BoundedStream(response.stream, MAX_RESPONSE_BYTES, self._on_over)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def servers() -> Mapping[str, Mapping[str, Any]]:
    configured: Mapping[str, Mapping[str, Any]] = settings.DJFLOW["MCP_SERVERS"]
    return configured


def _config(name: str) -> Mapping[str, Any]:
    config = servers().get(name)
    if config is None:
        raise Unknown(name)
    return config


def _client_for(
    config: Mapping[str, Any],
    timeout: float,
    on_status: Callable[[int], None],
    on_too_large: Callable[[], None] = lambda: None,
) -> tuple[Client, httpx2.AsyncClient | None]:
    """The SDK's client for one configured server, and the HTTP client it sends through (the
    caller closes it: the SDK leaves a client it was given open). ``on_status`` hears each
    HTTP error status: the SDK turns every one but 404 into the same JSON-RPC error, and
    whether another try may help (503) or not (401) is in the status."""
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    async def heard(response: httpx2.Response) -> None:
        if response.status_code >= 400:
            on_status(response.status_code)

    if "url" in config:
        # Headers (credentials) go on the HTTP client, never into a log or a message.
        http = httpx2.AsyncClient(
            headers=dict(config.get("headers") or {}),
            timeout=httpx2.Timeout(timeout, read=None),
            event_hooks={"response": [heard]},
            transport=_BoundedTransport(on_too_large),
        )
        return Client(streamable_http_client(config["url"], http_client=http)), http
    command = list(config["command"])
    params = StdioServerParameters(command=command[0], args=command[1:], env=config.get("env"))
    # The server's stderr goes to this process's own, named here: the SDK's default is
    # ``sys.stderr`` as it was when the SDK was imported, and imported now, in a Celery pool
    # process, that is Celery's LoggingProxy, which has no file descriptor to give a child.
    return Client(stdio_client(params, errlog=sys.__stderr__ or sys.stderr)), None


class _Held:
    """One open client, held by a task of its own (entered and left in that task)."""

    def __init__(self, name: str, config: Mapping[str, Any]) -> None:
        self.name = name
        self.config = config
        self.client: Client | None = None
        self.in_use = 0
        self.last_used = time.monotonic()
        self.broken = False
        # The last HTTP error status the server answered (streamable HTTP only).
        self.http_status: int | None = None
        # Whether the last response was cut off at MAX_RESPONSE_BYTES.
        self.too_large = False
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Its error is read by open(), unless open() gave up waiting first: not worth a log.
        self._ready.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self, timeout: float) -> None:
        # A context of its own: the client outlives the call that opened it, and must not
        # carry that call's context variables (a tracing span, say) into later ones.
        self._task = asyncio.get_running_loop().create_task(
            self._hold(timeout), context=contextvars.Context()
        )
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except BaseException:
            await self.close()
            raise

    async def _hold(self, timeout: float) -> None:
        client, http = _client_for(self.config, timeout, self._heard, self._too_large)
        try:
            async with contextlib.AsyncExitStack() as stack:
                if http is not None:
                    await stack.enter_async_context(http)
                self.client = await stack.enter_async_context(client)
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as error:
            self.broken = True
            if not self._ready.done():
                if isinstance(error, asyncio.CancelledError):
                    self._ready.cancel()
                else:
                    self._ready.set_exception(_leaf(error))
            elif not self._closing.is_set():
                logger.info("MCP server '%s': connection ended (%s)", self.name, _named(error))
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            self.client = None

    def _heard(self, status: int) -> None:
        self.http_status = status

    def _too_large(self) -> None:
        self.too_large = True

    async def close(self) -> None:
        """Tell the holding task to leave the client, and wait for it (bounded). A cancel of
        the caller is never swallowed here (asyncio.wait does not raise the task's own)."""
        self._closing.set()
        if self._task is None or self._task.done():
            return
        if self.client is None:
            # Still connecting (or failed to): nothing to shut down cleanly.
            self._task.cancel()
        done, _ = await asyncio.wait({self._task}, timeout=_CLOSE_SECONDS)
        if not done:
            # A client that does not shut down in time is cancelled (its task group ends).
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=_CLOSE_SECONDS)

    @property
    def usable(self) -> bool:
        return self.client is not None and not self.broken and not self._closing.is_set()


@dataclass(frozen=True)
class ToolResult:
    """What a tool answered."""

    structured: Any
    texts: list[str]
    is_error: bool
    meta: dict[str, Any]


class Pool:
    """The clients of one process, on the loop of one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Touched only on the loop's thread: name -> open client, least recently used first.
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._opening: dict[str, asyncio.Lock] = {}
        self._changed: asyncio.Condition | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None

    # --- the synchronous side ------------------------------------------------------------

    def run(self, make: Callable[[], Awaitable[T]], timeout: float) -> T:
        """Run ``make()`` on the pool's loop and wait for it at most ``timeout`` seconds (plus
        a moment for it to end itself: the coroutines bound their own time)."""
        future = asyncio.run_coroutine_threadsafe(_awaited(make), self._running_loop())
        try:
            return future.result(timeout + 1.0)
        except TimeoutError:
            raise TimedOut(f"timed out after {int(timeout * 1000)} ms") from None
        finally:
            # An alarm (the attempt's time limit) or a time-out here: the call stops too.
            if not future.done():
                future.cancel()

    def call_tool(
        self, server: str, tool: str, arguments: Mapping[str, Any], timeout: float
    ) -> ToolResult:
        _config(server)
        return self.run(lambda: self._call_tool(server, tool, dict(arguments), timeout), timeout)

    def list_tools(self, server: str, timeout: float) -> list[str]:
        _config(server)
        return self.run(lambda: self._list_tools(server, timeout), timeout)

    def list_tools_of(
        self, servers: list[str], timeout: float
    ) -> dict[str, list[str] | BaseException]:
        """:meth:`list_tools` of several servers at once, within one ``timeout``: each one's
        names, or the error asking it raised (``Unreachable``, ``TimedOut``, ``Rejected``)."""
        for server in servers:
            _config(server)

        async def every() -> dict[str, list[str] | BaseException]:
            answers = await asyncio.gather(
                *(self._list_tools(server, timeout) for server in servers),
                return_exceptions=True,
            )
            return dict(zip(servers, answers, strict=True))

        return self.run(every, timeout)

    def open_count(self) -> int:
        """How many clients are open now (asked on the loop, so the answer is consistent)."""
        if self._loop is None:
            return 0
        return self.run(self._count, 5.0)

    def close_all(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self.run(self._close_all, timeout)

    def shutdown(self) -> None:
        """Close every client and stop the loop (its thread ends); a later use starts anew."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        # What belonged to that loop (its locks, its condition) is not the next one's.
        self._changed = None
        self._opening = {}
        self._held = OrderedDict()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()
                thread = threading.Thread(
                    target=_serve, args=(loop, started), name="djflow-mcp-pool", daemon=True
                )
                thread.start()
                started.wait()
                self._loop = loop
                asyncio.run_coroutine_threadsafe(self._start_reaper(), loop).result()
            return self._loop

    # --- the loop's side -----------------------------------------------------------------

    async def _call_tool(
        self, server: str, tool: str, arguments: dict[str, Any], timeout: float
    ) -> ToolResult:
        deadline = time.monotonic() + timeout
        held = await self._acquire(server, deadline)
        try:
            assert held.client is not None
            left = max(deadline - time.monotonic(), 0.001)
            result: CallToolResult = await _bounded(
                held, held.client.call_tool(tool, arguments, read_timeout_seconds=left), left
            )
        finally:
            await self._release(held)
        return _result_of(result)

    async def _list_tools(self, server: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        held = await self._acquire(server, deadline)
        try:
            assert held.client is not None
            names: list[str] = []
            cursor: str | None = None
            # A bounded walk: a paginator that never ends cannot hold the caller.
            for _ in range(100):
                left = max(deadline - time.monotonic(), 0.001)
                page = await _bounded(
                    held, held.client.list_tools(cursor=cursor, cache_mode="refresh"), left
                )
                names.extend(t.name for t in page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return names
        finally:
            await self._release(held)

    async def _acquire(self, name: str, deadline: float) -> _Held:
        """The open client of ``name``, opened (and the pool kept within its size) if need
        be; marked in use until released."""
        lock = self._opening.setdefault(name, asyncio.Lock())
        async with lock:
            held = self._held.get(name)
            if held is not None and not held.usable:
                await self._discard(held)
                held = None
            if held is None:
                await self._make_room(deadline)
                held = _Held(name, _config(name))
                self._held[name] = held
                # In use while it opens: the reaper leaves it alone.
                held.in_use = 1
                budget = max(deadline - time.monotonic(), 0.001)
                try:
                    await held.open(budget)
                except TimeoutError:
                    await self._discard(held)
                    raise TimedOut(f"connecting took longer than {int(budget * 1000)} ms") from None
                except BaseException as error:
                    await self._discard(held)
                    raise _mapped(error, held.http_status) from None
            else:
                held.in_use += 1
            held.last_used = time.monotonic()
            self._held.move_to_end(name)
            return held

    async def _release(self, held: _Held) -> None:
        held.in_use -= 1
        held.last_used = time.monotonic()
        if held.broken:
            # Closed in the background: the caller has its answer (an error) already.
            self._discard_soon(held)
        await self._notify()

    def _discard_soon(self, held: _Held) -> None:
        if self._held.get(held.name) is held:
            del self._held[held.name]
        task = asyncio.get_running_loop().create_task(self._discard(held))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _make_room(self, deadline: float) -> None:
        size = max(1, int(settings.DJFLOW["MCP_POOL_SIZE"]))
        while len(self._held) >= size:
            victim = next((h for h in self._held.values() if h.in_use == 0), None)
            if victim is not None:
                await self._discard(victim)
                continue
            # Every open client is in a call: wait for one to end.
            changed = self._condition()
            async with changed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimedOut(f"every one of the {size} MCP clients of this process is busy")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)

    async def _discard(self, held: _Held) -> None:
        if self._held.get(held.name) is held:
            del self._held[held.name]
        await held.close()
        await self._notify()

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _count(self) -> int:
        return len(self._held)

    async def _shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        await self._close_all()

    async def _close_all(self) -> None:
        for held in list(self._held.values()):
            await self._discard(held)

    async def _start_reaper(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Close the clients idle past DJFLOW_MCP_IDLE_SECONDS, for as long as the loop runs."""
        while True:
            idle = float(settings.DJFLOW["MCP_IDLE_SECONDS"])
            await asyncio.sleep(min(max(idle / 4, 0.05), 5.0))
            now = time.monotonic()
            for held in list(self._held.values()):
                if held.in_use == 0 and (now - held.last_used >= idle or not held.usable):
                    await self._discard(held)


def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    try:
        loop.run_forever()
    finally:
        # Stopped by Pool.shutdown (tests); a process's own pool runs until the process ends.
        loop.close()


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


async def _bounded(held: _Held, call: Awaitable[T], seconds: float) -> T:
    """``call``'s answer within ``seconds``; a time-out or a broken connection discards the
    client (marked broken: its release closes it)."""
    held.http_status = None
    held.too_large = False
    try:
        return await asyncio.wait_for(call, seconds)
    except TimeoutError:
        held.broken = True
        raise TimedOut(f"no answer within {int(seconds * 1000)} ms") from None
    except BaseException as error:
        if held.too_large:
            raise TooLarge(f"over {MAX_RESPONSE_BYTES} bytes: not read further") from None
        mapped = _mapped(error, held.http_status)
        if not isinstance(mapped, Rejected):
            held.broken = True
        raise mapped from None


def _mapped(error: BaseException, http_status: int | None = None) -> BaseException:
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED, INTERNAL_ERROR, REQUEST_TIMEOUT

    leaf = _leaf(error)
    if http_status is not None and isinstance(leaf, MCPError) and leaf.error.code == INTERNAL_ERROR:
        if http_status in (408, 429) or http_status >= 500:
            return Unreachable(f"it answered HTTP {http_status}")
        return Rejected(f"it answered HTTP {http_status}")
    if isinstance(leaf, MCPError):
        if leaf.error.code == REQUEST_TIMEOUT:
            return TimedOut(str(leaf))
        if leaf.error.code == CONNECTION_CLOSED:
            return Unreachable(f"the connection closed ({leaf})")
        return Rejected(f"{leaf} (code {leaf.error.code})")
    if isinstance(leaf, (TimedOut, Unreachable, Rejected, asyncio.CancelledError)):
        return leaf
    if isinstance(leaf, TimeoutError | httpx2.TimeoutException):
        return TimedOut(_named(leaf))
    # Refused or reset connections, a closed stream, a stdio server that exited or could not
    # be started, what else the transport raised: another try may find it up.
    return Unreachable(_named(leaf))


def _leaf(error: BaseException) -> BaseException:
    """The first error inside (anyio's task groups wrap what their tasks raised)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _named(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)):
        text = "the stream is closed"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _result_of(result: CallToolResult) -> ToolResult:
    from mcp_types import TextContent

    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    meta = dict(result.meta or {})
    return ToolResult(
        structured=result.structured_content, texts=texts, is_error=result.is_error, meta=meta
    )


# --- one pool per process -----------------------------------------------------------------

_pool: Pool | None = None
_pool_lock = threading.Lock()
# A parent's pools, kept referenced in a forked child and never used there (module docstring).
_abandoned: list[Pool] = []


def pool() -> Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = Pool()
        return _pool


def _after_fork_in_child() -> None:
    global _pool, _pool_lock
    if _pool is not None:
        _abandoned.append(_pool)
    _pool = None
    # The parent's lock may have been held by another thread at the fork.
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
