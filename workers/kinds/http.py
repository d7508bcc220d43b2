"""``http``: a worker sends one HTTP request and answers ``{status, headers, body}`` (contract
section 1, "http", and section 10, "HTTP").

Invariants:

- The attempt's stored input is the request as sent: :func:`prepare` (the planner, pure)
  resolves the step's ``url``, each ``headers`` value and ``body`` afresh for every attempt,
  into ``{"method", "url", "headers", "body"}``. The step's own ``input`` field plays no part
  in the request.
- Every connection, redirects included, goes through ``workers.netguard``: public addresses
  only, unless ``DJFLOW_HTTP_ALLOW`` lists the host; a refused address fails the attempt with
  class ``fatal``, naming it. Redirects are followed here (at most :data:`MAX_REDIRECTS`), so
  each hop is checked.
- A redirect to another origin (scheme, host or port) carries none of the step's headers
  (any of them may hold a secret: ``X-Api-Key: ${input.key}``), only those the client adds
  itself, and never the step's body: one that would keep it (307, 308) fails ``fatal``. A
  redirect from https to http fails ``fatal`` (the request would travel in the clear).
- The attempt is bounded: the whole exchange must end a little inside the attempt's
  ``timeout_ms`` (then it fails ``retryable``, before the worker's own alarm), and a
  response body past ``DJFLOW_HTTP_MAX_RESPONSE_BYTES`` (decoded) fails it ``fatal``.
- Classes: 2xx and 3xx that are not followed succeed; 408, 429 and 5xx are ``retryable``,
  no sooner than a ``Retry-After`` asks (at most an hour); other 4xx are ``fatal``; time-outs
  and connection errors are ``retryable``.
- An error message shows the URL as scheme://host[:port]/path only and never a header value:
  a query string and headers may carry credentials.
"""

from __future__ import annotations

import codecs
import email.utils
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpx2
from django.conf import settings

from workers import netguard
from workflows.failures import StepFailure
from workflows.kinds import Kind, Refused, Role, Scope, register

MAX_REDIRECTS = 5
RETRY_AFTER_CAP_MS = 3_600_000
# The attempt's time when the worker gives no deadline (limits.step_timeout_ms's default).
DEFAULT_TIMEOUT_MS = 60_000
_FOLLOWED = frozenset({301, 302, 303, 307, 308})
# These change the method to GET and drop the body (what browsers do; RFC 9110 15.4).
_TO_GET = frozenset({301, 302, 303})
_BODY_HEADERS = frozenset({"content-type", "content-length", "content-encoding"})
# RFC 9110's token: what a header name may be.
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


# --- the planner's half (pure) ---------------------------------------------------------------


def prepare(step: Mapping[str, Any], scope: Scope) -> dict[str, Any]:
    """The attempt's input: the request with the step's templates resolved (Refused, so
    class invalid_input naming the field, when one resolves to what cannot be sent)."""
    url = scope.resolve(step["url"], "url")
    if not isinstance(url, str):
        raise Refused(f"url: resolved to {_type_name(url)}, not a string")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in netguard.SCHEMES:
        raise Refused(f"url: only http and https URLs may be called, not {scheme or 'none'}:")
    headers = {
        name: _header_value(name, scope.resolve(template, f"headers.{name}"))
        for name, template in (step.get("headers") or {}).items()
    }
    body = scope.resolve(step["body"], "body") if "body" in step else None
    return {"method": step.get("method", "GET"), "url": url, "headers": headers, "body": body}


def _header_value(name: str, value: Any) -> str:
    field_name = f"headers.{name}"
    if not _HEADER_NAME.match(name):
        raise Refused(f"{field_name}: {name!r} is not a header name")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise Refused(f"{field_name}: resolved to {_type_name(value)}, not a string")
    if any(c in value for c in "\r\n\0"):
        # A line break would start another header (request splitting).
        raise Refused(f"{field_name}: a header value may not hold a line break or NUL")
    return value


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", dict: "an object", list: "an array", str: "a string"}
    return names.get(type(value), "a number")


# --- the worker's half -----------------------------------------------------------------------


