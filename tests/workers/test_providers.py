"""The model provider adapters against a local server speaking the providers' wire formats
(tests/model_server.py), through the real SDKs; the offline stand-in; and pricing."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from email.utils import format_datetime
from typing import Any
from urllib.parse import quote, quote_plus

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.model_server import Answer, ModelServer, vector_of
from workers import pricing, providers
from workers.context import Span
from workers.providers import (
    ModelError,
    ModelRequest,
    anthropic_messages,
    base,
    openai_chat,
    standin,
)

API_PROVIDERS = ["openai", "anthropic"]


def ask(text: str = "hello there", **fields: Any) -> ModelRequest:
    """A request; ``call`` sends the model its name gives whatever ``request.model`` says."""
    return ModelRequest(model="ignored", messages=[{"role": "user", "content": text}], **fields)


@pytest.fixture
def server(model_server: ModelServer, monkeypatch: pytest.MonkeyPatch) -> ModelServer:
    """The model server, with both SDKs' variables pointing at it."""
    for name, value in {**model_server.openai_env(), **model_server.anthropic_env()}.items():
        monkeypatch.setenv(name, value)
    return model_server


def failure(name: str, request: ModelRequest | None = None) -> ModelError:
    with pytest.raises(ModelError) as caught:
        providers.call(name, request or ask())
    return caught.value


# --- replies and usage --------------------------------------------------------------------
def test_openai_reply_with_usage_cached_and_reasoning_tokens(server: ModelServer) -> None:
    server.enqueue(
        Answer(
            text="Paris.",
            input_tokens=120,
            output_tokens=30,
            cached_tokens=100,
            reasoning_tokens=20,
            model="gpt-4o-mini-2024-07-18",
        )
    )

    reply = providers.call(
        "openai:gpt-4o-mini", ask("Capital of France?", system="Be brief.", temperature=0.2)
    )

    assert reply.text == "Paris."
    assert reply.model == "gpt-4o-mini-2024-07-18"
    assert (reply.input_tokens, reply.output_tokens) == (120, 30)
    assert (reply.cached_tokens, reply.reasoning_tokens) == (100, 20)
    assert reply.stop_reason == "stop"
    assert reply.request_id == "req_00000000000000000000000000000001"
    (sent,) = server.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.key_header == "authorization" and "authorization" not in sent.headers
    assert sent.body == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
        ],
        # Not api.openai.com: the field every OpenAI-compatible server knows.
        "max_tokens": 1024,
        "temperature": 0.2,
    }


def test_anthropic_reply_counts_cache_reads_in_the_input(server: ModelServer) -> None:
    server.enqueue(
        Answer(text="Paris.", input_tokens=120, output_tokens=30, cached_tokens=100, model="c-4")
    )

    reply = providers.call("anthropic:claude-haiku-4-5", ask("Capital?", system="Be brief."))

    # The wire said input_tokens 20 and cache_read_input_tokens 100: the prompt was 120.
    assert (reply.text, reply.model) == ("Paris.", "c-4")
    assert (reply.input_tokens, reply.output_tokens, reply.cached_tokens) == (120, 30, 100)
    assert reply.reasoning_tokens is None
    assert reply.stop_reason == "end_turn"
    assert reply.request_id == "req_000000000000000000000001"
    (sent,) = server.requests
    assert sent.path == "/v1/messages"
    assert sent.body == {
        "model": "claude-haiku-4-5",
        "max_tokens": 1024,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Capital?"}],
    }


def test_json_asks_openai_for_a_json_object_and_anthropic_through_the_prompt_only(
    server: ModelServer,
) -> None:
    server.enqueue(Answer(json={"a": 1}), Answer(json={"a": 1}))
    schema = {"type": "object"}

    openai_reply = providers.call("openai:m", ask(json=True, json_schema=schema))
    anthropic_reply = providers.call("anthropic:m", ask(json=True, json_schema=schema))

    assert json.loads(openai_reply.text) == json.loads(anthropic_reply.text) == {"a": 1}
    to_openai, to_anthropic = server.requests
    assert to_openai.body["response_format"] == {"type": "json_object"}
    # The schema is a hint for the stand-in: no real provider is sent it.
    assert "json_schema" not in json.dumps(to_openai.body)
    assert set(to_anthropic.body) == {"model", "max_tokens", "messages"}


def test_openai_own_api_is_sent_max_completion_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    client = openai_chat._client(providers.registry.BUILTIN["openai"])

    params = openai_chat._params(providers.registry.BUILTIN["openai"], client, ask(max_tokens=77))

    assert params["max_completion_tokens"] == 77 and "max_tokens" not in params


# --- failures -----------------------------------------------------------------------------
def in_a_minute() -> str:
    return format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)


