"""Sentry, with secrets scrubbed from everything it would send.

An error report carries what was in hand when it happened: the request body (a run's input,
secrets included), the exception's message and the local variables of every frame (a handler's
revealed input). ``before_send`` masks, in every string of the event, the plaintexts this
context holds (``workflows.secrets.exposing``/``expose``) and every secret token; breadcrumbs
(log lines, already masked where they were made) and transactions go through the same scrub.
"""

from __future__ import annotations

from typing import Any

import sentry_sdk
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.integrations.django import DjangoIntegration

from workflows.secrets import scrub


def before_send(event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    scrubbed: dict[str, Any] = scrub(event)
    return scrubbed


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
