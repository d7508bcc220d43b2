"""A local HTTP server that speaks the model providers' real wire formats, for tests.

``POST /v1/chat/completions`` answers as OpenAI's chat completions API,
``POST /v1/embeddings`` as its embeddings API (floats, or base64 of little-endian float32
when the request asks, as the SDK does) and ``POST /v1/messages`` as Anthropic's messages
API: the same JSON bodies, error bodies and headers (request ids, ``Retry-After``) the
official SDKs parse, so the SDKs are exercised unmocked, over a real socket (respx cannot
see their httpx2 transport anyway). It runs in a thread of the test process on 127.0.0.1,
so worker processes the test starts reach it too.

Scriptable: answers queued with :meth:`ModelServer.enqueue` are used first, one per request
in arrival order; with the queue empty, ``server.default`` (a function of the recorded
request) answers: a deterministic echo of the last user message, usage counted as a quarter
of the characters (embeddings: :func:`vector_of` each input). Every request is recorded
(path, headers with the key left out, JSON body, time received); ``in_flight`` and
``max_in_flight`` count the requests being answered.
"""

from __future__ import annotations

import base64
import hashlib
import json
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

OPENAI_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# The length of a default embedding when the request names no ``dimensions``.
DEFAULT_DIMENSIONS = 8
ANTHROPIC_PATH = "/v1/messages"
KEY_HEADERS = ("authorization", "x-api-key", "api-key")
# A hanging answer gives up after this long even if the client never leaves.
HANG_LIMIT_S = 120.0

_OPENAI_ERRORS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    409: ("invalid_request_error", "conflict"),
    429: ("requests", "rate_limit_exceeded"),
}
_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@dataclass
class Answer:
    """One scripted answer. ``json`` is sent as the reply's text (serialised); a status of
    400 and over sends the provider's error body with ``error_message``; ``raw_body`` is sent
    as it is (a malformed reply). ``delay_s`` waits before answering; ``hang`` never answers
    (until the client goes away or the server stops). Token counts left None are counted
    from the text."""

    text: str | None = None
    json: Any = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    hang: bool = False
    error_message: str | None = None
    error_type: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    stop_reason: str | None = None
    model: str | None = None
    raw_body: bytes | None = None
    # Embeddings: the vectors sent (None: vector_of each input); the order their entries are
    # sent in, as positions of the inputs (None: in order; each entry keeps its ``index``);
    # "float" or "base64" whatever the request asked (None: as it asked).
    vectors: list[list[float]] | None = None
    order: list[int] | None = None
    encoding: str | None = None