@pytest.mark.parametrize("provider", API_PROVIDERS)
@pytest.mark.parametrize(
    ("headers", "low", "high"),
    [
        ({"Retry-After": "7"}, 7000, 7000),
        ({"Retry-After": "1.5"}, 1500, 1500),
        ({"retry-after-ms": "250", "Retry-After": "9"}, 250, 250),
        ({"Retry-After": "HTTP-DATE"}, 55_000, 60_000),
        ({"Retry-After": "99999"}, 3_600_000, 3_600_000),
        ({"Retry-After": "soon"}, None, None),
        ({}, None, None),
    ],
)
def test_429_is_retryable_after_what_the_provider_asks(
    server: ModelServer, provider: str, headers: dict[str, str], low: int, high: int
) -> None:
    headers = {k: in_a_minute() if v == "HTTP-DATE" else v for k, v in headers.items()}
    server.enqueue(Answer(status=429, headers=headers, error_message="Rate limit reached"))

    error = failure(f"{provider}:m")

    assert (error.error_class, error.status) == ("retryable", 429)
    if low is None:
        assert error.retry_after_ms is None
    else:
        assert low <= error.retry_after_ms <= high
    assert str(error) == f"provider {provider!r} answered 429: Rate limit reached"
    assert len(server.requests) == 1  # the SDK did not retry by itself


@pytest.mark.parametrize("provider", API_PROVIDERS)
@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (500, "retryable"),
        (502, "retryable"),
        (503, "retryable"),
        (529, "retryable"),
        (408, "retryable"),
        (409, "retryable"),
        (400, "fatal"),
        (401, "fatal"),
        (403, "fatal"),
        (404, "fatal"),
        (422, "fatal"),
    ],
)
def test_status_classes(server: ModelServer, provider: str, status: int, error_class: str) -> None:
    server.enqueue(Answer(status=status, headers={"Retry-After": "2"}, error_message="nope"))

    error = failure(f"{provider}:m")

    assert (error.error_class, error.status) == (error_class, status)
    assert str(error) == f"provider {provider!r} answered {status}: nope"
    # A fatal failure is not tried again, so its pause means nothing.
    assert error.retry_after_ms == (2000 if error_class == "retryable" else None)
    assert len(server.requests) == 1


@pytest.mark.parametrize("provider", API_PROVIDERS)
def test_the_message_masks_an_echoed_key_and_is_truncated(
    server: ModelServer, provider: str
) -> None:
    server.enqueue(
        Answer(status=401, error_message="Incorrect API key provided: test-key. " + "x" * 900)
    )

    text = str(failure(f"{provider}:m", ask("my secret prompt")))

    assert "test-key" not in text and "Incorrect API key provided: ***." in text
    assert "my secret prompt" not in text
    assert len(text) < 500 + 40 and text.endswith("…")


# A realistic key, and each form a provider's (or a proxy's) error text has been seen to
# echo it in (issue 36: only the exact key was masked).
LONG_KEY = "sk-proj-Q3vT9xLmA27bKeR0pZ4wYc8NdHs1FgUj"
ECHOES = {
    "exact": f"key {LONG_KEY} is revoked",
    "upper case": f"KEY {LONG_KEY.upper()} IS REVOKED",
    "cut short": f"Incorrect API key provided: {LONG_KEY[:20]}...",
    "its tail": f"the key ending {LONG_KEY[-12:]} has no access",
    "its middle": f"key fragment {LONG_KEY[10:26]} seen",
    "url-encoded": "GET /v1/models?key=" + quote(LONG_KEY, safe="") + " refused",
    "form-encoded": "body api%5Fkey=" + quote_plus(LONG_KEY) + " refused",
    "json-escaped": json.dumps({"sent": LONG_KEY}),
    "hex": f"token {LONG_KEY.encode().hex()}",
    "base64": "k=" + base64.b64encode(LONG_KEY.encode()).decode(),
    "base64 url-safe": base64.urlsafe_b64encode(b"~~" + LONG_KEY.encode()).decode(),
    "basic credential": "Authorization: Basic "
    + base64.b64encode(f"apikey:{LONG_KEY}".encode()).decode(),
    "basic, user last": "Basic " + base64.b64encode(f"{LONG_KEY}:x".encode()).decode(),
    "bearer header": f"header Authorization: Bearer {LONG_KEY} was refused",
    "x-api-key header": f"x-api-key: {LONG_KEY}",
}


