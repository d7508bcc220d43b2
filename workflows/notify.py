"""A document's ``notify`` entries (contract section 13): webhooks told when a run ends.

The secrets of the entries are never stored in the document, nor shown:

- At save, each entry's ``secret`` is taken out of the document (:func:`seal`): the stored
  document shows :data:`MASK` where it was, and the secrets, by entry index, are kept
  encrypted in ``WorkflowVersion.secrets`` (Fernet, a key derived from ``DJFLOW_FIELD_KEY``
  or ``SECRET_KEY``, as a run's secrets are: ``runs.vault``). So the API, the admin and the
  pages, which show the stored document, show ``••••``.
- The same body saved again must find its version: the content hash is taken over the
  document with each secret replaced by a keyed fingerprint (HMAC-SHA256 under the same key
  material), never the secret itself. :func:`hashes` gives one hash per configured key, the
  current key's first, so a save after a key rotation still finds the version saved before.
- A secret given as ``••••`` (a document copied from the admin or the API and edited) stands
  for the secret of the entry with the same URL in the workflow's latest version.

Pure of the database: the caller gives the previous version's secrets.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes as crypto_hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from .errors import FieldError, InvalidDocument
from .secrets import MASK

EVENTS = ("completed", "failed", "cancelled", "timed_out")
# Entries a document may hold (the schema's maxItems): each run end sends at most this many.
MAX_ENTRIES = 10

_SALT = b"djflow"
_INFO = b"djflow workflow notify secrets v1"
_FINGERPRINT_INFO = b"djflow workflow notify fingerprint v1"


class SecretsUnreadable(Exception):
    """A version's notify secrets were encrypted with a key this process does not have."""


def entries(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(entry) for entry in document.get("notify") or []]


def _key_material() -> tuple[str, ...]:
    field_keys = tuple(key for key in settings.DJFLOW_FIELD_KEY if key)
    if field_keys:
        return field_keys
    return (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", []))


def _derive(key: str, info: bytes) -> bytes:
    return HKDF(algorithm=crypto_hashes.SHA256(), length=32, salt=_SALT, info=info).derive(
        key.encode()
    )


@lru_cache(maxsize=8)
def _cipher(material: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(base64.urlsafe_b64encode(_derive(key, _INFO))) for key in material])


@lru_cache(maxsize=8)
def _fingerprint_keys(material: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(_derive(key, _FINGERPRINT_INFO) for key in material)


def encrypt(secrets: Mapping[int, str]) -> str:
    """The stored form of a version's notify secrets (entry index → secret); "" if none."""
    if not secrets:
        return ""
    plain = json.dumps({str(k): v for k, v in secrets.items()}, ensure_ascii=False)
    return _cipher(_key_material()).encrypt(plain.encode()).decode("ascii")


def decrypt(blob: str) -> dict[int, str]:
    """A version's notify secrets from their stored form."""
    if not blob:
        return {}
    try:
        plain = _cipher(_key_material()).decrypt(blob.encode("ascii"))
    except InvalidToken:
        raise SecretsUnreadable(
            "the notify secrets of this workflow version were encrypted with a key this "
            "process does not have (DJFLOW_FIELD_KEY or SECRET_KEY was changed?): put the "
            "old key in DJFLOW_FIELD_KEY after the current one"
        ) from None
    return {int(k): v for k, v in json.loads(plain).items()}


def seal(
    document: dict[str, Any], previous: Callable[[], tuple[Mapping[str, Any], str] | None]
) -> tuple[dict[str, Any], dict[int, str]]:
    """The document to store (each secret shown as ``••••``) and its secrets by entry
    index. ``previous`` gives the workflow's latest version (document, secrets blob), asked
    only when an entry's secret is ``••••``; an entry that cannot take one is a 400."""
    found = entries(document)
    if not any("secret" in entry for entry in found):
        return document, {}
    secrets: dict[int, str] = {}
    errors: list[FieldError] = []
    kept: dict[str, str] | None = None
    for index, entry in enumerate(found):
        if "secret" not in entry:
            continue
        secret = entry["secret"]
        if secret == MASK:
            if kept is None:
                kept = _previous_by_url(previous())
            if entry["url"] not in kept:
                errors.append(
                    FieldError(
                        f"notify[{index}].secret",
                        "•••• keeps the secret of the latest version's notify entry with "
                        "the same url, and it has none: give the secret",
                    )
                )
                continue
            secret = kept[entry["url"]]
        secrets[index] = secret
    if errors:
        raise InvalidDocument(errors=errors)
    stored = copy.deepcopy(document)
    for index in secrets:
        stored["notify"][index]["secret"] = MASK
    return stored, secrets


def _previous_by_url(found: tuple[Mapping[str, Any], str] | None) -> dict[str, str]:
    if found is None:
        return {}
    document, blob = found
    secrets = decrypt(blob)
    return {
        entry["url"]: secrets[index]
        for index, entry in enumerate(entries(document))
        if index in secrets
    }


def hashes(
    stored: Mapping[str, Any], secrets: Mapping[int, str], digest: Callable[[Any], str]
) -> list[str]:
    """The content hashes of a document whose secrets were sealed: ``digest`` of it with
    each secret's fingerprint in its place, one per configured key (the current key's
    first). Without secrets, just ``digest(stored)``."""
    if not secrets:
        return [digest(stored)]
    found: list[str] = []
    for key in _fingerprint_keys(_key_material()):
        marked = copy.deepcopy(dict(stored))
        for index, secret in secrets.items():
            mark = hmac.new(key, secret.encode(), hashlib.sha256).hexdigest()
            marked["notify"][index]["secret"] = f"hmac-sha256:{mark}"
        value = digest(marked)
        if value not in found:
            found.append(value)
    return found


def signature(secret: str, body: bytes) -> str:
    """``X-Djflow-Signature``'s value: ``sha256=`` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
