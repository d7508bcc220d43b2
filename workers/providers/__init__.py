"""Model providers: one call to a model, or one batch of embeddings, through its provider's
own SDK.

A model is named ``"<provider>:<model>"`` (``openai:gpt-4o-mini``,
``anthropic:claude-sonnet-4-0``, ``standin:echo``, or a provider added by
``DJFLOW_PROVIDERS``). :func:`call` makes exactly one request and either returns a
:class:`ModelReply` with its usage or raises :class:`ModelError` classed ``retryable`` or
``fatal``; the caller's retry policy decides what happens next. :func:`unconfigured` says,
before any call, why a model cannot be used.

:func:`embed` sends one batch of texts to an embeddings model in one request and returns an
:class:`EmbedReply` with a vector per text, in the order of the texts; its failures are
classed the same way. :func:`embeddings_unconfigured` says why a model cannot embed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, cast

from .base import (
    MAX_EMBED_BATCH,
    EmbedReply,
    ModelError,
    ModelReply,
    ModelRequest,
    embed_batch_problem,
    estimate_input_tokens,
)
from .registry import (
    EmbeddingsModel,
    Provider,
    default_model,
    embeddings_model,
    embeddings_unconfigured,
    find,
    split_model,
    unconfigured,
)

__all__ = [
    "MAX_EMBED_BATCH",
    "EmbedReply",
    "EmbeddingsModel",
    "ModelError",
    "ModelReply",
    "ModelRequest",
    "call",
    "default_model",
    "embed",
    "embeddings_model",
    "embeddings_unconfigured",
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


class Embedder(Protocol):
    def __call__(
        self,
        provider: Provider,
        model: str,
        texts: list[str],
        *,
        dimensions: int | None,
        timeout_s: float,
    ) -> EmbedReply: ...


def _adapter(name: str) -> Callable[[Provider, ModelRequest], ModelReply]:
    module = importlib.import_module(f"{__name__}.{_ADAPTER_MODULES[name]}")
    return cast(Callable[[Provider, ModelRequest], ModelReply], module.call)


def _embedder(name: str) -> Embedder:
    module = importlib.import_module(f"{__name__}.{_ADAPTER_MODULES[name]}")
    return cast(Embedder, module.embed)


def _usable(name: str) -> tuple[Provider, str]:
    """The provider and model of ``name``; a ``fatal`` ModelError naming why it is not
    usable."""
    try:
        provider_name, model = split_model(name)
    except ValueError as exc:
        raise ModelError(str(exc), error_class="fatal") from None
    why = unconfigured(name)
    provider = find(provider_name)
    if why is not None or isinstance(provider, str):
        raise ModelError(why or str(provider), error_class="fatal")
    return provider, model


def call(name: str, request: ModelRequest) -> ModelReply:
    """Call the model ``name`` (``"<provider>:<model>"``). The model part of ``name`` is the
    one sent: it replaces ``request.model`` should the two differ. An unusable name or
    provider is a ``fatal`` ModelError naming why."""
    provider, model = _usable(name)
    if request.model != model:
        request = replace(request, model=model)
    return _adapter(provider.adapter)(provider, request)


def embed(
    name: str,
    texts: Sequence[str],
    *,
    dimensions: int | None = None,
    timeout_s: float = 60.0,
) -> EmbedReply:
    """Embed ``texts`` with the model ``name`` (``"<provider>:<model>"``) in one request:
    ``reply.vectors[i]`` belongs to ``texts[i]``. ``dimensions`` asks for vectors of that
    length (sent to the provider; a reply of another length is a ``fatal`` error). An
    unusable model, an empty text or more than :data:`MAX_EMBED_BATCH` texts is a ``fatal``
    ModelError before any request; no texts is an empty reply without one."""
    provider, model = _usable(name)
    if provider.adapter == "anthropic":
        # Refused before the SDK is imported; the adapter refuses too.
        raise ModelError(embeddings_unconfigured(name) or name, error_class="fatal")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise ModelError(
            f"dimensions must be a positive integer, not {dimensions!r}", error_class="fatal"
        )
    problem = embed_batch_problem(texts)
    if problem is not None:
        raise ModelError(problem, error_class="fatal")
    if not texts:
        return EmbedReply(vectors=[], model=model, input_tokens=0)
    return _embedder(provider.adapter)(
        provider, model, list(texts), dimensions=dimensions, timeout_s=timeout_s
    )
