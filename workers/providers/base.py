"""What every model provider adapter shares: the request and reply, the one error type, the
classification of failures, ``Retry-After`` and the per-process client cache.

Invariants:

- A :class:`ModelError`'s text names the provider, the HTTP status and the provider's own
  message (at most 500 characters) and nothing else: never the API key (a key the provider
  echoes back is masked) and never the prompt.
- 429, 408, 409, 5xx, time-outs and connection errors are ``retryable``; every other failure
  is ``fatal``. The SDKs never retry (``max_retries=0``): the step's retry policy is the only
  one, so one ``call`` is exactly one HTTP request.
- ``retry_after_ms`` comes from the reply's ``retry-after-ms`` or ``Retry-After`` header
  (seconds or an HTTP date), capped at an hour; None when the reply says nothing.
- A client belongs to the process that built it: after a fork (a prefork worker child) the
  cache is emptied and clients are built again, so no two processes share a connection pool.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Literal, TypeVar
from urllib.parse import quote, quote_plus

ErrorClass = Literal["retryable", "fatal"]

# A provider asking for a longer pause than this is asking for a step to wait out an outage;
# the step's retry budget, not one header, decides that.
MAX_RETRY_AFTER_MS = 3_600_000
MAX_PROVIDER_MESSAGE = 500


T = TypeVar("T")


@dataclass(frozen=True)
class ModelRequest:
    """One model call. ``model`` is the provider's own name (after ``"provider:"``)."""

    model: str
    messages: list[dict[str, str]]
    system: str | None = None
    max_tokens: int = 1024
    temperature: float | None = None
    # Ask for a JSON reply: OpenAI gets response_format json_object; Anthropic has no such
    # switch, the prompt asks.
    json: bool = False
    # A hint for the offline stand-in only; never sent to a real provider.
    json_schema: dict[str, Any] | None = None
    timeout_s: float = 60.0


@dataclass(frozen=True)
class ModelReply:
    """A model's answer. ``input_tokens`` counts the whole prompt, cached tokens included;
    ``cached_tokens`` is the part of it read from the provider's prompt cache."""

    text: str
    model: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    stop_reason: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class EmbedReply:
    """Embeddings of a batch of texts: ``vectors[i]`` is the embedding of ``texts[i]``, each
    of the same length (the reply's dimensions). ``input_tokens`` is what the provider
    counted for the whole batch (embeddings have no output tokens)."""

    vectors: list[list[float]]
    model: str
    input_tokens: int
    request_id: str | None = None

    @property
    def dimensions(self) -> int:
        return len(self.vectors[0]) if self.vectors else 0