@dataclass(frozen=True)
class Recorded:
    """A request as the server saw it. ``headers`` are lower-cased, without the key's value:
    ``key_header`` says which header carried one."""

    path: str
    headers: dict[str, str]
    body: Any
    received_at: float
    key_header: str | None

    @property
    def api(self) -> str:
        return "anthropic" if self.path == ANTHROPIC_PATH else "openai"

    def prompt_text(self) -> str:
        """System prompt and message contents, as the model would read them."""
        body = self.body if isinstance(self.body, dict) else {}
        parts = [str(body.get("system") or "")]
        parts += [_content_text(m.get("content")) for m in body.get("messages") or []]
        return "".join(parts)

    def inputs(self) -> list[str]:
        """An embeddings request's texts (``input`` is one string or a list of them)."""
        body = self.body if isinstance(self.body, dict) else {}
        given = body.get("input")
        return [given] if isinstance(given, str) else [str(text) for text in given or []]

    def last_user_message(self) -> str:
        body = self.body if isinstance(self.body, dict) else {}
        for message in reversed(body.get("messages") or []):
            if message.get("role") == "user":
                return _content_text(message.get("content"))
        return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def vector_of(text: str, dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    """The default embedding of ``text``: its length, then bytes of its SHA-256 over 256.
    Every value is exact in float32, so a base64 reply decodes to these very numbers."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return [float(len(text))] + [digest[i % 32] / 256 for i in range(dimensions - 1)]


def echo(request: Recorded) -> Answer:
    """The default answer: the last user message echoed back."""
    return Answer(text=f"echo: {request.last_user_message()}")


class ModelServer:
    """Start with ``with ModelServer() as server:`` (or the ``model_server`` fixture)."""

    def __init__(self, default: Callable[[Recorded], Answer] = echo) -> None:
        self.default = default
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Answer] = deque()
        self._requests: list[Recorded] = []
        self._in_flight = 0
        self._max_in_flight = 0
        self._served = 0
        self._closing = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        # A short poll: shutdown() waits up to one poll interval (0.5 s by default).
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.02,), name="model-server", daemon=True
        )

    # --- life -------------------------------------------------------------------------------
    def start(self) -> ModelServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- where ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def openai_env(self) -> dict[str, str]:
        return {"OPENAI_API_KEY": "test-key", "OPENAI_BASE_URL": self.url + "/v1"}

    def anthropic_env(self) -> dict[str, str]:
        return {"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": self.url}

    # --- script and observe -----------------------------------------------------------------
    def enqueue(self, *answers: Answer) -> None:
        with self._lock:
            self._queue.extend(answers)

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def max_in_flight(self) -> int:
        with self._lock:
            return self._max_in_flight

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[Recorded]:
        """The first ``count`` requests, once that many have arrived; AssertionError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self._requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"the model server saw {len(self._requests)} requests, not {count},"
                        f" within {timeout}s"
                    )
                self._arrived.wait(left)
            return self._requests[:count]

    # --- the handler's side -----------------------------------------------------------------
    def _arrive(self, recorded: Recorded) -> tuple[Answer, int]:
        with self._arrived:
            self._requests.append(recorded)
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            self._served += 1
            self._arrived.notify_all()
            answer = self._queue.popleft() if self._queue else None
            serial = self._served
        return (answer or self.default(recorded)), serial

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _closing_or_timeout(self, seconds: float) -> bool:
        return self._closing.wait(seconds)