@pytest.mark.parametrize("provider", API_PROVIDERS)
@pytest.mark.parametrize("form", sorted(ECHOES))
def test_the_message_masks_the_key_in_every_form_it_is_echoed_in(
    server: ModelServer, provider: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY" if provider == "openai" else "ANTHROPIC_API_KEY", LONG_KEY)
    server.enqueue(Answer(status=401, error_message=ECHOES[form]))

    text = str(failure(f"{provider}:m"))

    assert "***" in text
    # No eight characters in a row of the key, in any of its forms, whatever the case.
    shown = text.lower()
    forms = [
        LONG_KEY,
        quote(LONG_KEY, safe=""),
        quote_plus(LONG_KEY),
        LONG_KEY.encode().hex(),
        *(
            encode(bytes(shift) + LONG_KEY.encode()).decode()[-(-8 * shift // 6) : -2]
            for shift in range(3)
            for encode in (base64.b64encode, base64.urlsafe_b64encode)
        ),
    ]
    for whole in forms:
        whole = whole.lower()
        assert not any(whole[i : i + 8] in shown for i in range(len(whole) - 7)), (form, text)


@pytest.mark.parametrize(
    ("detail", "shown"),
    [
        # Another credential in an echoed header goes too (a proxy's own key).
        ("Authorization: Bearer proxy-token-77 refused", "Authorization: Bearer *** refused"),
        ('{"api_key": "other-key-123"}', '{"api_key": "***"}'),
        # Words stay words, and a key's four-character tail (what dashboards show) stays.
        ("basic authentication failed", "basic authentication failed"),
        ("Incorrect API key provided: sk-****wxyz.", "Incorrect API key provided: sk-****wxyz."),
    ],
)
def test_credentials_are_masked_and_ordinary_words_are_not(detail: str, shown: str) -> None:
    assert providers.base.status_message("p", 401, detail, "unrelated-key-0") == (
        f"provider 'p' answered 401: {shown}"
    )


@pytest.mark.parametrize("provider", API_PROVIDERS)
def test_a_time_out_is_retryable_and_sends_one_request(server: ModelServer, provider: str) -> None:
    server.enqueue(Answer(hang=True))

    error = failure(f"{provider}:m", ask(timeout_s=0.3))

    assert error.error_class == "retryable" and error.status is None
    assert str(error) == f"provider {provider!r} did not answer within 0.3s"
    assert len(server.wait_for_requests(1)) == 1
    # The server noticed the client leave: the hung call is no longer in flight.
    deadline = threading.Event()
    for _ in range(40):
        if server.in_flight == 0:
            break
        deadline.wait(0.05)
    assert server.in_flight == 0 and len(server.requests) == 1


@pytest.mark.parametrize("provider", API_PROVIDERS)
def test_a_slow_answer_within_the_time_out_arrives(server: ModelServer, provider: str) -> None:
    server.enqueue(Answer(delay_s=0.3, text="late but here"))

    assert providers.call(f"{provider}:m", ask(timeout_s=5)).text == "late but here"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("provider", "variable", "suffix"),
    [("openai", "OPENAI_BASE_URL", "/v1"), ("anthropic", "ANTHROPIC_BASE_URL", "")],
)
def test_connection_refused_is_retryable(
    monkeypatch: pytest.MonkeyPatch, provider: str, variable: str, suffix: str
) -> None:
    monkeypatch.setenv(f"{provider.upper()}_API_KEY", "test-key")
    monkeypatch.setenv(variable, f"http://127.0.0.1:{closed_port()}{suffix}")

    error = failure(f"{provider}:m")

    assert error.error_class == "retryable"
    assert str(error) == f"provider {provider!r} could not be reached: ConnectError"


@pytest.mark.parametrize("provider", API_PROVIDERS)
@pytest.mark.parametrize("body", [b"<html>all good</html>", b'{"unexpected": true}'])
def test_a_garbled_reply_is_retryable(server: ModelServer, provider: str, body: bytes) -> None:
    server.enqueue(Answer(raw_body=body))

    error = failure(f"{provider}:m")

    assert error.error_class == "retryable" and "sent a reply that is not" in str(error)


@pytest.mark.parametrize("provider", API_PROVIDERS)
def test_an_error_page_that_is_not_json_still_names_the_status(
    server: ModelServer, provider: str
) -> None:
    server.enqueue(Answer(status=502, raw_body=b"<html>Bad Gateway</html>"))

    error = failure(f"{provider}:m")

    assert (error.error_class, error.status) == ("retryable", 502)
    assert str(error) == f"provider {provider!r} answered 502: <html>Bad Gateway</html>"


# --- configuration ------------------------------------------------------------------------
def test_split_model() -> None:
    assert providers.split_model("openai:gpt-4o-mini") == ("openai", "gpt-4o-mini")
    assert providers.split_model("ollama:llama3.1:8b") == ("ollama", "llama3.1:8b")
    for bad in ["gpt-4o", "openai:", ":gpt-4o", " openai:gpt-4o", "openai:gpt-4o ", ""]:
        with pytest.raises(ValueError, match="must be '<provider>:<model>'"):
            providers.split_model(bad)


@pytest.mark.parametrize(
    ("variable", "name"),
    [("OPENAI_API_KEY", "openai:gpt-4o-mini"), ("ANTHROPIC_API_KEY", "anthropic:claude-x")],
)
def test_unconfigured_names_the_missing_variable_and_call_sends_nothing(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch, variable: str, name: str
) -> None:
    monkeypatch.delenv(variable)
    provider = name.split(":")[0]
    why = f"provider {provider!r} is not configured: {variable} is not set"

    assert providers.unconfigured(name) == why
    error = failure(name)
    assert (error.error_class, str(error)) == ("fatal", why)
    assert server.requests == []

    monkeypatch.setenv(variable, "k")
    assert providers.unconfigured(name) is None


def test_unconfigured_for_names_and_providers_that_do_not_exist() -> None:
    assert providers.unconfigured("foo:bar") == "no provider 'foo'"
    assert "must be '<provider>:<model>'" in (providers.unconfigured("gpt-4o") or "")
    assert providers.unconfigured("standin:echo") is None
    assert failure("foo:bar").error_class == "fatal"


@pytest.fixture
def local_providers(settings: Any, server: ModelServer) -> ModelServer:
    settings.DJFLOW = {
        **settings.DJFLOW,
        "PROVIDERS": {
            "ollama": {"adapter": "openai", "base_url": server.url + "/v1"},
            "gateway": {
                "adapter": "anthropic",
                "base_url": server.url,
                "api_key_env": "GATEWAY_KEY",
            },
            "broken": {"adapter": "grpc", "base_url": server.url},
            "nowhere": {"adapter": "openai"},
            "odd": {"adapter": "openai", "base_url": server.url, "apikey": "x"},
            "openai": {"adapter": "anthropic", "base_url": server.url},
        },
    }
    return server


def test_a_third_provider_needs_no_engine_change(
    local_providers: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")  # the third provider does not use OpenAI's key

    assert providers.unconfigured("ollama:llama3.1:8b") is None
    reply = providers.call("ollama:llama3.1:8b", ask("hi"))

    assert reply.text == "echo: hi"
    (sent,) = local_providers.requests
    assert sent.path == "/v1/chat/completions" and sent.body["model"] == "llama3.1:8b"
    # A keyless endpoint is still sent a placeholder: the SDK requires one.
    assert sent.key_header == "authorization"


def test_a_third_provider_with_a_key_variable_needs_it(
    local_providers: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAY_KEY", raising=False)
    assert providers.unconfigured("gateway:claude-x") == (
        "provider 'gateway' is not configured: GATEWAY_KEY is not set"
    )

    monkeypatch.setenv("GATEWAY_KEY", "gateway-key")
    assert providers.unconfigured("gateway:claude-x") is None
    assert providers.call("gateway:claude-x", ask("hi")).text == "echo: hi"
    assert [r.path for r in local_providers.requests] == ["/v1/messages"]


def test_a_malformed_third_provider_is_unconfigured_saying_why(local_providers: Any) -> None:
    assert providers.unconfigured("broken:m") == (
        "provider 'broken' in DJFLOW_PROVIDERS: adapter must be 'openai' or 'anthropic', got 'grpc'"
    )
    assert providers.unconfigured("nowhere:m") == (
        "provider 'nowhere' in DJFLOW_PROVIDERS: base_url must be an http(s) URL"
    )
    assert providers.unconfigured("odd:m") == (
        "provider 'odd' in DJFLOW_PROVIDERS: unknown field 'apikey'"
    )
    # A built-in name is not replaced by DJFLOW_PROVIDERS.
    assert providers.unconfigured("openai:m") is None
    providers.call("openai:m", ask())
    assert local_providers.requests[-1].path == "/v1/chat/completions"


def test_default_model(settings: Any) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "DEFAULT_MODEL": ""}
    assert providers.default_model() is None
    settings.DJFLOW = {**settings.DJFLOW, "DEFAULT_MODEL": "openai:gpt-4o-mini"}
    assert providers.default_model() == "openai:gpt-4o-mini"


# --- clients ------------------------------------------------------------------------------
def test_one_client_per_process_rebuilt_after_a_fork_or_a_new_key(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    builtin = providers.registry.BUILTIN["openai"]
    first = openai_chat._client(builtin)
    assert openai_chat._client(builtin) is first
    assert first.max_retries == 0

    monkeypatch.setattr(base.os, "getpid", lambda: -1)  # as in a prefork worker's child
    after_fork = openai_chat._client(builtin)
    assert after_fork is not first and openai_chat._client(builtin) is after_fork

    monkeypatch.setenv("OPENAI_API_KEY", "rotated")
    assert openai_chat._client(builtin) is not after_fork


def test_a_forked_child_calls_through_its_own_client(server: ModelServer) -> None:
    parent_client = openai_chat._client(providers.registry.BUILTIN["openai"])
    providers.call("openai:m", ask("from the parent"))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            reply = providers.call("openai:m", ask("from the child"))
            own = openai_chat._client(providers.registry.BUILTIN["openai"]) is not parent_client
            os.write(write, f"{reply.text}|{own}".encode())
        finally:
            os._exit(0)
    os.close(write)
    _pid, status = os.waitpid(child, 0)
    assert status == 0
    assert os.read(read, 1000).decode() == "echo: from the child|True"
    assert providers.call("openai:m", ask("parent again")).text == "echo: parent again"


# --- the model server itself --------------------------------------------------------------
def test_the_server_counts_calls_in_flight(server: ModelServer) -> None:
    server.enqueue(*[Answer(delay_s=0.4, text="slow") for _ in range(3)])
    threads = [
        threading.Thread(target=providers.call, args=("openai:m", ask(f"n{i}"))) for i in range(3)
    ]
    for thread in threads:
        thread.start()
    server.wait_for_requests(3, timeout=5)
    assert server.in_flight == 3
    for thread in threads:
        thread.join()
    assert (server.in_flight, server.max_in_flight) == (0, 3)


def test_waiting_for_requests_that_never_come_fails(server: ModelServer) -> None:
    with pytest.raises(AssertionError, match="saw 0 requests, not 1"):
        server.wait_for_requests(1, timeout=0.1)


def test_the_default_answer_is_settable(server: ModelServer) -> None:
    server.default = lambda request: Answer(text=request.last_user_message().upper())

    assert providers.call("anthropic:m", ask("shout")).text == "SHOUT"


# --- the stand-in -------------------------------------------------------------------------
def test_the_standin_is_labelled_deterministic_and_offline() -> None:
    request = ask("Summarise   this\nticket please", system="You are terse.")

    reply = providers.call("standin:echo", request)

    assert reply == providers.call("standin:echo", request)
    assert reply.text.startswith("[stand-in model] echo of 30 characters (sha256 ")
    assert reply.text.endswith("'Summarise this ticket please'")
    assert reply.model == "echo"
    assert reply.input_tokens == providers.estimate_input_tokens(request)
    assert reply.output_tokens == -(-len(reply.text.encode()) // 4)
    assert providers.call("standin:echo", ask("other")).text != reply.text


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"kind": {"enum": ["bug", "question"]}}, "required": ["kind"]},
    {
        "type": "object",
        "required": ["title", "score", "count", "ok", "tags", "meta", "version", "nothing"],
        "properties": {
            "title": {"type": "string", "minLength": 12, "maxLength": 20},
            "score": {"type": "number", "minimum": 0.5, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 3},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "meta": {
                "type": "object",
                "properties": {"at": {"type": "string", "format": "date-time"}},
                "required": ["at"],
                "additionalProperties": False,
            },
            "version": {"const": 3},
            "nothing": {"type": "null"},
            "optional": {"type": "string"},
        },
        "additionalProperties": False,
    },
    {
        "$defs": {
            "item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        },
        "type": "array",
        "items": {"$ref": "#/$defs/item"},
        "minItems": 1,
    },
    {"anyOf": [{"type": "integer", "maximum": -3}, {"type": "string"}]},
    {"allOf": [{"required": ["a"]}, {"properties": {"a": {"type": ["string", "null"]}}}]},
    {"type": "number", "exclusiveMaximum": -1},
    {"type": "string", "maxLength": 3},
    {},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_standin_answers_json_valid_for_the_schema(schema: dict[str, Any]) -> None:
    reply = providers.call("standin:echo", ask(json=True, json_schema=schema))

    jsonschema.validate(json.loads(reply.text), schema)


def test_the_standin_answers_json_without_a_schema() -> None:
    reply = providers.call("standin:echo", ask("hi", json=True))

    assert json.loads(reply.text)["stand_in_model"].startswith("echo of 2 characters")


# --- the estimate -------------------------------------------------------------------------
SAMPLES = [
    "Summarise the following support ticket in two sentences.",
    "def f(x):\n    return {k: v for k, v in x.items() if v is not None}\n",
    "東京は日本の首都です。大阪は二番目に大きい都市です。",
    "Ünïcödé ëmojis 🎉🚀✨ and symbols ∑∫√ ≠ ≈",
    "a" * 5000,
]


@pytest.mark.parametrize("provider", API_PROVIDERS)
def test_the_estimate_bounds_what_the_provider_counts(server: ModelServer, provider: str) -> None:
    # The most pessimistic real tokenizer: one token per character (none merge), plus the
    # per-message formatting OpenAI documents (3 per message, 3 to prime the reply).
    server.default = lambda request: Answer(
        text="ok", input_tokens=len(request.prompt_text()) + 3 * 3 + 3
    )
    for sample in SAMPLES:
        request = ask(sample, system="You answer support tickets.")

        reply = providers.call(f"{provider}:m", request)

        assert providers.estimate_input_tokens(request) >= reply.input_tokens


@given(st.text(), st.lists(st.text(), min_size=1, max_size=5))
def test_the_estimate_is_at_least_one_token_per_character(system: str, texts: list[str]) -> None:
    request = ModelRequest(
        model="m", messages=[{"role": "user", "content": t} for t in texts], system=system
    )

    assert providers.estimate_input_tokens(request) >= len(system) + sum(map(len, texts)) + 3


# --- pricing ------------------------------------------------------------------------------
M = 1_000_000


def test_bundled_prices() -> None:
    assert pricing.call_cost("openai", "gpt-4o-mini", input_tokens=M, output_tokens=M) == Decimal(
        "0.75"
    )
    # Cache reads at a tenth of Sonnet's $3 input price.
    assert pricing.call_cost(
        "anthropic", "claude-sonnet-4", input_tokens=M, output_tokens=0, cached_tokens=M // 2
    ) == Decimal("1.65")
    assert pricing.call_cost(None, "claude-sonnet-4", input_tokens=M, output_tokens=0) == 3


def test_unknown_models_and_providers_have_no_price() -> None:
    assert pricing.call_cost("openai", "no-such-model", input_tokens=1, output_tokens=1) is None
    assert pricing.call_cost("ollama", "llama3.1:8b", input_tokens=1, output_tokens=1) is None


def test_djflow_prices_win(settings: Any) -> None:
    settings.DJFLOW = {
        **settings.DJFLOW,
        "PRICES": {
            "gpt-4o-mini": {"input": 1, "output": 2},
            "ollama:llama3.1:8b": {"input": 0.1, "output": 0.2, "cached_input": 0.01},
            "standin:echo": {"input": 5, "output": 5},
        },
    }

    assert pricing.call_cost("openai", "gpt-4o-mini", input_tokens=M, output_tokens=M) == 3
    assert pricing.call_cost(
        "ollama", "llama3.1:8b", input_tokens=M, output_tokens=M, cached_tokens=M
    ) == Decimal("0.21")
    assert pricing.call_cost("standin", "echo", input_tokens=M, output_tokens=M) == 10


def test_the_standin_is_free_unless_priced() -> None:
    assert pricing.call_cost("standin", "echo", input_tokens=M, output_tokens=M) == 0


def test_worst_case_cost_takes_max_tokens_and_no_cache_discount() -> None:
    worst = pricing.worst_case_cost("openai", "gpt-4o-mini", input_tokens=2000, max_tokens=1000)

    assert worst == Decimal("0.15") * 2000 / M + Decimal("0.6") * 1000 / M
    assert pricing.worst_case_cost("x", "unknown", input_tokens=1, max_tokens=1) is None


def test_a_span_is_priced_by_its_provider_and_model() -> None:
    span = Span("call", "model_generation", {})
    span.set_model("claude-sonnet-4", "anthropic")
    span.set_usage(input_tokens=812, output_tokens=37)

    assert span.cost_usd == Decimal("0.002991")

    local = Span("call", "model_generation", {})
    local.set_model("llama3.1:8b", "ollama")
    local.set_usage(input_tokens=812, output_tokens=37)
    assert local.cost_usd is None and local.as_dict()["priced"] is False


def test_the_examples_made_up_model_call_is_the_stand_ins_and_costs_nothing() -> None:
    """support_ticket's draft calls no model but recorded its made-up usage on
    claude-sonnet-4 by anthropic: a load test of the example showed $1.50 of spend that no
    provider charged (issue 37). Its span is the offline stand-in's, priced at 0."""
    from contextlib import contextmanager

    from workflows.examples import support_ticket

    spans: list[Span] = []

    class Context:
        @contextmanager
        def span(self, name: str, kind: str = "internal", **attributes: Any) -> Any:
            spans.append(Span(name, kind, attributes))
            yield spans[-1]

    assert support_ticket.draft(Context(), {"kind": "bug"}, None) == "an answer to a bug"
    [span] = spans
    assert (span.provider, span.model) == ("standin", "echo")
    assert span.usage == {"input_tokens": 812, "output_tokens": 37}
    assert span.cost_usd == 0 and span.as_dict()["priced"] is True


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0),  # a date past: go now
        ({"Retry-After": "-5"}, 0),
        ({"Retry-After": "nan"}, None),
        ({"Retry-After": "inf"}, None),
        ({"retry-after-ms": "nope", "retry-after": "2"}, 2000),
        ({"RETRY-AFTER-MS": "10.2"}, 11),
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00"}, None),  # no zone: not an HTTP date
    ],
)
def test_retry_after_edge_cases(headers: dict[str, str], expected: int | None) -> None:
    assert base.retry_after_ms(headers) == expected


# --- embeddings ---------------------------------------------------------------------------
NOT_EMBEDDINGS = "provider 'openai' sent a reply that is not"
TICKETS = ["printer jam in tray 2", "refund for order 1182", "VPN drops every hour"]


def embed_failure(name: str, texts: Any = TICKETS, **options: Any) -> ModelError:
    with pytest.raises(ModelError) as caught:
        providers.embed(name, texts, **options)
    return caught.value


def test_openai_embeddings_with_usage_through_the_sdk(server: ModelServer) -> None:
    server.enqueue(Answer(input_tokens=17, model="text-embedding-3-small-v1"))

    reply = providers.embed("openai:text-embedding-3-small", TICKETS)

    assert reply.vectors == [vector_of(text) for text in TICKETS]
    assert (reply.model, reply.input_tokens, reply.dimensions) == (
        "text-embedding-3-small-v1",
        17,
        8,
    )
    assert reply.request_id == "req_00000000000000000000000000000001"
    (sent,) = server.requests
    assert sent.path == "/v1/embeddings" and sent.key_header == "authorization"
    # The SDK asks for base64 and decodes it; no dimensions unless asked.
    assert sent.body == {
        "model": "text-embedding-3-small",
        "input": TICKETS,
        "encoding_format": "base64",
    }


def test_dimensions_are_sent_and_kept(server: ModelServer) -> None:
    reply = providers.embed("openai:text-embedding-3-small", TICKETS, dimensions=5)

    assert reply.dimensions == 5 and reply.vectors == [vector_of(t, 5) for t in TICKETS]
    assert server.requests[0].body["dimensions"] == 5


@pytest.mark.parametrize("order", [[2, 0, 1], [2, 1, 0], [1, 2, 0]], ids=["201", "210", "120"])
def test_vectors_come_back_in_the_order_of_the_texts(server: ModelServer, order: list[int]) -> None:
    server.enqueue(Answer(order=order))

    reply = providers.embed("openai:m", TICKETS)

    assert reply.vectors == [vector_of(text) for text in TICKETS]


def test_a_server_answering_floats_is_read_too(server: ModelServer) -> None:
    server.enqueue(Answer(encoding="float", vectors=[[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]))

    reply = providers.embed("openai:m", TICKETS)

    # Floats as sent, not rounded to float32 as base64 would be.
    assert reply.vectors == [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]


def test_a_reply_of_other_dimensions_than_asked_is_fatal_naming_the_setting(
    server: ModelServer,
) -> None:
    # A server that ignores `dimensions` (an older Ollama) and answers its model's own size.
    server.enqueue(Answer(vectors=[[1.0] * 6] * 3))

    error = embed_failure("openai:m", dimensions=4)

    assert error.error_class == "fatal"
    assert str(error) == (
        "model openai:m answered embeddings of 6 dimensions, not the 4 asked for"
        " (DJFLOW_EMBEDDINGS_DIMENSIONS)"
    )


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (Answer(order=[0, 1]), "provider 'openai' sent 2 embeddings for 3 texts"),
        (Answer(order=[0, 1, 1]), f"{NOT_EMBEDDINGS} a list of embeddings"),
        (Answer(order=[]), f"{NOT_EMBEDDINGS} a list of embeddings"),
        (
            Answer(
                raw_body=b'{"object": "list", "model": "m", "data": ['
                b'{"index": null, "embedding": [1]}, {"index": 0, "embedding": [1]},'
                b'{"index": 1, "embedding": [1]}]}'
            ),
            f"{NOT_EMBEDDINGS} a list of embeddings",
        ),
        (
            Answer(vectors=[[1.0, 2.0], [1.0], [3.0, 4.0]], encoding="float"),
            "provider 'openai' sent a reply that is not embeddings of one length",
        ),
        (
            Answer(vectors=[[1.0], [float("nan")], [2.0]]),
            "provider 'openai' sent a reply that is not embeddings of finite numbers",
        ),
        (
            Answer(raw_body=b'{"object": "list", "data": [{"index": 0}]}'),
            "provider 'openai' sent a reply that is not a list of embeddings",
        ),
        (
            Answer(vectors=[[1.0], ["1"], [2.0]], encoding="float"),
            "provider 'openai' sent a reply that is not a list of embeddings",
        ),
        (Answer(raw_body=b"<html>ok</html>"), "provider 'openai' sent a reply that is not"),
    ],
    ids=[
        "too-few",
        "duplicate-index",
        "no-data",
        "null-index",
        "ragged",
        "nan",
        "no-vector",
        "text",
        "html",
    ],
)
def test_a_malformed_embeddings_reply_is_retryable(
    server: ModelServer, answer: Answer, message: str
) -> None:
    server.enqueue(answer)

    error = embed_failure("openai:m")

    assert error.error_class == "retryable" and str(error).startswith(message)


