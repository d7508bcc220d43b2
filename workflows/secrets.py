"""Secrets: the run-input fields an ``input_schema`` marks ``"writeOnly": true`` (contract
section 8). Handlers get their values; everything people see shows :data:`MASK`.

How a secret travels
--------------------
* When a run starts, every secret scalar of its input is replaced by a *token*
  (``[secret:<20 hex>]``, random per value and run) and the run keeps the map token →
  plaintext encrypted in one place (``runs.vault``, the ``Run.secrets`` column). Everything
  the engine derives from the input (resolved step inputs through templates, approval
  messages, child runs' inputs, the run output) is derived from the tokens, so the database
  holds tokens, never plaintext.
* A worker :func:`reveal`\\ s the tokens of a step's input (and of ``prior``) just before the
  handler runs: a string that is one token becomes the secret with its JSON type, a token
  inside longer text (``"Bearer ${input.api_key}"``) becomes its text (``templates.text_form``).
* What a handler answers is :func:`conceal`\\ ed before it is recorded: any occurrence of a
  secret's text in its output, error or spans is replaced by that secret's token, so a handler
  that echoes the key stores a token and the next handler gets the key back (lossless).
* Whatever is shown to people goes through :func:`shown` (tokens → ``••••``); logs and Sentry
  events also through :func:`scrub`, which masks the plaintexts this context has in hand
  (:func:`exposing`), since an exception or a log line may carry the revealed value.

Tokens are random, never shown (the API and pages show ``••••``), so nobody who can put text
into a run (an event payload, an approval comment) can forge one to make a handler receive a
secret. The engine itself (guards, wait keys, approvers, ``sleep_until``) sees tokens: a guard
comparing a secret with a value is false; branch on a field that is not secret.

In what handlers answer, a string secret is concealed inside longer text when it has at
least :data:`MIN_INSIDE` characters, a shorter one only where a whole string equals it
(masking every ``"ab"`` in every output would mangle what people read, not protect
anything). A number secret of at least :data:`MIN_INSIDE` digits is concealed where a number
equals it and where its text is inside a string (``"pin 123456"``); a shorter number (a count
of 3 must stay a number the guards can compare), booleans and ``null`` are masked only where
the schema puts them.

Pure Python, no Django.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import secrets as _random
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, quote_plus

from .templates import map_json, text_form

__all__ = [
    "MASK",
    "MIN_INSIDE",
    "TOKEN",
    "conceal",
    "exposed",
    "exposing",
    "forget",
    "install_log_scrubber",
    "masker",
    "plaintexts",
    "reveal",
    "scrub",
    "scrub_text",
    "seal",
    "shown",
    "shown_text",
]

MASK: Final[str] = "••••"
TOKEN: Final[re.Pattern[str]] = re.compile(r"\[secret:[0-9a-f]{20}\]")
_TOKEN_START: Final[str] = "[secret:"
MIN_INSIDE: Final[int] = 4

Registry = dict[str, Any]  # token -> plaintext scalar


def _new_token() -> str:
    return f"{_TOKEN_START}{_random.token_hex(10)}]"


def _identity(value: Any) -> tuple[str, Any]:
    # True == 1 in Python; a secret true must not share the token of a secret 1.
    return (type(value).__name__, value)


# --- sealing a run's input --------------------------------------------------------------------


def seal(
    value: Any, found: Iterable[tuple[list[str | int], Any]], known: Mapping[str, Any]
) -> tuple[Any, Registry]:
    """``value`` with every non-null scalar under each found path (``input_schema``'s
    ``write_only_values``) replaced by a token, and the registry: ``known`` plus the new
    tokens. Structure stays (a secret array is an array of tokens, so ``foreach`` still walks
    it); one token per distinct value; tokens already there (a child run's input copied
    from its parent's) are kept. ``value`` is not changed."""
    registry: Registry = dict(known)
    by_value = {_identity(plain): token for token, plain in registry.items()}

    def token_for(plain: Any) -> Any:
        if plain is None or (isinstance(plain, str) and plain in registry):
            return plain
        if isinstance(plain, str) and _TOKEN_START in plain:
            plain = reveal(plain, registry)  # e.g. "Bearer <token>": the secret is the whole
        identity = _identity(plain)
        if identity not in by_value:
            by_value[identity] = _new_token()
            registry[by_value[identity]] = plain
            text = text_form(plain)
            if not isinstance(plain, str | bool) and len(text) >= MIN_INSIDE:
                # A number's text inside a message ("pin 123456") is concealed too.
                by_value.setdefault(_identity(text), _new_token())
                registry.setdefault(by_value[_identity(text)], text)
        return by_value[identity]

    def seal_tree(node: Any) -> Any:
        # Every scalar leaf, strings and numbers alike, becomes a token; the shape stays.
        return map_json(node, token_for, scalars=True)

    sealed = copy.deepcopy(value)
    for path, _ in sorted(found, key=lambda item: len(item[0])):
        if not path:
            sealed = seal_tree(sealed)
            continue
        parent = sealed
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = seal_tree(parent[path[-1]])
    return sealed, registry


# --- the worker's side ------------------------------------------------------------------------


def reveal(value: Any, registry: Mapping[str, Any]) -> Any:
    """``value`` with each token of ``registry`` put back: a string that is one token becomes
    the plaintext with its JSON type; a token inside text becomes the plaintext's text. A
    token this registry does not know is left as it is."""
    if not registry:
        return value

    def inside(text: str) -> str:
        def put(match: re.Match[str]) -> str:
            token = match.group()
            return text_form(registry[token]) if token in registry else token

        return TOKEN.sub(put, text) if _TOKEN_START in text else text

    def whole(text: str) -> Any:
        if text in registry:
            return copy.deepcopy(registry[text])
        return inside(text)

    return map_json(value, whole, keys=inside)


@dataclass(frozen=True)
class _Texts:
    """The texts of a set of secrets, ready to find: whole strings of any length, and a
    pattern for those long enough to find inside text (longest first, so a secret that
    contains another is replaced whole)."""

    whole: Mapping[str, str]
    pattern: re.Pattern[str] | None

    @classmethod
    def of(cls, replacement: Mapping[str, str]) -> _Texts:
        # A secret is also found as it reads inside JSON text (a prompt that rendered an
        # object holding it, a reply echoing it: quotes, backslashes and line breaks
        # escaped) and inside a URL (percent-encoded).
        replacement = {
            **{
                form: token
                for text, token in replacement.items()
                if len(text) >= MIN_INSIDE
                for form in _encoded_forms(text)
            },
            **replacement,
        }
        long = sorted((text for text in replacement if len(text) >= MIN_INSIDE), key=len)
        pattern = re.compile("|".join(re.escape(text) for text in reversed(long))) if long else None
        return cls(replacement, pattern)

    def replace(self, text: str) -> str:
        if text in self.whole:
            return self.whole[text]
        if self.pattern is None:
            return text
        return self.pattern.sub(lambda match: self.whole[match.group()], text)


def _encoded_forms(text: str) -> set[str]:
    """How ``text`` reads inside JSON text and inside a URL, where that differs from it."""
    forms = {
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
        quote(text, safe=""),
        quote_plus(text, safe=""),
    }
    forms.discard(text)
    return {form for form in forms if len(form) >= MIN_INSIDE}


def conceal(value: Any, registry: Mapping[str, Any]) -> Any:
    """``value`` with each secret's text replaced by its token, in string values and keys,
    and each number equal to a number secret of at least ``MIN_INSIDE`` digits replaced by
    its token: what a handler answered (output, error, spans), before it is recorded."""
    texts = _Texts.of(
        {plain: token for token, plain in reversed(registry.items()) if isinstance(plain, str)}
    )
    numbers = {
        _identity(plain): token
        for token, plain in registry.items()
        if isinstance(plain, int | float)
        and not isinstance(plain, bool)
        and len(text_form(plain)) >= MIN_INSIDE
    }
    if not texts.whole and not numbers:
        return value

    def one(item: Any) -> Any:
        if isinstance(item, str):
            return texts.replace(item)
        if isinstance(item, int | float) and not isinstance(item, bool):
            return numbers.get(_identity(item), item)
        return item

    return map_json(value, one, keys=texts.replace, scalars=True)


def plaintexts(registry: Mapping[str, Any]) -> list[str]:
    """The texts of a registry's secrets, for :func:`exposing`."""
    return [text_form(plain) for plain in registry.values() if not isinstance(plain, bool)]


def masker(values: Iterable[Any]) -> Callable[[str], str]:
    """A function masking, in text, the text and the ``repr`` of each scalar in ``values``
    (a secret's, of any length): for messages that quote a value, such as jsonschema's."""
    forms: dict[str, str] = {}
    for value in values:
        for leaf in _leaves(value):
            if leaf is None or isinstance(leaf, bool):
                continue
            quoted = repr(leaf)
            inner = quoted[1:-1] if isinstance(leaf, str) else quoted  # without the quotes
            for form in (text_form(leaf), quoted, inner):
                if form:
                    forms[form] = MASK
    if not forms:
        return lambda text: text
    pattern = re.compile("|".join(re.escape(form) for form in sorted(forms, key=len)[::-1]))
    return lambda text: pattern.sub(MASK, text)


def _leaves(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            yield item


# --- what people see --------------------------------------------------------------------------


def shown_text(text: str) -> str:
    """``text`` with every token shown as the mask."""
    return TOKEN.sub(MASK, text) if _TOKEN_START in text else text


def shown(value: Any) -> Any:
    """The JSON-like ``value`` with every token (in values and keys) shown as the mask: the
    form of a stored input, output or error that people may see. A value without a token
    (every run without secrets) is returned as it is, not copied."""
    if not _mentions_token(value):
        return value
    return map_json(value, shown_text, keys=shown_text)


def _mentions_token(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _TOKEN_START in item:
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.values())
            stack.extend(item.keys())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


# --- plaintexts in hand: logs and error reports -----------------------------------------------


_NOTHING = _Texts({}, None)
_EXPOSED: ContextVar[_Texts] = ContextVar("djflow_exposed_secrets", default=_NOTHING)


def exposed() -> frozenset[str]:
    """The plaintexts this context has in hand."""
    return frozenset(_EXPOSED.get().whole)


# What one context holds at most: a process that starts runs in a loop outside any request
# (a script, a task) must not grow this without end. The newest are kept.
MAX_EXPOSED = 256


def _texts_with(values: Iterable[str]) -> _Texts:
    current = dict(_EXPOSED.get().whole)
    for value in values:
        if value:
            current.pop(value, None)
            current[value] = MASK
    while len(current) > MAX_EXPOSED:
        del current[next(iter(current))]
    return _Texts.of(current)


@contextmanager
def exposing(values: Iterable[str]) -> Iterator[None]:
    """While the block runs, logs and error reports from this context mask ``values`` (the
    worker around a handler, which holds the revealed secrets)."""
    reset = _EXPOSED.set(_texts_with(values))
    try:
        yield
    finally:
        _EXPOSED.reset(reset)


def expose(values: Iterable[str]) -> None:
    """Mask ``values`` in logs and error reports from this context until :func:`forget`: a
    request that received secrets holds them until it ends (an error report of it carries
    the request body). Each request (``config.middleware``) and each Celery task
    (``runs.apps``) starts with nothing held."""
    _EXPOSED.set(_texts_with(values))


def forget() -> None:
    _EXPOSED.set(_NOTHING)


def scrub_text(text: str) -> str:
    """``text`` with the plaintexts in hand and every token shown as the mask."""
    return shown_text(_EXPOSED.get().replace(text))


def scrub(value: Any) -> Any:
    """A copy of a JSON-like value (a Sentry event) with :func:`scrub_text` applied to every
    string and key."""
    return map_json(value, scrub_text, keys=scrub_text)


def _scrub_record(record: logging.LogRecord) -> None:
    exposure = _EXPOSED.get()
    try:
        message = record.getMessage()
    except Exception:  # a broken format string: logging reports it itself, later
        return
    masked = scrub_text(message)
    if masked != message:
        record.msg, record.args = masked, ()
    if exposure.whole and record.exc_info and record.exc_info[1] is not None:
        # The exception's text and its traceback may carry the value: formatted now, while
        # this context still knows what to mask (handlers format it later, maybe elsewhere).
        record.exc_text = scrub_text(logging.Formatter().formatException(record.exc_info))
    if exposure.whole and record.stack_info:
        record.stack_info = scrub_text(record.stack_info)


def install_log_scrubber() -> None:
    """Mask secrets in every log record of this process where it is made, so every handler
    (the console, Celery's, Sentry's breadcrumbs, pytest's ``caplog``) gets the masked text.
    Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "djflow_scrubs", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _scrub_record(record)
        return record

    factory.djflow_scrubs = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
