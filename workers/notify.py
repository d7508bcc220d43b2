"""Run-end webhooks: sending a ``runs.models.NotifyDelivery`` (contract section 13).

Invariants:

- At least once: the row is written in the transaction that ends the run, and stays
  ``pending`` until a receiver answers 2xx. A message lost (a broker outage at commit, a
  worker killed holding a retry's countdown) is made up for by :func:`reoffer_lost`, which the
  reconciler runs on every tick: a row pending ``LOST_MESSAGE_SECONDS`` past its ``due_at``
  is offered again. Receivers dedupe by ``X-Djflow-Delivery`` (the row's id).
- One sender at a time: an attempt claims the row by a conditional update of ``attempts``
  and ``due_at`` (from the values it read, and only once ``due_at`` has come), moving
  ``due_at`` past the attempt's time-out; a second message for the row finds it claimed, or
  not due, and sends nothing.
- Bounded: at most ``NOTIFY_MAX_ATTEMPTS`` attempts, ``NOTIFY_BACKOFF_SECONDS`` doubled after
  each failure (at most ``NOTIFY_BACKOFF_MAX_SECONDS``); then the row is ``failed`` with its
  last error, as is a row whose address the guard refuses (never retried: it will not change).
  Each attempt waits at most ``NOTIFY_TIMEOUT_SECONDS`` and reads at most 64 KiB of answer.
- The body is the run as ``GET /api/v1/runs/{id}`` shows it to a reader who is no operator
  (secrets ``••••``, no tracebacks), without the journal when that would be over
  ``NOTIFY_MAX_BODY_BYTES``; rendered at the first attempt and stored, so every retry sends
  the same bytes under the same signature.
- The address rules are the ``http`` step's (``workers.netguard``): public addresses only,
  unless ``DJFLOW_HTTP_ALLOW`` lists the host; redirects are not followed (a 3xx is a failed
  attempt). An error message shows the URL without its query (it may carry a token).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import Any

import httpx2
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs import answers, dispatch
from runs.models import NotifyDelivery
from runs.selectors import run_detail_queryset, with_journal
from runs.serializers import RunListSerializer, RunSerializer
from runs.status import DeliveryStatus
from workflows import notify
from workflows import secrets as field_secrets
from workflows.failures import StepFailure

from . import netguard

logger = logging.getLogger(__name__)

# What of a receiver's answer is read (it is only looked at for its status).
_ANSWER_BYTES = 65_536
USER_AGENT = "djflow-webhooks/1"


def deliver(delivery_id: int) -> str:
    """One attempt at a delivery; what happened (``delivered``, ``retrying``, ``failed``,
    or ``skipped`` when the row is not this message's to send)."""
    tunables = settings.DJFLOW
    now = timezone.now()
    row = NotifyDelivery.objects.select_related("run__version").filter(id=delivery_id).first()
    if row is None or row.status != DeliveryStatus.PENDING or row.due_at > now:
        return "skipped"
    if row.attempts >= tunables["NOTIFY_MAX_ATTEMPTS"]:
        # Its attempts spent without an answer recorded (each ended in an error this module
        # did not expect, or its worker was lost): bounded all the same.
        return _give_up(row, row.last_error or "no answer recorded", row.response_status)
    timeout = float(tunables["NOTIFY_TIMEOUT_SECONDS"])
    # The claim: due_at moves past this attempt's time, so the reconciler leaves it alone.
    claimed = NotifyDelivery.objects.filter(
        id=row.id, status=DeliveryStatus.PENDING, attempts=row.attempts, due_at=row.due_at
    ).update(attempts=row.attempts + 1, due_at=now + timedelta(seconds=timeout + 30))
    if not claimed:
        return "skipped"
    row.attempts += 1
    try:
        body = row.body or _render(row)
        answer = _post(row, body.encode("utf-8"), timeout)
    except netguard.AddressRefused as refused:
        return _give_up(row, refused.message, None)
    except _Failed as failed:
        return _failed_attempt(row, failed.message, failed.status, now)
    except notify.SecretsUnreadable as unreadable:
        return _give_up(row, str(unreadable), None)
    except Exception as error:
        # Recorded on the row and tried again like any failed attempt (the row's own writes
        # failing, the database gone, propagate from there: the reconciler offers it again).
        logger.exception("notify: delivery %s attempt %d raised", row.id, row.attempts)
        return _failed_attempt(row, f"the attempt raised {type(error).__name__}", None, now)
    NotifyDelivery.objects.filter(id=row.id, status=DeliveryStatus.PENDING).update(
        status=DeliveryStatus.DELIVERED,
        response_status=answer,
        last_error="",
        delivered_at=timezone.now(),
    )
    return "delivered"


class _Failed(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _render(row: NotifyDelivery) -> str:
    """The body, stored on the row before it is first sent."""
    body = render_body(row.run_id)
    NotifyDelivery.objects.filter(id=row.id).update(body=body)
    return body


def render_body(run_id: Any) -> str:
    """The run as the API shows it to a reader (compact JSON); without its journal
    (``steps``) when the whole would be over ``NOTIFY_MAX_BODY_BYTES``."""
    # Bounded as GET /runs/{id} is (runs.answers, the newest DJFLOW_ANSWER_STEPS attempts):
    # a run's whole journal, values and all, read into a worker is no body to send.
    run = with_journal(run_detail_queryset(bounded=True).get(id=run_id), bounded=True)
    answers.bound([run], run.steps.all())
    data: dict[str, Any] = dict(RunSerializer(run).data)
    body = _json(data)
    if len(body.encode("utf-8")) > settings.DJFLOW["NOTIFY_MAX_BODY_BYTES"]:
        data = {**RunListSerializer(run).data, "steps": None, "steps_omitted": True}
        body = _json(data)
    return body


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)


def _post(row: NotifyDelivery, body: bytes, timeout: float) -> int:
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Djflow-Event": row.event,
        "X-Djflow-Delivery": str(row.id),
        "X-Djflow-Run": str(row.run_id),
    }
    secret = _secret(row)
    if secret is not None:
        headers["X-Djflow-Signature"] = notify.signature(secret, body)
    try:
        url = httpx2.URL(row.url)
        netguard.check_scheme(url)
    except (httpx2.InvalidURL, StepFailure) as error:
        raise netguard.AddressRefused(f"notify: the URL is not valid ({error})") from None
    where = netguard.shown(url)
    try:
        with (
            netguard.client(timeout=timeout) as client,
            client.stream("POST", url, headers=headers, content=body) as response,
        ):
            size = 0
            for chunk in response.iter_raw():
                size += len(chunk)
                if size > _ANSWER_BYTES:
                    break
            status = response.status_code
    except netguard.AddressRefused as refused:
        reason = refused.message.removeprefix("http: ")
        raise netguard.AddressRefused(f"POST {where} refused: {reason}") from None
    except httpx2.TimeoutException:
        raise _Failed(f"POST {where} timed out after {timeout:g} s") from None
    except httpx2.TransportError as error:
        raise _Failed(f"POST {where} failed: {type(error).__name__}") from None
    if not 200 <= status < 300:
        raise _Failed(f"POST {where} answered {status}", status)
    return status