@dataclass
class _Request:
    method: str
    url: httpx2.URL
    headers: dict[str, str]
    body: Any = None
    redirects: int = 0

    @classmethod
    def from_input(cls, given: Any) -> _Request:
        if not isinstance(given, Mapping) or not isinstance(given.get("url"), str):
            raise StepFailure("http: the attempt's input is not a prepared request", "fatal")
        headers = {str(k): str(v) for k, v in (given.get("headers") or {}).items()}
        for name, value in headers.items():
            # The stored input holds a secret's token; its value, revealed here, is checked
            # here (httpx2 would raise UnicodeEncodeError, quoting part of it).
            if not value.isascii():
                raise StepFailure(f"http: the value of header {name} is not ASCII", "invalid_input")
        return cls(
            method=str(given.get("method") or "GET").upper(),
            url=_parse_url(given["url"]),
            headers=headers,
            body=given.get("body"),
        )

    def content(self) -> tuple[bytes | None, str | None]:
        """The body's bytes and the Content-Type they need when the step set none."""
        if self.body is None:
            return None, None
        if isinstance(self.body, str):
            return self.body.encode("utf-8"), "text/plain; charset=utf-8"
        return json.dumps(self.body, separators=(",", ":")).encode("utf-8"), "application/json"

    def has_header(self, name: str) -> bool:
        return any(key.lower() == name for key in self.headers)


def http_body(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any]:
    """Every worker can run an http step (no handler to have)."""
    return call


def call(ctx: Any, given: Any, prior: Any = None) -> dict[str, Any]:
    request = _Request.from_input(given)
    budget_ms = _budget_ms(getattr(ctx, "deadline_at", None))
    deadline = time.monotonic() + budget_ms / 1000
    with ctx.span("http", "client", method=request.method, url=netguard.shown(request.url)) as span:
        try:
            with netguard.client(timeout=budget_ms / 1000) as client:
                answer = _exchange(client, request, deadline, budget_ms)
        except httpx2.TimeoutException:
            raise _timed_out(request, budget_ms) from None
        except httpx2.TransportError as exc:
            raise _transport_failure(request, exc) from None
        span.set_attribute("status", answer["status"])
    return answer