def _handler_for(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        model_server = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in one segment (buffered, flushed after each request) and
    # without Nagle: written apart, the client's delayed ACK cost 40 ms per answer.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    model_server: ModelServer

    def log_message(self, format: str, *args: Any) -> None:  # the test output stays quiet
        pass

    def do_POST(self) -> None:
        body = self._read_body()
        recorded = Recorded(
            path=self.path.split("?")[0],
            headers={k.lower(): v for k, v in self.headers.items() if k.lower() not in KEY_HEADERS},
            body=body,
            received_at=time.time(),
            key_header=next((k for k in KEY_HEADERS if self.headers.get(k)), None),
        )
        answer, serial = self.model_server._arrive(recorded)
        try:
            self._answer(recorded, answer, serial)
        finally:
            self.model_server._leave()

    def do_GET(self) -> None:
        self._send(404, {"error": {"message": f"no route GET {self.path}"}}, {})

    def _read_body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode("utf-8", "replace")

    def _answer(self, recorded: Recorded, answer: Answer, serial: int) -> None:
        if answer.hang:
            self._wait_while_client_stays(HANG_LIMIT_S)
            self.close_connection = True
            return
        if answer.delay_s and not self._wait_while_client_stays(answer.delay_s):
            self.close_connection = True
            return
        if recorded.path not in (OPENAI_PATH, ANTHROPIC_PATH, EMBEDDINGS_PATH):
            answer = Answer(status=404, error_message=f"Unknown request URL: POST {self.path}")
        headers = {**_id_headers(recorded.api, serial), **answer.headers}
        if answer.raw_body is not None:
            self._send_bytes(answer.status, answer.raw_body, headers)
        elif answer.status >= 400:
            self._send(answer.status, _error_body(recorded.api, answer, serial), headers)
        elif recorded.path == EMBEDDINGS_PATH:
            self._send(answer.status, _openai_embeddings(recorded, answer), headers)
        elif recorded.api == "anthropic":
            self._send(answer.status, _anthropic_message(recorded, answer, serial), headers)
        else:
            self._send(answer.status, _openai_completion(recorded, answer, serial), headers)

    def _wait_while_client_stays(self, seconds: float) -> bool:
        """Wait ``seconds``; False as soon as the client closes its connection (a client
        time-out) or the server stops, so a hung request stops counting as in flight."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.model_server._closing_or_timeout(0):
                return False
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                return False
        return True

    def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
        self._send_bytes(status, json.dumps(body).encode(), headers)

    def _send_bytes(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


def _id_headers(api: str, serial: int) -> dict[str, str]:
    if api == "anthropic":
        return {"request-id": f"req_{serial:024d}"}
    return {"x-request-id": f"req_{serial:032d}", "openai-processing-ms": "1"}


def _text(answer: Answer) -> str:
    if answer.json is not None:
        return json.dumps(answer.json)
    return answer.text or ""


def _usage(recorded: Recorded, answer: Answer, text: str) -> tuple[int, int, int, int]:
    """input (the whole prompt), output, cached, reasoning: the answer's, else a quarter of
    the characters."""
    prompt = answer.input_tokens
    if prompt is None:
        prompt = len(recorded.prompt_text()) // 4
    output = len(text) // 4 if answer.output_tokens is None else answer.output_tokens
    return prompt, output, answer.cached_tokens or 0, answer.reasoning_tokens or 0


def _model(recorded: Recorded, answer: Answer) -> str:
    body = recorded.body if isinstance(recorded.body, dict) else {}
    return answer.model or str(body.get("model") or "unknown")


def _openai_completion(recorded: Recorded, answer: Answer, serial: int) -> dict[str, Any]:
    text = _text(answer)
    prompt, output, cached, reasoning = _usage(recorded, answer, text)
    return {
        "id": f"chatcmpl-{serial:010d}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": _model(recorded, answer),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": answer.stop_reason or "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": reasoning,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": "fp_model_server",
    }


def _openai_embeddings(recorded: Recorded, answer: Answer) -> dict[str, Any]:
    body = recorded.body if isinstance(recorded.body, dict) else {}
    inputs = recorded.inputs()
    dimensions = body.get("dimensions") or DEFAULT_DIMENSIONS
    vectors = answer.vectors
    if vectors is None:
        vectors = [vector_of(text, dimensions) for text in inputs]
    encoding = answer.encoding or body.get("encoding_format") or "float"
    order = range(len(vectors)) if answer.order is None else answer.order
    prompt = answer.input_tokens
    if prompt is None:
        prompt = sum(len(text) // 4 for text in inputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(vectors[i], encoding)}
            for i in order
        ],
        "model": _model(recorded, answer),
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


def _encoded(vector: list[float], encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _anthropic_message(recorded: Recorded, answer: Answer, serial: int) -> dict[str, Any]:
    text = _text(answer)
    prompt, output, cached, _reasoning = _usage(recorded, answer, text)
    return {
        "id": f"msg_{serial:024d}",
        "type": "message",
        "role": "assistant",
        "model": _model(recorded, answer),
        "content": [{"type": "text", "text": text}],
        "stop_reason": answer.stop_reason or "end_turn",
        "stop_sequence": None,
        # Anthropic's input_tokens leaves out what was read from the cache.
        "usage": {
            "input_tokens": max(0, prompt - cached),
            "output_tokens": output,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        },
    }


def _error_body(api: str, answer: Answer, serial: int) -> dict[str, Any]:
    message = answer.error_message or f"scripted error {answer.status}"
    if api == "anthropic":
        kind = answer.error_type or _ANTHROPIC_ERRORS.get(
            answer.status, "api_error" if answer.status >= 500 else "invalid_request_error"
        )
        return {
            "type": "error",
            "error": {"type": kind, "message": message},
            "request_id": f"req_{serial:024d}",
        }
    kind, code = _OPENAI_ERRORS.get(
        answer.status, ("server_error" if answer.status >= 500 else "invalid_request_error", None)
    )
    return {
        "error": {
            "message": message,
            "type": answer.error_type or kind,
            "param": None,
            "code": code,
        }
    }
