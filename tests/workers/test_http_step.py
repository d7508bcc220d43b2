"""The ``http`` step kind (workers/kinds/http.py): its body against local HTTP servers the
tests start (real sockets, real HTTP/1.1), and its planner half (``prepare``) through a run
started on the real database.

127.0.0.1 is allowed through settings for the body's tests (``DJFLOW_HTTP_ALLOW``), except
where a test is about what the guard refuses.
"""

from __future__ import annotations

import email.utils
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from runs import services
from runs.models import StepRun
from tests.workers.http_servers import Server, certificate, reply, serving
from workers import netguard
from workers.context import StepContext, bound_logger
from workers.kinds import http
from workflows import kinds
from workflows.failures import StepFailure
from workflows.services import definition_save

SECRET = "s3cret-value"


@pytest.fixture
def allow(settings) -> Callable[..., None]:
    def set_allow(*entries: str, max_bytes: int = 1_048_576) -> None:
        settings.DJFLOW = {
            **settings.DJFLOW,
            "HTTP_ALLOW": list(entries),
            "HTTP_MAX_RESPONSE_BYTES": max_bytes,
        }

    set_allow("127.0.0.1")
    return set_allow


def _ctx(timeout_ms: int = 5000) -> StepContext:
    return StepContext(
        run_id="run",
        step_id="call",
        attempt=1,
        idempotency_key="key",
        workflow_id="flow",
        logger=bound_logger("run", "call", 1),
        # As the worker sets it: the claim's time plus the attempt's timeout_ms.
        deadline_at=datetime.now(UTC) + timedelta(milliseconds=timeout_ms),
    )


def _call(url: str, method: str = "GET", headers: dict | None = None, body: Any = None, **ctx):
    given = {"method": method, "url": url, "headers": headers or {}, "body": body}
    return http.call(_ctx(**ctx), given, None)


def _failure(url: str, **kwargs: Any) -> StepFailure:
    with pytest.raises(StepFailure) as failed:
        _call(url, **kwargs)
    assert SECRET not in failed.value.message
    return failed.value


def _json(status: int, value: Any, **headers: str) -> Callable[[BaseHTTPRequestHandler], None]:
    headers = {"Content-Type": "application/json", **headers}
    return lambda h: reply(h, status, json.dumps(value), headers)


@pytest.fixture
def server(allow) -> Iterator[Server]:
    with serving({}) as running:
        yield running


def test_a_json_answer_is_parsed_and_headers_are_lower_case_and_joined(server: Server) -> None:
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(201)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("X-Tag", "a")
        h.send_header("X-Tag", "b")
        data = json.dumps({"id": 7, "name": "Zoë"}).encode()
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    server.routes["/items"] = answer
    out = _call(
        server.url("/items?x=1"), "POST", {"Authorization": "Bearer t", "X-N": "2"}, {"a": [1]}
    )
    assert out["status"] == 201
    assert out["body"] == {"id": 7, "name": "Zoë"}
    assert out["headers"]["x-tag"] == "a, b"
    assert out["headers"]["content-type"] == "application/json; charset=utf-8"
    [seen] = server.seen
    assert (seen.method, seen.path, json.loads(seen.body)) == ("POST", "/items?x=1", {"a": [1]})
    assert seen.headers["Content-Type"] == "application/json"
    assert (seen.headers["Authorization"], seen.headers["X-N"]) == ("Bearer t", "2")


def test_a_text_answer_is_decoded_by_its_charset(server: Server) -> None:
    latin = "café".encode("latin-1")
    server.routes["/latin"] = lambda h: reply(
        h, 200, latin, {"Content-Type": "text/plain; charset=latin-1"}
    )
    server.routes["/broken"] = lambda h: reply(
        h, 200, b"ok \xff\x00!", {"Content-Type": "text/plain"}
    )
    server.routes["/notjson"] = lambda h: reply(
        h, 200, "{nope", {"Content-Type": "application/json"}
    )
    server.routes["/nan"] = lambda h: reply(h, 200, "[NaN]", {"Content-Type": "application/json"})
    server.routes["/problem"] = _json(
        200, {"title": "x"}, **{"Content-Type": "application/problem+json"}
    )
    server.routes["/echo"] = lambda h: reply(h, 200, "", {"X-Got": h.headers["Content-Type"]})
    assert _call(server.url("/latin"))["body"] == "café"
    # Undecodable bytes are replaced; NUL too (the journal's jsonb cannot hold it).
    assert _call(server.url("/broken"))["body"] == "ok \ufffd\ufffd!"
    # Said to be JSON but not JSON (NaN is not): kept as text.
    assert _call(server.url("/notjson"))["body"] == "{nope"
    assert _call(server.url("/nan"))["body"] == "[NaN]"
    assert _call(server.url("/problem"))["body"] == {"title": "x"}
    # A string body is sent as text.
    out = _call(server.url("/echo"), "PUT", body="plain words")
    assert (out["body"], out["headers"]["x-got"]) == ("", "text/plain; charset=utf-8")
    assert server.seen[-1].body == b"plain words"
    assert _call(server.url("/latin"), "HEAD")["body"] == ""


