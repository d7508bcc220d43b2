"""A run's secrets at rest: the one place their plaintext is kept, encrypted.

``workflows.secrets`` replaces each secret of a run's input by a token; the map token →
plaintext is stored here, as one Fernet token (AES-128-CBC with an HMAC-SHA256, from
``cryptography``) in ``Run.secrets``. Everything else about the run is stored with tokens.

The key is derived with HKDF-SHA256 from ``DJFLOW_FIELD_KEY`` when it is set, else from
``SECRET_KEY`` (and ``SECRET_KEY_FALLBACKS``). ``DJFLOW_FIELD_KEY`` takes comma-separated
keys: the first encrypts, each of them decrypts, so a key is rotated by putting the new one
first. A blob no configured key opens raises :class:`SecretsUnreadable`, naming what to do:
Fernet authenticates, so the wrong key is an error, never garbage handed to a handler.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from workflows import secrets
from workflows.input_schema import write_only_values

# Changing either makes every stored blob unreadable: they name what the key is for.
_SALT = b"djflow"
_INFO = b"djflow run secrets v1"


class SecretsUnreadable(Exception):
    """A run's secrets were encrypted with a key this process does not have."""


def _key_material() -> tuple[str, ...]:
    field_keys = tuple(key for key in settings.DJFLOW_FIELD_KEY if key)
    if field_keys:
        return field_keys
    return (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", []))


@lru_cache(maxsize=8)
def _cipher(material: tuple[str, ...]) -> MultiFernet:
    def fernet(key: str) -> Fernet:
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=_INFO).derive(
            key.encode()
        )
        return Fernet(base64.urlsafe_b64encode(derived))

    return MultiFernet([fernet(key) for key in material])


def encrypt(registry: Mapping[str, Any]) -> str:
    """The stored form of a run's secrets; "" when it has none."""
    if not registry:
        return ""
    plain = json.dumps(dict(registry), separators=(",", ":"), ensure_ascii=False)
    return _cipher(_key_material()).encrypt(plain.encode()).decode("ascii")


def decrypt(blob: str, *, run_id: Any) -> dict[str, Any]:
    """A run's secrets (token → plaintext) from their stored form."""
    if not blob:
        return {}
    try:
        plain = _cipher(_key_material()).decrypt(blob.encode("ascii"))
    except InvalidToken:
        source = "DJFLOW_FIELD_KEY" if settings.DJFLOW_FIELD_KEY else "SECRET_KEY"
        raise SecretsUnreadable(
            f"the secrets of run {run_id} were encrypted with a key this process does not "
            f"have (the key comes from {source}; was it changed?). Put the key they were "
            "written with in DJFLOW_FIELD_KEY, after the current one (comma-separated: the "
            "first encrypts, each decrypts), then retry the run."
        ) from None
    registry: dict[str, Any] = json.loads(plain)
    return registry


def seal_input(
    schema: Any, value: Any, inherited: Mapping[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """A run input as it is stored (secrets replaced by tokens) and the run's secrets: those
    its ``schema`` marks, plus ``inherited`` (a child run's parent's, whose tokens its input
    may carry)."""
    found = write_only_values(schema, value) if schema is not None else []
    if not found and not inherited:
        return value, {}
    return secrets.seal(value, found, inherited or {})
