"""Prices for model usage, from ``settings.DJFLOW["PRICES"]`` (USD per million tokens)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.conf import settings

MILLION = Decimal(1_000_000)


def price(model: str | None, usage: dict[str, Any]) -> Decimal | None:
    """The cost of ``usage`` on ``model``, or None when the model has no price."""
    if not model:
        return None
    table = settings.DJFLOW["PRICES"].get(model)
    if table is None:
        return None
    cost = Decimal(0)
    for kind in ("input", "output"):
        tokens = usage.get(f"{kind}_tokens") or 0
        cost += Decimal(str(table.get(kind, 0))) * Decimal(int(tokens)) / MILLION
    return cost.quantize(Decimal("0.000001"))