def test_503_then_200_is_retryable_after_what_retry_after_asks(server: Server) -> None:
    def flaky(h: BaseHTTPRequestHandler) -> None:
        if server.counts["/flaky"] == 1:
            reply(h, 503, "busy", {"Retry-After": "7"})
        else:
            _json(200, {"ok": True})(h)

    server.routes["/flaky"] = flaky
    failed = _failure(server.url("/flaky"))
    assert failed.error_class == "retryable" and failed.retry_after_ms == 7000
    assert failed.message == f"http: GET {server.url('/flaky')} answered 503 Service Unavailable"
    assert _call(server.url("/flaky"))["body"] == {"ok": True}


def test_429_with_an_http_date_retry_after(server: Server) -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    date = email.utils.format_datetime(when, usegmt=True)
    server.routes["/limited"] = lambda h: reply(h, 429, "", {"Retry-After": date})
    failed = _failure(server.url("/limited"))
    assert failed.error_class == "retryable"
    assert failed.retry_after_ms is not None and 27_000 <= failed.retry_after_ms <= 30_000


@pytest.mark.parametrize("status", [408, 500, 502])
def test_408_and_5xx_are_retryable_without_retry_after(server: Server, status: int) -> None:
    server.routes["/x"] = lambda h: reply(h, status, "")
    failed = _failure(server.url("/x"))
    assert (failed.error_class, failed.retry_after_ms) == ("retryable", None)


def test_retry_after_is_read_as_seconds_or_a_date_and_capped_at_an_hour() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert http.retry_after_ms("120", now) == 120_000
    assert http.retry_after_ms("99999", now) == 3_600_000
    assert http.retry_after_ms("Thu, 01 Jan 2026 00:00:10 GMT", now) == 10_000
    assert http.retry_after_ms("Wed, 31 Dec 2025 23:00:00 GMT", now) == 0
    assert http.retry_after_ms("soon", now) is None
    assert http.retry_after_ms("-5", now) is None
    assert http.retry_after_ms(None, now) is None


@pytest.mark.parametrize(("status", "reason"), [(404, "Not Found"), (400, "Bad Request")])
def test_other_4xx_are_fatal_naming_the_status_but_no_secret(
    server: Server, status: int, reason: str
) -> None:
    server.routes["/x"] = lambda h: reply(h, status, f"you sent {h.headers['Authorization']}")
    failed = _failure(server.url(f"/x?key={SECRET}"), headers={"Authorization": f"Bearer {SECRET}"})
    assert failed.error_class == "fatal"
    assert failed.message == f"http: GET {server.url('/x')} answered {status} {reason}"


def test_a_302_is_followed_as_get_without_the_body(server: Server) -> None:
    server.routes["/old"] = lambda h: reply(h, 302, "", {"Location": "/new?page=2"})
    server.routes["/new"] = _json(200, {"moved": True})
    out = _call(server.url("/old"), "POST", {"X-Keep": "1"}, {"big": "body"})
    assert (out["status"], out["body"]) == (200, {"moved": True})
    old, new = server.seen
    assert (old.method, new.method, new.path, new.body) == ("POST", "GET", "/new?page=2", b"")
    assert new.headers["X-Keep"] == "1" and "Content-Type" not in new.headers


def test_a_307_keeps_method_body_and_headers_on_the_same_origin(server: Server) -> None:
    server.routes["/old"] = lambda h: reply(h, 307, "", {"Location": server.url("/new")})
    server.routes["/new"] = lambda h: reply(h, 200, "done")
    out = _call(server.url("/old"), "PUT", {"X-Api-Key": SECRET}, body={"k": 1})
    assert out["body"] == "done"
    assert [(s.method, s.body) for s in server.seen] == [("PUT", b'{"k":1}'), ("PUT", b'{"k":1}')]
    assert server.seen[1].headers["X-Api-Key"] == SECRET


