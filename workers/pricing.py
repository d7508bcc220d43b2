"""Prices for model usage, in USD.

Two sources, the first that knows the model wins:

1. ``settings.DJFLOW["PRICES"]`` (``DJFLOW_PRICES``): USD per million tokens, keyed
   ``"provider:model"`` or ``"model"``: ``{"input": x, "output": y, "cached_input": z}``
   (``cached_input`` defaults to ``input``).
2. genai-prices' bundled table, offline: it is never updated at run time (an update would
   fetch over the network from inside a worker), so prices move with the pinned version.

A model neither knows has no price (None): its usage is recorded but not priced. The offline
stand-in (provider ``standin``) costs nothing unless DJFLOW_PRICES prices it. Input token
counts include cached tokens; ``cached_tokens`` says how many of them were cache reads.
Embeddings are priced by the same sources, input tokens only (genai-prices knows OpenAI's
``text-embedding-3-small``, ``-3-large`` and ``ada-002``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.conf import settings
from genai_prices import Usage, calc_price

MILLION = Decimal(1_000_000)
STANDIN = "standin"


def price(model: str | None, usage: dict[str, Any], provider: str | None = None) -> Decimal | None:
    """The cost of a span's ``usage`` on ``model`` (to the micro-dollar), or None when the
    model has no price."""
    if not model:
        return None
    cost = call_cost(
        provider,
        model,
        input_tokens=int(usage.get("input_tokens") or 0),
        output_tokens=int(usage.get("output_tokens") or 0),
        cached_tokens=int(usage["cached_tokens"]) if usage.get("cached_tokens") else None,
    )
    return None if cost is None else cost.quantize(Decimal("0.000001"))


def call_cost(
    provider: str | None,
    model: str,
    *,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int | None = None,
) -> Decimal | None:
    """The cost of one call, unrounded; None when no source knows the model."""
    cached = min(cached_tokens or 0, input_tokens)
    table = _override(provider, model)
    if table is not None:
        return _from_table(table, input_tokens, output_tokens, cached)
    if provider == STANDIN:
        return Decimal(0)
    return _bundled(provider, model, input_tokens, output_tokens, cached)


def embedding_cost(provider: str | None, model: str, *, input_tokens: int) -> Decimal | None:
    """The cost of one embeddings request: its input tokens at the model's input price
    (embeddings have no output). None when no source knows the model; the stand-in is free
    unless DJFLOW_PRICES prices it."""
    return call_cost(provider, model, input_tokens=input_tokens, output_tokens=0)


def worst_case_cost(
    provider: str | None, model: str, *, input_tokens: int, max_tokens: int
) -> Decimal | None:
    """The most a call can cost: every prompt token at the full input price (no cache
    discount) and ``max_tokens`` of output. What a run reserves against its budget."""
    return call_cost(provider, model, input_tokens=input_tokens, output_tokens=max_tokens)


def _override(provider: str | None, model: str) -> dict[str, Any] | None:
    prices: dict[str, Any] = settings.DJFLOW.get("PRICES") or {}
    table = prices.get(f"{provider}:{model}") if provider else None
    if table is None:
        table = prices.get(model)
    return table if isinstance(table, dict) else None


def _from_table(
    table: dict[str, Any], input_tokens: int, output_tokens: int, cached: int
) -> Decimal:
    input_price = _per_token(table, "input")
    cached_price = _per_token(table, "cached_input") if "cached_input" in table else input_price
    return (
        input_price * (input_tokens - cached)
        + cached_price * cached
        + _per_token(table, "output") * output_tokens
    )


def _per_token(table: dict[str, Any], kind: str) -> Decimal:
    return Decimal(str(table.get(kind, 0))) / MILLION


def _bundled(
    provider: str | None, model: str, input_tokens: int, output_tokens: int, cached: int
) -> Decimal | None:
    usage = Usage(input_tokens=input_tokens, output_tokens=output_tokens)
    if cached:
        usage.cache_read_tokens = cached
    try:
        # A provider genai-prices does not know (a local Ollama) raises like an unknown model.
        calculation = calc_price(usage, model_ref=model, provider_id=provider)
    except LookupError:
        return None
    return Decimal(calculation.total_price)