@pytest.mark.parametrize(
    ("status", "error_class"), [(429, "retryable"), (500, "retryable"), (400, "fatal")]
)
def test_embeddings_errors_are_classed_like_calls(
    server: ModelServer, status: int, error_class: str
) -> None:
    server.enqueue(Answer(status=status, headers={"Retry-After": "3"}, error_message="no"))

    error = embed_failure("openai:m")

    assert (error.error_class, error.status) == (error_class, status)
    assert error.retry_after_ms == (3000 if error_class == "retryable" else None)
    assert str(error) == f"provider 'openai' answered {status}: no"
    assert len(server.requests) == 1


def test_an_embeddings_time_out_and_a_refused_connection_are_retryable(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.enqueue(Answer(hang=True))
    assert str(embed_failure("openai:m", timeout_s=0.3)) == (
        "provider 'openai' did not answer within 0.3s"
    )

    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{closed_port()}/v1")
    error = embed_failure("openai:m")
    assert (error.error_class, str(error)) == (
        "retryable",
        "provider 'openai' could not be reached: ConnectError",
    )


def test_a_reply_without_usage_counts_the_bound(server: ModelServer) -> None:
    body = {
        "object": "list",
        "model": "m",
        "data": [{"object": "embedding", "index": i, "embedding": [1.0]} for i in range(3)],
    }
    server.enqueue(Answer(raw_body=json.dumps(body).encode()))

    reply = providers.embed("openai:m", TICKETS)

    assert reply.input_tokens == sum(len(text.encode()) for text in TICKETS)


def test_a_third_provider_of_the_openai_format_embeds(
    local_providers: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")

    reply = providers.embed("ollama:nomic-embed-text", ["hello"])

    assert reply.vectors == [vector_of("hello")]
    (sent,) = local_providers.requests
    assert sent.path == "/v1/embeddings" and sent.body["model"] == "nomic-embed-text"


@pytest.mark.parametrize(
    "name", ["anthropic:voyage-3", "gateway:embed-x"], ids=["anthropic", "third-party"]
)
def test_the_anthropic_format_cannot_embed_and_sends_nothing(
    local_providers: ModelServer, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("GATEWAY_KEY", "gateway-key")
    provider, model = name.split(":")
    why = (
        f"model '{name}' cannot embed: provider {provider!r} speaks Anthropic's messages API,"
        " which has no embeddings endpoint; name an OpenAI-compatible or standin model"
    )

    assert providers.embeddings_unconfigured(name) == why
    error = embed_failure(name)
    assert (error.error_class, str(error)) == ("fatal", why)
    # The adapter itself refuses too, should anything reach it.
    with pytest.raises(ModelError, match="has no embeddings endpoint"):
        anthropic_messages.embed(
            providers.registry.BUILTIN["anthropic"], model, ["x"], dimensions=None, timeout_s=1
        )
    assert local_providers.requests == []


def test_embeddings_unconfigured_gives_the_reasons_of_calls(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")
    why = "provider 'openai' is not configured: OPENAI_API_KEY is not set"

    assert providers.embeddings_unconfigured("openai:text-embedding-3-small") == why
    assert str(embed_failure("openai:text-embedding-3-small")) == why
    assert providers.embeddings_unconfigured("text-embedding-3-small") is not None
    assert providers.embeddings_unconfigured("standin:hash") is None
    assert server.requests == []


@pytest.mark.parametrize(
    ("texts", "options", "message"),
    [
        (["ok", "  \n"], {}, "text 1 is empty: there is nothing to embed"),
        (["ok", 3], {}, "text 1 is int, not a string"),
        ("one string", {}, "texts must be a list of strings, not one string"),
        (["x"] * 2049, {}, "2049 texts in one batch, more than 2048"),
        (["x"], {"dimensions": 0}, "dimensions must be a positive integer, not 0"),
        (["x"], {"dimensions": True}, "dimensions must be a positive integer, not True"),
    ],
    ids=["blank", "not-a-string", "a-string", "too-many", "zero-dimensions", "bool-dimensions"],
)
def test_a_batch_that_cannot_be_embedded_is_fatal_before_any_request(
    server: ModelServer, texts: Any, options: dict[str, Any], message: str
) -> None:
    for name in ("openai:m", "standin:hash"):
        error = embed_failure(name, texts, **options)

        assert (error.error_class, str(error)) == ("fatal", message)
    assert server.requests == []


def test_no_texts_is_an_empty_reply_without_a_request(server: ModelServer) -> None:
    reply = providers.embed("openai:m", [])

    assert (reply.vectors, reply.input_tokens, reply.dimensions) == ([], 0, 0)
    assert server.requests == []


def test_the_configured_embeddings_model(settings: Any) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "EMBEDDINGS_MODEL": "", "EMBEDDINGS_DIMENSIONS": None}
    assert providers.embeddings_model() is None

    settings.DJFLOW = {
        **settings.DJFLOW,
        "EMBEDDINGS_MODEL": " openai:text-embedding-3-small ",
        "EMBEDDINGS_DIMENSIONS": 256,
    }
    assert providers.embeddings_model() == providers.EmbeddingsModel(
        "openai:text-embedding-3-small", 256
    )


# --- the stand-in's embeddings ------------------------------------------------------------
def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_the_standin_embeds_offline_deterministically_and_by_shared_words() -> None:
    texts = ["Printer jam in tray 2", "printer JAM", "refund for order 1182", "???"]

    reply = providers.embed("standin:hash", texts)

    assert reply == providers.embed("standin:hash", texts)
    assert reply.dimensions == standin.EMBED_DIMENSIONS == 384
    assert reply.model == "hash" and reply.request_id.startswith("standin-")
    assert reply.input_tokens == sum(-(-len(t.encode()) // 4) for t in texts)
    jam, jam_again, refund, marks = reply.vectors
    assert cosine(jam, jam_again) > 0.6 > cosine(jam, refund)
    # No word characters: the text stands for one word, so it still has a direction.
    assert cosine(marks, marks) == pytest.approx(1.0)
    assert providers.embed("standin:hash", ["x"], dimensions=16).dimensions == 16


def test_the_standin_weighs_repeated_words_sublinearly() -> None:
    once, thrice = standin.embedding("jam printer"), standin.embedding("jam jam jam printer")

    # 1 + ln 3 against 1: repeated, a word counts more, but not three times more.
    assert 0.7 < cosine(once, thrice) < 0.95


@given(st.text(min_size=1).filter(str.strip), st.integers(min_value=1, max_value=64))
def test_a_standin_embedding_has_length_one(text: str, dimensions: int) -> None:
    vector = standin.embedding(text, dimensions)

    assert len(vector) == dimensions
    assert sum(value * value for value in vector) == pytest.approx(1.0)


# --- embedding prices ---------------------------------------------------------------------
def test_embeddings_are_priced_by_their_input_tokens(settings: Any) -> None:
    assert pricing.embedding_cost("openai", "text-embedding-3-small", input_tokens=M) == Decimal(
        "0.02"
    )
    assert pricing.embedding_cost("ollama", "nomic-embed-text", input_tokens=M) is None
    assert pricing.embedding_cost("standin", "hash", input_tokens=M) == 0

    settings.DJFLOW = {**settings.DJFLOW, "PRICES": {"ollama:nomic-embed-text": {"input": 0.01}}}
    assert pricing.embedding_cost("ollama", "nomic-embed-text", input_tokens=M) == Decimal("0.01")


@pytest.mark.parametrize("dotted", [0, 5, 40])
def test_text_whose_lower_case_is_longer_masks_the_key_where_it_is(dotted: int) -> None:
    """ "İ".lower() is two characters: positions found in str.lower()'s text moved the mask
    past the key (its whole self shown after 40 of them). Case is folded on ASCII only."""
    key = "sk-proj-Z7rQ2mW9xK4tL8vN3pB6"
    text = "İ" * dotted + f" model not found; url https://api.example/v1?k={key}"
    masked = providers.base.mask_secret(text, key)
    assert masked == "İ" * dotted + " model not found; url https://api.example/v1?k=***"