def _secret(row: NotifyDelivery) -> str | None:
    entries = notify.entries(row.run.version.document)
    if row.entry >= len(entries) or "secret" not in entries[row.entry]:
        return None
    secret = notify.decrypt(row.run.version.secrets).get(row.entry)
    if secret is not None:
        # The frames' locals reach Sentry and error reports, which mask what is held.
        field_secrets.expose([secret])
    return secret


def _failed_attempt(row: NotifyDelivery, message: str, status: int | None, now: datetime) -> str:
    tunables = settings.DJFLOW
    if row.attempts >= tunables["NOTIFY_MAX_ATTEMPTS"]:
        return _give_up(row, message, status)
    wait = min(
        tunables["NOTIFY_BACKOFF_MAX_SECONDS"],
        tunables["NOTIFY_BACKOFF_SECONDS"] * 2 ** (row.attempts - 1),
    )
    with transaction.atomic():
        updated = NotifyDelivery.objects.filter(
            id=row.id, status=DeliveryStatus.PENDING, attempts=row.attempts
        ).update(due_at=now + timedelta(seconds=wait), last_error=message, response_status=status)
        if updated:
            dispatch.notify_on_commit([row.id], countdown=wait)
    logger.info("notify: delivery %s attempt %d: %s", row.id, row.attempts, message)
    return "retrying"


def _give_up(row: NotifyDelivery, message: str, status: int | None) -> str:
    NotifyDelivery.objects.filter(id=row.id, status=DeliveryStatus.PENDING).update(
        status=DeliveryStatus.FAILED, last_error=message, response_status=status
    )
    logger.warning(
        "notify: delivery %s of run %s failed after %d attempt(s): %s",
        row.id,
        row.run_id,
        row.attempts,
        message,
    )
    return "failed"


def reoffer_lost(now: datetime, batch: int) -> int:
    """Offer again the pending deliveries whose message was lost: due for longer than
    ``LOST_MESSAGE_SECONDS``. The offer moves ``due_at`` (from the value read) to now, so two
    reconcilers never offer one twice and the message finds it due."""
    lost = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    stale = list(
        NotifyDelivery.objects.filter(status=DeliveryStatus.PENDING, due_at__lte=lost)
        .order_by("due_at")
        .values_list("id", "due_at")[:batch]
    )
    offered: list[int] = []
    for delivery_id, due_at in stale:
        if NotifyDelivery.objects.filter(
            id=delivery_id, status=DeliveryStatus.PENDING, due_at=due_at
        ).update(due_at=now):
            offered.append(delivery_id)
    if offered:
        with transaction.atomic():
            dispatch.notify_on_commit(offered)
    return len(offered)


__all__ = ["deliver", "render_body", "reoffer_lost"]
