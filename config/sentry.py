"""Sentry, with secrets scrubbed from everything it would send.

An error report carries what was in hand when it happened: the request body (a run's input,
secrets included), the exception's message and the local variables of every frame (a handler's
revealed input). ``before_send`` masks, in every string of the event, the plaintexts this
context holds (``workflows.secrets.exposing``/``expose``), every secret token and the header
and env values of ``DJFLOW_MCP_SERVERS``; breadcrumbs
(log lines, already masked where they were made) and transactions go through the same scrub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import sentry_sdk
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.integrations.django import DjangoIntegration

from workflows.secrets import masker, scrub
from workflows.templates import map_json


def before_send(event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    scrubbed: dict[str, Any] = scrub(event)
    configured = _configured_secrets()
    if configured is not None:
        scrubbed = map_json(scrubbed, configured, keys=configured)
    return scrubbed


# The shortest stdio env value (or URL query value) masked as a credential.
_MIN_ENV_SECRET = 8


def _configured_secrets() -> Callable[[str], str] | None:
    """A masker of the values the settings hold as secrets: the header and env values of
    DJFLOW_MCP_SERVERS (credentials; a frame of the MCP pool may hold them as locals)."""
    from django.conf import settings

    servers = getattr(settings, "DJFLOW", {}).get("MCP_SERVERS") or {}
    values = [
        value for server in servers.values() for value in (server.get("headers") or {}).values()
    ]
    # A stdio server's env holds credentials and ordinary values alike ("1", a path): the
    # short ones are left, or every "1" of an event would be masked.
    values += [
        value
        for server in servers.values()
        for value in (server.get("env") or {}).values()
        if len(str(value)) >= _MIN_ENV_SECRET
    ]
    # A URL may carry a credential (user:password@, ?token=): the URL whole is masked.
    for server in servers.values():
        url = urlsplit(str(server.get("url") or ""))
        if url.username or url.password or url.query:
            values.append(server["url"])
            values += [url.password or "", url.query]
            values += [value for _, value in parse_qsl(url.query) if len(value) >= _MIN_ENV_SECRET]
    values = [value for value in values if value]
    return masker(values) if values else None


def init_sentry(*, dsn: str, environment: str, traces_sample_rate: float, **options: Any) -> None:
    """``sentry_sdk.init`` as the settings call it (``options`` for tests: a transport)."""
    sentry_sdk.init(
        dsn=dsn,
        integrations=[DjangoIntegration(), CeleryIntegration(monitor_beat_tasks=True)],
        environment=environment,
        traces_sample_rate=traces_sample_rate,
        send_default_pii=False,
        # No sentry-trace or baggage headers on outgoing requests (Sentry's default sends
        # them to every host): an http step or a model call must not tell a third party
        # our trace ids, and the http step sends a redirect's other origin none of ours.
        trace_propagation_targets=[],
        before_send=before_send,
        before_send_transaction=before_send,
        before_breadcrumb=before_send,
        **options,
    )
