"""Which providers exist and whether each is usable.

Built in: ``openai`` and ``anthropic`` (configured by their SDKs' own variables, a key
required) and ``standin`` (offline, always usable). ``DJFLOW_PROVIDERS`` adds more without an
engine change, each speaking one of the two wire formats:
``{"ollama": {"adapter": "openai", "base_url": "http://127.0.0.1:11434/v1"}}``, with
``"api_key_env": "NAME"`` when the endpoint wants a key (then the variable must be set).
Read at each call, so settings and environment changes apply without a restart.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from django.conf import settings

Adapter = Literal["openai", "anthropic", "standin"]

ADAPTERS: tuple[Adapter, ...] = ("openai", "anthropic")
_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Provider:
    name: str
    adapter: Adapter
    # The variable that must hold a key; None when the endpoint needs none.
    key_env: str | None
    # None: the SDK's own variable (OPENAI_BASE_URL, ANTHROPIC_BASE_URL) or its default.
    base_url: str | None = None
    builtin: bool = True

    def api_key(self) -> str | None:
        return (os.environ.get(self.key_env) or None) if self.key_env else None


BUILTIN = {
    "openai": Provider("openai", "openai", "OPENAI_API_KEY"),
    "anthropic": Provider("anthropic", "anthropic", "ANTHROPIC_API_KEY"),
    "standin": Provider("standin", "standin", None),
}


def split_model(name: str) -> tuple[str, str]:
    """``"openai:gpt-4o-mini"`` -> ``("openai", "gpt-4o-mini")``. Split at the first colon:
    model names may hold colons of their own (``ollama:llama3.1:8b``)."""
    if not isinstance(name, str):
        kind = type(name).__name__
        raise ValueError(f"a model must be a string '<provider>:<model>', got {kind}")
    provider, colon, model = name.partition(":")
    if not colon or not provider.strip() or not model.strip() or name != name.strip():
        raise ValueError(f"model {name!r} must be '<provider>:<model>', e.g. 'openai:gpt-4o-mini'")
    return provider, model


def find(provider: str) -> Provider | str:
    """The provider named, or one sentence why there is none usable by that name."""
    if provider in BUILTIN:
        return BUILTIN[provider]
    extra: Any = settings.DJFLOW.get("PROVIDERS") or {}
    if not isinstance(extra, dict):
        return "DJFLOW_PROVIDERS must be a JSON object of providers"
    if provider not in extra:
        return f"no provider {provider!r}"
    return _configured(provider, extra[provider])


def _configured(name: str, entry: Any) -> Provider | str:
    where = f"provider {name!r} in DJFLOW_PROVIDERS"
    if not _NAME.fullmatch(name):
        return f"{where}: a name is lower-case letters, digits and . _ - (starting with a letter)"
    if not isinstance(entry, dict):
        return f"{where} must be an object with adapter and base_url"
    adapter = entry.get("adapter")
    if adapter not in ADAPTERS:
        return f"{where}: adapter must be 'openai' or 'anthropic', got {adapter!r}"
    base_url = entry.get("base_url")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        return f"{where}: base_url must be an http(s) URL"
    key_env = entry.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not key_env):
        return f"{where}: api_key_env must name an environment variable"
    unknown = sorted(set(entry) - {"adapter", "base_url", "api_key_env"})
    if unknown:
        return f"{where}: unknown field {unknown[0]!r}"
    return Provider(name, adapter, key_env, base_url, builtin=False)


def unconfigured(name: str) -> str | None:
    """None when the provider of ``"<provider>:<model>"`` is usable, else one sentence why
    not (naming the missing variable)."""
    try:
        provider_name, _model = split_model(name)
    except ValueError as exc:
        return str(exc)
    provider = find(provider_name)
    if isinstance(provider, str):
        return provider
    if provider.key_env and not provider.api_key():
        return f"provider {provider.name!r} is not configured: {provider.key_env} is not set"
    return None


def default_model() -> str | None:
    """``DJFLOW_DEFAULT_MODEL`` (for steps that name no model), None when unset."""
    return str(settings.DJFLOW.get("DEFAULT_MODEL") or "").strip() or None


@dataclass(frozen=True)
class EmbeddingsModel:
    """``DJFLOW_EMBEDDINGS_MODEL`` and ``DJFLOW_EMBEDDINGS_DIMENSIONS``: the model that
    embeds knowledge-base documents and queries, and the length of its vectors (None: the
    model's own, not sent)."""

    name: str
    dimensions: int | None


def embeddings_model() -> EmbeddingsModel | None:
    """The configured embeddings model, None when unset (retrieval is full-text only)."""
    name = str(settings.DJFLOW.get("EMBEDDINGS_MODEL") or "").strip()
    if not name:
        return None
    dimensions = settings.DJFLOW.get("EMBEDDINGS_DIMENSIONS")
    return EmbeddingsModel(name, int(dimensions) if dimensions else None)


def no_embeddings_api(provider: str, model: str) -> str:
    return (
        f"model '{provider}:{model}' cannot embed: provider {provider!r} speaks Anthropic's"
        " messages API, which has no embeddings endpoint; name an OpenAI-compatible or"
        " standin model"
    )


def embeddings_unconfigured(name: str) -> str | None:
    """None when ``name`` can embed, else one sentence why not: :func:`unconfigured`'s
    reasons, and a provider of the Anthropic format (it has no embeddings API)."""
    why = unconfigured(name)
    if why is not None:
        return why
    provider_name, model = split_model(name)
    provider = find(provider_name)
    if isinstance(provider, Provider) and provider.adapter == "anthropic":
        return no_embeddings_api(provider_name, model)
    return None
