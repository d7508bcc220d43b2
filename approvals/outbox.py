"""The e-mail outbox: a ``Mail`` row is written in the transaction that causes the mail and
sent by ``approvals.send_mail`` after commit. SMTP failures are retried by Celery; a message
lost on the way is offered again by :func:`reoffer_unsent` (run by the reconciler).

The body is rendered when the mail is sent, from the rows it points at, so a reminder or a
late retry shows who has decided by then.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.db import transaction
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from workflows.secrets import shown_text

from .models import Approver, Mail, Notification
from .status import MailKind, MailStatus
from .tokens import link_for

logger = logging.getLogger(__name__)

# The task's name (approvals.tasks): sent by name, since the task calls this module. A process
# that has not imported the task sends it with ``send_task``, which knows no declared option:
# the message says ``ignore_result`` itself; its queue comes from ``CELERY_TASK_ROUTES``.
SEND_MAIL = "approvals.send_mail"


def queue(
    kind: str,
    to: str,
    *,
    approver: Approver | None = None,
    notification: Notification | None = None,
) -> Mail | None:
    """Write a mail to send once the caller's transaction commits; None without an address."""
    if not to:
        return None
    mail = Mail.objects.create(kind=kind, to=to, approver=approver, notification=notification)
    offer_on_commit([mail.id])
    return mail


def offer_on_commit(mail_ids: list[int]) -> None:
    def offer() -> None:
        for mail_id in mail_ids:
            current_app.signature(SEND_MAIL, (mail_id,), ignore_result=True).apply_async()

    # robust: a broker outage leaves the mail queued; the reconciler offers it again.
    transaction.on_commit(offer, robust=True)


def deliver(mail_id: int) -> bool:
    """Send one queued mail; True when this call sent it. Raises what the e-mail backend
    raises (the task retries). A mail already sent is not sent again."""
    mail = (
        Mail.objects.select_related("approver__request__run", "approver__user", "notification__run")
        .filter(id=mail_id)
        .first()
    )
    if mail is None or mail.status != MailStatus.QUEUED:
        return False
    message = render(mail)
    # Claim before sending (the claim moves ``offered_at``, so the reconciler leaves a mail
    # being sent alone): of two copies of the task, one sends. A worker lost mid-send leaves
    # the mail queued and the reconciler offers it again: at least once.
    claimed = Mail.objects.filter(id=mail.id, status=MailStatus.QUEUED, tries=mail.tries).update(
        tries=mail.tries + 1, offered_at=timezone.now()
    )
    if not claimed:
        return False
    try:
        message.send()
    except Exception as error:
        Mail.objects.filter(id=mail.id).update(last_error=f"{type(error).__name__}: {error}")
        raise
    Mail.objects.filter(id=mail.id, status=MailStatus.QUEUED).update(
        status=MailStatus.SENT, sent_at=timezone.now()
    )
    return True


def give_up(mail_id: int, error: BaseException) -> None:
    Mail.objects.filter(id=mail_id, status=MailStatus.QUEUED).update(
        status=MailStatus.FAILED, last_error=f"{type(error).__name__}: {error}"
    )


def render(mail: Mail) -> EmailMultiAlternatives:
    context = mail_context(mail)
    template = f"emails/{mail.kind}"
    # A message or details resolved from a secret carry its token: shown as ••••.
    subject = shown_text(" ".join(render_to_string(f"{template}_subject.txt", context).split()))
    text = shown_text(render_to_string(f"{template}.txt", context))
    html = shown_text(render_to_string(f"{template}.html", context))
    message = EmailMultiAlternatives(subject, text, settings.DEFAULT_FROM_EMAIL, [mail.to])
    message.attach_alternative(html, "text/html")
    return message


def mail_context(mail: Mail) -> dict[str, Any]:
    """What the e-mail templates get: the request, the approver's link and who has decided
    (approval mails), or the notification (hand-offs, escalations).

    An approval mail carries the request's details (the step input) only when the step asks
    for it (``email_details``): a mailbox is read by more eyes and kept longer than the page
    behind the link, which shows them to whoever may use it."""
    site = settings.SITE_URL.rstrip("/")
    context: dict[str, Any] = {"mail": mail, "site_url": site}
    if mail.approver is not None:
        request = mail.approver.request
        context.update(
            request=request,
            run=request.run,
            approver=mail.approver,
            link=link_for(mail.approver),
            decisions=list(request.decisions.all()),
            details=pretty(request.details) if request.email_details else "",
        )
    if mail.notification is not None:
        context.update(
            notification=mail.notification,
            run=mail.notification.run,
            notifications_url=f"{site}{reverse('approvals:notifications')}",
        )
    return context


def pretty(value: Any) -> str:
    """JSON as people read it, for pages and mails."""
    if value is None:
        return ""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


# A mail tried and failing is in Celery's retries (back-off up to 5 minutes apart); only
# one whose last try is older than any retry's wait has lost its chain of retries.
RETRIES_LOST_SECONDS = 600


def reoffer_unsent(now: datetime, batch: int) -> int:
    """Offer again queued mails whose message was lost: never tried for
    ``LOST_MESSAGE_SECONDS`` (the broker was down at commit, the message vanished), or tried
    but quiet for longer than Celery's retries wait (the worker holding the retry died).
    A mail in its retries is left to them: a second chain would double every try."""
    lost = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    dropped = now - timedelta(seconds=RETRIES_LOST_SECONDS)
    stale = list(
        Mail.objects.filter(status=MailStatus.QUEUED, offered_at__lte=lost)
        .filter(Q(tries=0) | Q(offered_at__lte=dropped))
        .order_by("offered_at")
        .values_list("id", flat=True)[:batch]
    )
    if not stale:
        return 0
    Mail.objects.filter(id__in=stale).update(offered_at=now)
    with transaction.atomic():
        offer_on_commit(stale)
    return len(stale)


__all__ = ["MailKind", "deliver", "give_up", "queue", "reoffer_unsent"]