# What httpx2 sends of its own; nothing else may reach another origin.
CLIENT_HEADERS = {"Host", "Accept", "Accept-Encoding", "Connection", "User-Agent"}


@pytest.mark.parametrize("status", [302, 307])
def test_none_of_the_steps_headers_is_sent_on_to_another_origin(
    server: Server, status: int
) -> None:
    """Any header may carry a secret (``X-Api-Key: ${input.key}``), not just Authorization."""
    with serving({"/there": lambda h: reply(h, 200, "there")}) as other:
        server.routes["/here"] = lambda h: reply(h, status, "", {"Location": other.url("/there")})
        headers = {
            "Authorization": f"Bearer {SECRET}",
            "Cookie": "a=b",
            "X-Api-Key": SECRET,
            "Accept": "application/json",
        }
        assert _call(server.url("/here"), headers=headers)["body"] == "there"
    [here] = server.seen
    assert here.headers["X-Api-Key"] == SECRET and here.headers["Accept"] == "application/json"
    [arrived] = other.seen
    assert set(arrived.headers) <= CLIENT_HEADERS
    assert SECRET not in str(arrived.headers) and arrived.headers["Accept"] == "*/*"


@pytest.mark.parametrize("status", [307, 308])
def test_a_307_or_308_to_another_origin_with_a_body_is_refused(server: Server, status: int) -> None:
    with serving({"/there": lambda h: reply(h, 200, "there")}) as other:
        server.routes["/here"] = lambda h: reply(
            h, status, "", {"Location": other.url(f"/there?key={SECRET}")}
        )
        failed = _failure(server.url("/here"), method="POST", body={"card": SECRET})
    assert failed.error_class == "fatal"
    assert failed.message == (
        f"http: a {status} redirect from http://127.0.0.1:{server.port} to "
        f"http://127.0.0.1:{other.port} is refused: it would send the request body to "
        "another origin"
    )
    assert other.seen == []


def test_a_303_to_another_origin_after_a_post_is_followed_without_the_body(
    server: Server,
) -> None:
    with serving({"/done": lambda h: reply(h, 200, "done")}) as other:
        server.routes["/form"] = lambda h: reply(h, 303, "", {"Location": other.url("/done")})
        assert _call(server.url("/form"), "POST", body={"card": SECRET})["body"] == "done"
    [arrived] = other.seen
    assert (arrived.method, arrived.body) == ("GET", b"")