class ModelError(Exception):
    """A failed model call. ``str()`` is safe to store and show: no key, no prompt."""

    def __init__(
        self,
        message: str,
        *,
        error_class: ErrorClass,
        retry_after_ms: int | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.error_class: ErrorClass = error_class
        self.retry_after_ms = retry_after_ms
        self.status = status


def class_of_status(status: int) -> ErrorClass:
    """429 (rate limited), 408 (request time-out), 409 (lock conflict) and 5xx pass; other
    4xx are the request's own fault and would fail the same way again."""
    return "retryable" if status in (408, 409, 429) or status >= 500 else "fatal"


def retry_after_ms(headers: Mapping[str, str], *, now: float | None = None) -> int | None:
    """The pause a reply asks for, in milliseconds: ``retry-after-ms`` (OpenAI's, finer)
    first, then ``Retry-After`` as seconds or an HTTP date. Capped at an hour."""
    lowered = {key.lower(): value for key, value in headers.items()}
    millis = _number(lowered.get("retry-after-ms"))
    if millis is None:
        seconds = _number(lowered.get("retry-after"))
        if seconds is None:
            seconds = _seconds_until(lowered.get("retry-after"), now)
        millis = None if seconds is None else seconds * 1000
    if millis is None:
        return None
    return min(MAX_RETRY_AFTER_MS, max(0, math.ceil(millis)))


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def _seconds_until(value: str | None, now: float | None) -> float | None:
    if not value:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT by definition
        return None
    return when.timestamp() - (time.time() if now is None else now)


def status_message(provider: str, status: int, detail: str | None, secret: str | None) -> str:
    """``provider 'openai' answered 429: <the provider's message>``, the message truncated
    and any echo of the key masked."""
    text = f"provider {provider!r} answered {status}"
    detail = (detail or "").strip()
    if not detail:
        return text
    detail = mask_secret(detail[:MASK_SCAN], secret)
    if len(detail) > MAX_PROVIDER_MESSAGE:
        detail = detail[: MAX_PROVIDER_MESSAGE - 1] + "…"
    return f"{text}: {detail}"


# Any run of this many characters of the key, in any of its forms, is masked: a provider (or
# a proxy in front of it) that echoes part of a key (its first characters, a "...abcd1234"
# tail, a value cut short) shows fewer than this of it in a row. OpenAI's own "Incorrect API
# key provided: sk-proj-****...abcd" keeps four, which stay: they are what its dashboard shows.
MASK_RUN = 8
# Credentials in an echoed request header are masked whatever they are (a proxy's own key
# too): the scheme and the header's name stay, the value goes.
_CREDENTIAL = re.compile(
    r"(?i)(\b(?:x-api-key|api[-_]?key|authorization)[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic)\s+)?"
    r"|\b(?:bearer|basic)\s+)"
    # A credential has a digit or a symbol ("basic authentication failed" keeps its word).
    r"(?=[A-Za-z]*[0-9._~+/=%-])[A-Za-z0-9._~+/=%-]{4,}"
)
# A provider's message is cut to this before masking (a body of megabytes is not scanned);
# what is shown is cut again to MAX_PROVIDER_MESSAGE.
MASK_SCAN = 8 * MAX_PROVIDER_MESSAGE


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def mask_secret(text: str, secret: str | None) -> str:
    """``text`` with the API key masked as ``***``: the key as is, URL-encoded, JSON-escaped,
    in hexadecimal and in base64 (standard or URL-safe, at any offset, so inside a Basic
    credential too), compared without case; any :data:`MASK_RUN` characters in a row of
    those forms; and the value of any Bearer or Basic credential or key header. A key
    shorter than four characters is no key worth masking (and would mask common text)."""
    if secret and len(secret) >= 4:
        forms = _secret_forms(secret)
        covered = bytearray(len(text))
        # ASCII only: str.lower() may change the length ("İ" becomes two characters), and
        # positions found in the lowered text are masked in the text itself.
        lowered = text.translate(_ASCII_LOWER)
        for form in forms:
            start = lowered.find(form)
            while start != -1:
                covered[start : start + len(form)] = b"\1" * len(form)
                start = lowered.find(form, start + 1)
        runs = {form[i : i + MASK_RUN] for form in forms for i in range(len(form) - MASK_RUN + 1)}
        for i in range(len(text) - MASK_RUN + 1):
            if lowered[i : i + MASK_RUN] in runs:
                covered[i : i + MASK_RUN] = b"\1" * MASK_RUN
        text = _masked(text, covered)
    return _CREDENTIAL.sub(lambda match: f"{match.group(1)}***", text)


def _secret_forms(secret: str) -> set[str]:
    raw = secret.encode("utf-8")
    forms = {
        secret,
        quote(secret, safe=""),
        quote_plus(secret),
        json.dumps(secret)[1:-1],
        raw.hex(),
    }
    for shift in range(3):
        # The characters of base64 that depend on the key's bytes alone, however many bytes
        # come before it (an offset of 0, 1 or 2 modulo 3) and whatever follows.
        padded = bytes(shift) + raw
        first, end = -(-8 * shift // 6), 8 * len(padded) // 6
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            forms.add(encode(padded).decode("ascii")[first:end])
    return {form.translate(_ASCII_LOWER) for form in forms if len(form) >= 4}


def _masked(text: str, covered: bytearray) -> str:
    out: list[str] = []
    index = 0
    while index < len(text):
        if covered[index]:
            while index < len(text) and covered[index]:
                index += 1
            out.append("***")
        else:
            out.append(text[index])
            index += 1
    return "".join(out)


def error_detail(body: object) -> str | None:
    """The provider's own message in an error body: ``{"error": {"message": ...}}`` (both
    OpenAI's and Anthropic's shapes; the SDKs sometimes hand over the inner object)."""
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    if isinstance(body, str):
        return body
    return None


class ClientCache:
    """One SDK client per process and per configuration, built on first use.

    Keyed by what the client was built from (provider, base URL, key), so a changed
    environment (a test's monkeypatch, a rotated key in a long-lived process) gets a new
    client rather than a stale one. Emptied when ``os.getpid()`` changes: a forked child must
    not write into its parent's sockets. Clients dropped that way are not closed: closing
    would only release the child's copies of the descriptors, and a TLS close could corrupt
    the parent's sessions.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._clients: dict[tuple[str | None, ...], Any] = {}

    def get(self, key: tuple[str | None, ...], build: Callable[[], Any]) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._clients = {}
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = build()
            return client

    def __len__(self) -> int:
        return len(self._clients)


# Role markers and message delimiters the chat formats wrap each message in: OpenAI counts
# 3 to 4 tokens per message and 3 to prime the reply; these are generous margins over both.
PER_MESSAGE_TOKENS = 8
PER_REQUEST_TOKENS = 16


def estimate_input_tokens(request: ModelRequest) -> int:
    """An upper bound of the prompt's tokens, computed offline.

    Why it bounds: the tokenizers of these providers are byte-level BPE (tiktoken's
    cl100k/o200k, Claude's): every token stands for at least one byte of UTF-8 text, so a
    text has at most as many tokens as bytes. The formatting around each message (role,
    delimiters) and the reply's priming are added on top with margins. Real counts are far
    lower (about four bytes per token for English), so this over-reserves, never under.
    """
    texts = [request.system or ""] + [message.get("content", "") for message in request.messages]
    size = sum(len(text.encode("utf-8")) for text in texts)
    return size + PER_MESSAGE_TOKENS * (len(request.messages) + 1) + PER_REQUEST_TOKENS


def sdk_request(
    sdk: Any,
    send: Callable[[], T],
    *,
    provider: str,
    secret: str | None,
    timeout_s: float,
    reply_is: str,
) -> T:
    """``send()``, one request through an official SDK, its errors as :class:`ModelError`.

    The ``openai`` and ``anthropic`` SDKs are generated from one template: their exception
    classes have the same names and fields, so one mapping serves both (``sdk`` is the
    module). A time-out is checked before a connection error, of which it is a kind."""
    try:
        return send()
    except sdk.APIStatusError as exc:
        status = exc.status_code
        error_class = class_of_status(status)
        raise ModelError(
            status_message(provider, status, error_detail(exc.body), secret),
            error_class=error_class,
            retry_after_ms=retry_after_ms(exc.response.headers)
            if error_class == "retryable"
            else None,
            status=status,
        ) from None
    except sdk.APITimeoutError:
        raise ModelError(
            f"provider {provider!r} did not answer within {timeout_s:g}s",
            error_class="retryable",
        ) from None
    except sdk.APIConnectionError as exc:
        raise ModelError(
            f"provider {provider!r} could not be reached: {cause_name(exc)}",
            error_class="retryable",
        ) from None
    except (sdk.APIResponseValidationError, ValueError):
        # A body that is not JSON (a proxy's HTML page with a 200): the SDK fails to decode.
        raise unreadable(provider, reply_is) from None


def unreadable(provider: str, reply_is: str) -> ModelError:
    return ModelError(
        f"provider {provider!r} sent a reply that is not {reply_is}", error_class="retryable"
    )


def cause_name(exc: BaseException) -> str:
    """The innermost cause's type (``ConnectError``), not its text: that may hold the URL
    and its credentials."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return type(exc).__name__


# OpenAI's own limit of inputs in one embeddings request (its API reference); one ``embed``
# is one request, so a caller with more texts sends several batches.
MAX_EMBED_BATCH = 2048


def embed_batch_problem(texts: Sequence[str]) -> str | None:
    """Why a batch cannot be embedded, or None. Checked before any request: a provider
    refuses an empty string (OpenAI: 400) and a batch over :data:`MAX_EMBED_BATCH`."""
    if isinstance(texts, str):
        return "texts must be a list of strings, not one string"
    if len(texts) > MAX_EMBED_BATCH:
        return f"{len(texts)} texts in one batch, more than {MAX_EMBED_BATCH}"
    for position, text in enumerate(texts):
        if not isinstance(text, str):
            return f"text {position} is {type(text).__name__}, not a string"
        if not text.strip():
            return f"text {position} is empty: there is nothing to embed"
    return None


def numbers(value: object) -> list[float] | None:
    """``value`` as a list of floats when it is a list of numbers, else None (the SDKs do not
    validate replies: a field may hold anything the server sent)."""
    if not isinstance(value, list) or not all(
        isinstance(item, int | float) and not isinstance(item, bool) for item in value
    ):
        return None
    return [float(item) for item in value]


def checked_vectors(
    vectors: list[list[float]], *, count: int, dimensions: int | None, provider: str, model: str
) -> list[list[float]]:
    """``vectors`` when there is one per text, all of one length (``dimensions`` when asked
    for) and all finite; else a ModelError. A length other than the one asked for is
    ``fatal``: the vector column has that many dimensions, and asking again would not
    change the model's answer."""
    if len(vectors) != count:
        raise ModelError(
            f"provider {provider!r} sent {len(vectors)} embeddings for {count} texts",
            error_class="retryable",
        )
    sizes = {len(vector) for vector in vectors}
    if len(sizes) > 1 or 0 in sizes:
        raise unreadable(provider, "embeddings of one length")
    size = sizes.pop() if sizes else dimensions
    if dimensions is not None and size != dimensions:
        raise ModelError(
            f"model {provider}:{model} answered embeddings of {size} dimensions, not the"
            f" {dimensions} asked for (DJFLOW_EMBEDDINGS_DIMENSIONS)",
            error_class="fatal",
        )
    if not all(math.isfinite(value) for vector in vectors for value in vector):
        raise unreadable(provider, "embeddings of finite numbers")
    return vectors
