"""The Anthropic messages wire format, through the official ``anthropic`` SDK.

The built-in provider is configured only by the SDK's own variables (``ANTHROPIC_API_KEY``,
``ANTHROPIC_BASE_URL``): the SDK reads them. One call is one HTTP request (``max_retries=0``).
A JSON reply is asked for by the prompt: the messages API has no switch for it.

``input_tokens`` of the reply counts the whole prompt: Anthropic reports cache reads and
cache writes apart from its ``input_tokens``, so they are added back (as OpenAI counts).
"""

from __future__ import annotations

import os
from typing import Any

import anthropic

from .base import (
    ClientCache,
    EmbedReply,
    ModelError,
    ModelReply,
    ModelRequest,
    sdk_request,
    unreadable,
)
from .registry import Provider, no_embeddings_api

# An endpoint of this format that needs no key still gets one: the SDK would otherwise look
# for credentials in profiles on disk.
NO_KEY = "no-key"

_clients = ClientCache()
# What a reply of this format is, in the message of one that is not.
REPLY_IS = "a message"


def call(provider: Provider, request: ModelRequest) -> ModelReply:
    client = _client(provider)
    message = sdk_request(
        anthropic,
        lambda: client.messages.create(**_params(request)),
        provider=provider.name,
        secret=provider.api_key(),
        timeout_s=request.timeout_s,
        reply_is=REPLY_IS,
    )
    if not isinstance(message.content, list) or message.usage is None:
        raise unreadable(provider.name, REPLY_IS)
    return _reply(message, request)


def _client(provider: Provider) -> anthropic.Anthropic:
    if provider.builtin:
        # The SDK reads ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL itself; they key the cache so
        # a changed environment builds a new client.
        key: tuple[str | None, ...] = (
            provider.name,
            provider.api_key(),
            os.environ.get("ANTHROPIC_BASE_URL"),
        )
        client: anthropic.Anthropic = _clients.get(key, lambda: anthropic.Anthropic(max_retries=0))
        return client
    api_key = provider.api_key() or NO_KEY
    key = (provider.name, api_key, provider.base_url)
    client = _clients.get(
        key,
        lambda: anthropic.Anthropic(api_key=api_key, base_url=provider.base_url, max_retries=0),
    )
    return client


def _params(request: ModelRequest) -> dict[str, Any]:
    params: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "messages": [{"role": m["role"], "content": m["content"]} for m in request.messages],
        "timeout": request.timeout_s,
    }
    if request.system:
        params["system"] = request.system
    if request.temperature is not None:
        params["temperature"] = request.temperature
    return params


def _reply(message: Any, request: ModelRequest) -> ModelReply:
    text = "".join(
        block.text for block in message.content if getattr(block, "type", None) == "text"
    )
    usage = message.usage
    cache_read = usage.cache_read_input_tokens
    cache_write = usage.cache_creation_input_tokens or 0
    details = getattr(usage, "output_tokens_details", None)
    return ModelReply(
        text=text,
        model=message.model or request.model,
        input_tokens=usage.input_tokens + (cache_read or 0) + cache_write,
        output_tokens=usage.output_tokens,
        cached_tokens=cache_read,
        reasoning_tokens=details.thinking_tokens if details is not None else None,
        stop_reason=message.stop_reason,
        request_id=getattr(message, "_request_id", None) or message.id,
    )


def embed(
    provider: Provider,
    model: str,
    texts: list[str],
    *,
    dimensions: int | None,
    timeout_s: float,
) -> EmbedReply:
    """Anthropic has no embeddings API (it points to Voyage AI's): never a request."""
    raise ModelError(no_embeddings_api(provider.name, model), error_class="fatal")
