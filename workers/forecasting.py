"""What ``runs.forecasts`` prices a forecast with: the engine's own prices and prompt estimate,
so a forecast's worst case is what a run reserves before each call (``workers.kinds.recipe``).
Plugged in from ``WorkersConfig.ready()``."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from runs import forecasts

from . import pricing, providers


def price(model_name: str, input_tokens: int, output_tokens: int) -> Decimal | None:
    """A call's cost on ``"<provider>:<model>"``; None when no price source knows it (or the
    name is not one)."""
    try:
        provider, model = providers.split_model(model_name)
    except ValueError:
        return None
    return pricing.worst_case_cost(
        provider, model, input_tokens=input_tokens, max_tokens=output_tokens
    )


def tokens(system: str, messages: Sequence[str]) -> int:
    """``estimate_input_tokens`` of a request of these texts, user and assistant in turn."""
    roles = ("user", "assistant")
    request = providers.ModelRequest(
        model="",
        messages=[{"role": roles[i % 2], "content": text} for i, text in enumerate(messages)],
        system=system or None,
    )
    return providers.estimate_input_tokens(request)


def plug_in() -> None:
    forecasts.use_pricing(
        forecasts.Pricing(price=price, tokens=tokens, default_model=providers.default_model)
    )