def _budget_ms(deadline_at: datetime | None) -> int:
    """How long the exchange may take: the attempt's time left (its claim's deadline, from
    timeout_ms), less a tenth (at most a second) kept for failing cleanly before the
    worker's alarm would end the attempt as class timeout."""
    if deadline_at is None:
        left_ms = DEFAULT_TIMEOUT_MS
    else:
        left_ms = int((deadline_at - datetime.now(UTC)).total_seconds() * 1000)
    return max(1, left_ms - min(1000, left_ms // 10))


def _exchange(
    client: httpx2.Client, request: _Request, deadline: float, budget_ms: int
) -> dict[str, Any]:
    """Send the request, following redirects; the final response as the step's output."""
    while True:
        netguard.check_scheme(request.url)
        response = client.send(_built(client, request, deadline, budget_ms), stream=True)
        try:
            target = _redirect_target(request, response)
            if target is None:
                _raise_for_status(request, response)
                return _output(request, response, deadline, budget_ms)
        finally:
            response.close()
        request = _followed(request, response.status_code, target)


def _built(
    client: httpx2.Client, request: _Request, deadline: float, budget_ms: int
) -> httpx2.Request:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timed_out(request, budget_ms)
    content, content_type = request.content()
    headers = dict(request.headers)
    if content_type and not request.has_header("content-type"):
        headers["Content-Type"] = content_type
    return client.build_request(
        request.method, request.url, headers=headers, content=content, timeout=remaining
    )


def _redirect_target(request: _Request, response: httpx2.Response) -> httpx2.URL | None:
    location = response.headers.get("location")
    if response.status_code not in _FOLLOWED or location is None:
        return None
    target = request.url.join(_parse_url(location, relative=True))
    if request.redirects >= MAX_REDIRECTS:
        raise StepFailure(
            f"http: more than {MAX_REDIRECTS} redirects (the last from "
            f"{netguard.shown(request.url)} to {netguard.shown(target)})",
            "fatal",
        )
    return target


def _followed(request: _Request, status: int, target: httpx2.URL) -> _Request:
    if request.url.scheme == "https" and target.scheme == "http":
        raise StepFailure(
            f"http: a {status} redirect from {_shown_origin(request.url)} to "
            f"{_shown_origin(target)} is refused: it leaves https for http",
            "fatal",
        )
    method, body = request.method, request.body
    headers = dict(request.headers)
    if status in _TO_GET and method != "HEAD":
        method, body = "GET", None
        headers = {k: v for k, v in headers.items() if k.lower() not in _BODY_HEADERS}
    if _origin(target) != _origin(request.url):
        if body is not None:
            raise StepFailure(
                f"http: a {status} redirect from {_shown_origin(request.url)} to "
                f"{_shown_origin(target)} is refused: it would send the request body to "
                "another origin",
                "fatal",
            )
        # Which of the step's headers hold secrets is not known here: none goes on.
        headers = {}
    return _Request(method, target, headers, body, request.redirects + 1)


def _origin(url: httpx2.URL) -> tuple[str, str, int | None]:
    default = {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, url.port or default


def _shown_origin(url: httpx2.URL) -> str:
    """scheme://host[:port], as an error message may show it (no path: it may carry ids)."""
    return netguard.shown(url).removesuffix(url.path)


def _raise_for_status(request: _Request, response: httpx2.Response) -> None:
    status = response.status_code
    if status < 400:
        return
    message = (
        f"http: {request.method} {netguard.shown(request.url)} answered {status}"
        f" {response.reason_phrase}".rstrip()
    )
    if status in (408, 429) or status >= 500:
        wait = retry_after_ms(response.headers.get("retry-after"), datetime.now(UTC))
        raise StepFailure(message, "retryable", retry_after_ms=wait)
    raise StepFailure(message, "fatal")


def retry_after_ms(value: str | None, now: datetime) -> int | None:
    """A ``Retry-After`` header (seconds, or an HTTP-date) in milliseconds from ``now``, at
    most an hour; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]+", value):
        wait_ms = int(value) * 1000
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        wait_ms = int((when - now).total_seconds() * 1000)
    return max(0, min(wait_ms, RETRY_AFTER_CAP_MS))


def _output(
    request: _Request, response: httpx2.Response, deadline: float, budget_ms: int
) -> dict[str, Any]:
    headers: dict[str, str] = {}
    for name, value in response.headers.multi_items():
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    content = _read_capped(request, response, deadline, budget_ms)
    return {"status": response.status_code, "headers": headers, "body": _body_of(response, content)}


def _read_capped(
    request: _Request, response: httpx2.Response, deadline: float, budget_ms: int
) -> bytes:
    cap = settings.DJFLOW["HTTP_MAX_RESPONSE_BYTES"]
    chunks: list[bytes] = []
    size = 0
    # Decoded bytes are counted, so a compressed body cannot expand past the cap in memory
    # beyond one chunk.
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > cap:
            raise StepFailure(
                f"http: the response body is over {cap} bytes "
                f"({request.method} {netguard.shown(request.url)})",
                "fatal",
            )
        chunks.append(chunk)
        # Each read is bounded by the hop's time-out; a body that trickles in is bounded here.
        if time.monotonic() > deadline:
            raise _timed_out(request, budget_ms)
    return b"".join(chunks)


def _body_of(response: httpx2.Response, content: bytes) -> Any:
    """Parsed JSON when the response says it is JSON and it parses, else the text."""
    text = content.decode(_charset(response), errors="replace")
    media = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            return _clean(json.loads(text, parse_constant=_no_constant))
        except ValueError:
            pass
    return _clean(text)


def _charset(response: httpx2.Response) -> str:
    charset = response.charset_encoding or "utf-8"
    try:
        return codecs.lookup(charset).name
    except LookupError:
        return "utf-8"


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: such a body is kept as its text.
    raise ValueError(f"{name} is not JSON")


def _clean(value: Any) -> Any:
    """The value with NUL and lone surrogates in its strings replaced (U+FFFD): the journal
    (Postgres jsonb) cannot store them, and a server's answer may hold them."""
    if isinstance(value, str):
        if "\0" in value or _LONE_SURROGATE.search(value):
            return _LONE_SURROGATE.sub("\ufffd", value.replace("\0", "\ufffd"))
        return value
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, dict):
        return {_clean(key): _clean(item) for key, item in value.items()}
    return value


def _parse_url(text: str, *, relative: bool = False) -> httpx2.URL:
    try:
        url = httpx2.URL(text)
    except httpx2.InvalidURL as exc:
        raise StepFailure(f"http: the URL is not valid ({exc})", "fatal") from None
    if not relative and not url.host:
        raise StepFailure("http: the URL names no host", "fatal")
    return url


def _timed_out(request: _Request, budget_ms: int) -> StepFailure:
    return StepFailure(
        f"http: timed out after {budget_ms} ms ({request.method} {netguard.shown(request.url)})",
        "retryable",
    )


def _transport_failure(request: _Request, exc: httpx2.TransportError) -> StepFailure:
    where = f"{request.method} {netguard.shown(request.url)}"
    if isinstance(exc, (httpx2.NetworkError, httpx2.RemoteProtocolError)):
        # The server or the network: worth another attempt.
        return StepFailure(f"http: {where} failed: {type(exc).__name__}: {exc}", "retryable")
    # Not the exception's text: a local protocol error quotes the header value it refused.
    return StepFailure(f"http: {where} could not be sent ({type(exc).__name__})", "fatal")


HTTP = register(Kind("http", Role.WORKER, max_attempts=3, prepare=prepare, body=http_body))
