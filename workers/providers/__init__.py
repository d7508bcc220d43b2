"""Model providers: one call to a model through its provider's own SDK.

A model is named ``"<provider>:<model>"`` (``openai:gpt-4o-mini``,
``anthropic:claude-sonnet-4-0``, ``standin:echo``, or a provider added by
``DJFLOW_PROVIDERS``). :func:`call` makes exactly one request and either returns a
:class:`ModelReply` with its usage or raises :class:`ModelError` classed ``retryable`` or
``fatal``; the caller's retry policy decides what happens next. :func:`unconfigured` says,
before any call, why a model cannot be used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from .base import ModelError, ModelReply, ModelRequest, estimate_input_tokens
from .registry import Provider, default_model, find, split_model, unconfigured

__all__ = [
    "ModelError",
    "ModelReply",
    "ModelRequest",
    "call",
    "default_model",
    "estimate_input_tokens",
    "split_model",
    "unconfigured",
]

# Imported on first use: the two SDKs take about a second to import (0.3 s openai, 0.6 s
# anthropic, measured), which a web process that only checks configuration never pays.
_ADAPTER_MODULES = {
    "openai": "openai_chat",
    "anthropic": "anthropic_messages",
    "standin": "standin",
}


def _adapter(name: str) -> Callable[[Provider, ModelRequest], ModelReply]:
    module = importlib.import_module(f"{__name__}.{_ADAPTER_MODULES[name]}")
    return cast(Callable[[Provider, ModelRequest], ModelReply], module.call)


def call(name: str, request: ModelRequest) -> ModelReply:
    """Call the model ``name`` (``"<provider>:<model>"``). The model part of ``name`` is the
    one sent: it replaces ``request.model`` should the two differ. An unusable name or
    provider is a ``fatal`` ModelError naming why."""
    try:
        provider_name, model = split_model(name)
    except ValueError as exc:
        raise ModelError(str(exc), error_class="fatal") from None
    why = unconfigured(name)
    provider = find(provider_name)
    if why is not None or isinstance(provider, str):
        raise ModelError(why or str(provider), error_class="fatal")
    if request.model != model:
        request = replace(request, model=model)
    return _adapter(provider.adapter)(provider, request)
