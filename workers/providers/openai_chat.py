"""The OpenAI chat completions and embeddings wire formats, through the official ``openai``
SDK: OpenAI itself and every OpenAI-compatible endpoint (Azure, vLLM, Ollama; DJFLOW_PROVIDERS
entries with ``"adapter": "openai"``).

The built-in provider is configured only by the SDK's own variables (``OPENAI_API_KEY``,
``OPENAI_BASE_URL``): the SDK reads them. One call is one HTTP request (``max_retries=0``).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import openai

from .base import (
    ClientCache,
    EmbedReply,
    ModelReply,
    ModelRequest,
    checked_vectors,
    estimate_input_tokens,
    numbers,
    sdk_request,
    unreadable,
)
from .registry import Provider

# An OpenAI-compatible endpoint that needs no key still gets one: the SDK refuses to build a
# client without, and such servers ignore it.
NO_KEY = "no-key"

_clients = ClientCache()
# What a reply of this format is, in the message of one that is not.
REPLY_IS = "a chat completion"
EMBEDDINGS_ARE = "a list of embeddings"


def call(provider: Provider, request: ModelRequest) -> ModelReply:
    client = _client(provider)
    completion = sdk_request(
        openai,
        lambda: client.chat.completions.create(**_params(provider, client, request)),
        provider=provider.name,
        secret=provider.api_key(),
        timeout_s=request.timeout_s,
        reply_is=REPLY_IS,
    )
    if not completion.choices or completion.choices[0].message is None:
        raise unreadable(provider.name, REPLY_IS)
    return _reply(completion, request)


def _client(provider: Provider) -> openai.OpenAI:
    if provider.builtin:
        # The SDK reads OPENAI_API_KEY and OPENAI_BASE_URL itself; they key the cache so a
        # changed environment builds a new client.
        key: tuple[str | None, ...] = (provider.name, provider.api_key(), _env_base_url())
        client: openai.OpenAI = _clients.get(key, lambda: openai.OpenAI(max_retries=0))
        return client
    api_key = provider.api_key() or NO_KEY
    key = (provider.name, api_key, provider.base_url)
    client = _clients.get(
        key, lambda: openai.OpenAI(api_key=api_key, base_url=provider.base_url, max_retries=0)
    )
    return client


def _env_base_url() -> str | None:
    return os.environ.get("OPENAI_BASE_URL")


def _params(provider: Provider, client: openai.OpenAI, request: ModelRequest) -> dict[str, Any]:
    messages: list[dict[str, str]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    messages.extend({"role": m["role"], "content": m["content"]} for m in request.messages)
    params: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        _max_tokens_field(client): request.max_tokens,
        "timeout": request.timeout_s,
    }
    if request.temperature is not None:
        params["temperature"] = request.temperature
    if request.json:
        params["response_format"] = {"type": "json_object"}
    return params


def _max_tokens_field(client: openai.OpenAI) -> str:
    """OpenAI's own API wants ``max_completion_tokens`` (its reasoning models refuse
    ``max_tokens``); OpenAI-compatible servers (Ollama, older vLLM) know only ``max_tokens``."""
    host = urlsplit(str(client.base_url)).hostname or ""
    return "max_completion_tokens" if host == "api.openai.com" else "max_tokens"


def _reply(completion: Any, request: ModelRequest) -> ModelReply:
    choice = completion.choices[0]
    message = choice.message
    text = message.content or ""
    stop_reason = choice.finish_reason
    if message.content is None and getattr(message, "refusal", None):
        text, stop_reason = str(message.refusal), "refusal"
    usage = completion.usage
    if usage is None:
        # A compatible server that reports no usage: count the bounds, so cost limits still
        # hold (over, never under).
        return ModelReply(
            text=text,
            model=completion.model or request.model,
            input_tokens=estimate_input_tokens(request),
            output_tokens=len(text.encode("utf-8")),
            stop_reason=stop_reason,
            request_id=getattr(completion, "_request_id", None) or completion.id,
        )
    prompt_details = usage.prompt_tokens_details
    completion_details = usage.completion_tokens_details
    return ModelReply(
        text=text,
        model=completion.model or request.model,
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cached_tokens=prompt_details.cached_tokens if prompt_details is not None else None,
        reasoning_tokens=(
            completion_details.reasoning_tokens if completion_details is not None else None
        ),
        stop_reason=stop_reason,
        request_id=getattr(completion, "_request_id", None) or completion.id,
    )


def embed(
    provider: Provider,
    model: str,
    texts: list[str],
    *,
    dimensions: int | None,
    timeout_s: float,
) -> EmbedReply:
    """``POST /embeddings`` with every text in one request. The SDK asks for base64 (a
    quarter of the bytes of JSON floats) and decodes it; a server that answers floats
    anyway is read as well. Vectors are put in the order of ``index``: the API does not
    promise the order of ``data``."""
    client = _client(provider)
    params: dict[str, Any] = {"model": model, "input": texts, "timeout": timeout_s}
    if dimensions is not None:
        params["dimensions"] = dimensions
    response = sdk_request(
        openai,
        lambda: client.embeddings.create(**params),
        provider=provider.name,
        secret=provider.api_key(),
        timeout_s=timeout_s,
        reply_is=EMBEDDINGS_ARE,
    )
    vectors = checked_vectors(
        _in_order(list(response.data or []), provider.name),
        count=len(texts),
        dimensions=dimensions,
        provider=provider.name,
        model=model,
    )
    usage = response.usage
    return EmbedReply(
        vectors=vectors,
        model=response.model or model,
        # A compatible server that reports no usage: the bound (a token is at least a byte).
        input_tokens=usage.prompt_tokens
        if usage is not None
        else sum(len(text.encode("utf-8")) for text in texts),
        request_id=getattr(response, "_request_id", None),
    )


def _in_order(data: list[Any], provider: str) -> list[list[float]]:
    """The vectors of ``data`` sorted by their ``index``, which must number them 0..n-1."""
    positions = [item.index for item in data]
    if not all(type(position) is int for position in positions) or sorted(positions) != list(
        range(len(data))
    ):
        raise unreadable(provider, EMBEDDINGS_ARE)
    vectors = []
    for item in sorted(data, key=lambda item: int(item.index)):
        vector = numbers(item.embedding)
        if vector is None:
            raise unreadable(provider, EMBEDDINGS_ARE)
        vectors.append(vector)
    return vectors