@pytest.fixture
def tls_server(server: Server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """An HTTPS server on 127.0.0.1 whose self-signed certificate the step's client trusts."""
    cert_path, key_path = certificate(tmp_path, "localhost", "127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    trusted = ssl.create_default_context(cafile=str(cert_path))
    monkeypatch.setattr(netguard, "_default_context", lambda: trusted)
    with serving({}, tls=context) as running:
        yield running


def test_a_redirect_from_https_to_http_is_refused(tls_server: Server, server: Server) -> None:
    server.routes["/plain"] = lambda h: reply(h, 200, "in the clear")
    tls_server.routes["/ok"] = lambda h: reply(h, 200, "over tls")
    tls_server.routes["/down"] = lambda h: reply(
        h, 302, "", {"Location": server.url(f"/plain?key={SECRET}")}
    )
    tls = f"https://127.0.0.1:{tls_server.port}"
    assert _call(f"{tls}/ok")["body"] == "over tls"
    failed = _failure(f"{tls}/down", headers={"Authorization": f"Bearer {SECRET}"})
    assert failed.error_class == "fatal"
    assert failed.message == (
        f"http: a 302 redirect from {tls} to http://127.0.0.1:{server.port} is refused: "
        "it leaves https for http"
    )
    assert server.seen == []


def test_a_redirect_to_a_refused_address_fails_naming_it(server: Server) -> None:
    server.routes["/meta"] = lambda h: reply(
        h, 302, "", {"Location": "http://169.254.169.254/latest/meta-data/?x=1"}
    )
    failed = _failure(server.url("/meta"))
    assert failed.error_class == "fatal"
    assert failed.message == (
        "http: 169.254.169.254 is a cloud metadata address; DJFLOW_HTTP_ALLOW does not list it"
    )


def test_a_redirect_from_an_allowed_name_to_its_loopback_address_is_refused(
    server: Server, allow
) -> None:
    allow("localhost")  # the name only
    server.routes["/hop"] = lambda h: reply(h, 302, "", {"Location": server.url("/end")})
    server.routes["/end"] = lambda h: reply(h, 200, "end")
    hop = f"http://localhost:{server.port}/hop"
    failed = _failure(hop)
    assert "127.0.0.1 is a loopback address; DJFLOW_HTTP_ALLOW does not list it" in failed.message
    assert [s.path for s in server.seen] == ["/hop"]


def test_a_redirect_to_another_scheme_is_fatal(server: Server) -> None:
    server.routes["/ftp"] = lambda h: reply(h, 301, "", {"Location": "ftp://files.example/x"})
    failed = _failure(server.url("/ftp"))
    assert (failed.error_class, failed.message) == (
        "fatal",
        "http: only http and https URLs may be called, not ftp:",
    )


def test_more_than_five_redirects_fail(server: Server) -> None:
    server.routes["/loop"] = lambda h: reply(h, 302, "", {"Location": "/loop"})
    failed = _failure(server.url("/loop"))
    assert failed.error_class == "fatal"
    assert failed.message.startswith("http: more than 5 redirects (the last from")
    assert server.counts["/loop"] == 6


def test_a_body_over_the_cap_fails_and_one_at_it_passes(server: Server, allow) -> None:
    allow("127.0.0.1", max_bytes=1000)
    server.routes["/at"] = lambda h: reply(h, 200, b"x" * 1000)
    server.routes["/over"] = lambda h: reply(h, 200, b"x" * 1001)
    assert len(_call(server.url("/at"))["body"]) == 1000
    failed = _failure(server.url("/over"))
    assert failed.error_class == "fatal"
    assert (
        failed.message == f"http: the response body is over 1000 bytes (GET {server.url('/over')})"
    )


def _trickle(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "100")
    h.end_headers()
    for _ in range(100):
        h.wfile.write(b".")
        h.wfile.flush()
        time.sleep(0.05)


def test_a_body_that_trickles_past_the_time_limit_is_retryable(server: Server) -> None:
    server.routes["/slow"] = _trickle
    started = time.monotonic()
    failed = _failure(server.url("/slow"), timeout_ms=600)
    elapsed = time.monotonic() - started
    assert failed.error_class == "retryable"
    # The exchange had the attempt's time less a tenth: about 540 ms of 600.
    found = re.fullmatch(r"http: timed out after (\d+) ms \(GET (.*)\)", failed.message)
    assert found and 500 <= int(found[1]) <= 540 and found[2] == server.url("/slow")
    # Inside the attempt's time (the worker's alarm would fire at 0.6 s), with a margin.
    assert 0.5 <= elapsed < 0.6


def test_an_answer_that_never_comes_is_retryable_before_the_time_limit(server: Server) -> None:
    server.routes["/mute"] = lambda h: time.sleep(1.5)
    started = time.monotonic()
    failed = _failure(server.url("/mute"), timeout_ms=500)
    assert failed.error_class == "retryable" and failed.message.startswith("http: timed out")
    assert time.monotonic() - started < 0.5


def test_a_name_that_takes_too_long_to_resolve_is_retryable_inside_the_time_limit(
    allow, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS cannot run here: the lookup of one name is replaced by one that hangs (until the
    test ends); every other name goes to the real resolver."""
    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "hangs.test":
            release.wait(3)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    started = time.monotonic()
    try:
        failed = _failure(f"http://hangs.test/x?key={SECRET}", timeout_ms=500)
    finally:
        release.set()
    assert failed.error_class == "retryable"
    # The attempt's time less a tenth, less what went before the lookup.
    found = re.fullmatch(r"http: resolving hangs\.test took longer than (\d+) ms", failed.message)
    assert found and 300 <= int(found[1]) <= 450
    assert time.monotonic() - started < 0.5


def test_a_refused_connection_is_retryable(allow) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    failed = _failure(f"http://127.0.0.1:{port}/x?key={SECRET}")
    assert failed.error_class == "retryable"
    assert failed.message.startswith(f"http: GET http://127.0.0.1:{port}/x failed: ConnectError")


def test_loopback_is_refused_when_not_allowed(server: Server, allow) -> None:
    allow()
    server.routes["/x"] = lambda h: reply(h, 200, "reached")
    failed = _failure(server.url("/x"))
    assert failed.error_class == "fatal"
    assert failed.message == (
        "http: 127.0.0.1 is a loopback address; DJFLOW_HTTP_ALLOW does not list it"
    )
    assert server.seen == []


def test_a_proxy_in_the_environment_is_not_used(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy would make the request from elsewhere, past the guard: it is ignored."""
    with serving({}) as proxy:
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy.url("/"))
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        server.routes["/direct"] = lambda h: reply(h, 200, "direct")
        assert _call(server.url("/direct"))["body"] == "direct"
    assert proxy.seen == []
    assert [s.path for s in server.seen] == ["/direct"]


def test_a_header_value_that_is_not_ascii_fails_without_quoting_it(server: Server) -> None:
    failed = _failure(server.url("/x"), headers={"X-Key": f"{SECRET}é"})
    assert (failed.error_class, failed.message) == (
        "invalid_input",
        "http: the value of header X-Key is not ASCII",
    )
    assert server.seen == []


def test_a_header_value_with_a_line_break_fails_without_quoting_it(server: Server) -> None:
    """A revealed secret may hold what prepare could not see in its token."""
    failed = _failure(server.url("/x"), headers={"X-Key": f"{SECRET}\r\nX-Evil: 1"})
    assert failed.error_class == "fatal"
    assert failed.message == f"http: GET {server.url('/x')} could not be sent (LocalProtocolError)"
    assert server.seen == []


def test_the_kind_is_registered_with_three_attempts_and_every_worker_serves_it() -> None:
    kind = kinds.get("http")
    assert kind is not None and kind.role == kinds.Role.WORKER and kind.max_attempts == 3
    assert kind.body is not None and kind.body({"id": "x", "kind": "http"}, "flow") is http.call


# --- prepare: the planner resolves the request into the attempt's input ----------------------


def _start(step: dict[str, Any], input: Any) -> StepRun:
    document = {"id": "http_prep", "steps": [{"id": "call", "kind": "http", **step}]}
    definition_save(document=document)
    run = services.run_start(workflow="http_prep", input=input).run
    [row] = StepRun.objects.filter(run=run)
    return row


@pytest.mark.django_db
def test_templates_in_url_headers_and_body_are_resolved_into_the_attempts_input() -> None:
    row = _start(
        {
            "method": "POST",
            "url": "https://api.example.com/items/${input.id}?q=${input.q}",
            "headers": {"Authorization": "Bearer ${input.token}", "X-Count": "${input.n}"},
            "body": {"name": "${input.name}", "all": "${input.tags}"},
            "input": {"ignored": True},
        },
        {"id": 42, "q": "a b", "token": "tok", "n": 3, "name": "Ann", "tags": ["x", "y"]},
    )
    assert row.status == "scheduled"
    assert row.input == {
        "method": "POST",
        "url": "https://api.example.com/items/42?q=a b",
        "headers": {"Authorization": "Bearer tok", "X-Count": "3"},
        "body": {"name": "Ann", "all": ["x", "y"]},
    }


@pytest.mark.django_db
def test_a_step_without_headers_or_body_sends_none() -> None:
    row = _start({"method": "GET", "url": "http://api.example.com/"}, {})
    assert row.input == {
        "method": "GET",
        "url": "http://api.example.com/",
        "headers": {},
        "body": None,
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("step", "input", "message"),
    [
        (
            {"url": "http://api.example.com/${input.a}${input.a}"},
            {"a": "x" * 600_000},
            "url: the resolved value is",
        ),
        ({"url": "${input.n}"}, {"n": 5}, "url: resolved to a number, not a string"),
        ({"url": "ftp://files.example/${input.f}"}, {"f": "x"}, "url: only http and https"),
        (
            {"url": "http://a.example/", "headers": {"X-Token": "${input.t}"}},
            {"t": "a\r\nX-Evil: 1"},
            "headers.X-Token: a header value may not hold a line break or NUL",
        ),
        (
            {"url": "http://a.example/", "headers": {"X-Token": "${input.t}"}},
            {"t": {"o": 1}},
            "headers.X-Token: resolved to an object, not a string",
        ),
        (
            {"url": "http://a.example/", "headers": {"Bad Name": "x"}},
            {},
            "headers.Bad Name: 'Bad Name' is not a header name",
        ),
    ],
)
def test_a_field_that_resolves_to_what_cannot_be_sent_fails_the_attempt_naming_it(
    step: dict[str, Any], input: Any, message: str
) -> None:
    row = _start({"method": "GET", **step}, input)
    assert row.status == "failed"
    assert row.error["class"] == "invalid_input"
    assert row.error["message"].startswith(message)
