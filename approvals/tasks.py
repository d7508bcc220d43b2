"""Thin Celery tasks of the approvals app: ids in, a service called, idempotent."""

from __future__ import annotations

import smtplib

from celery import shared_task

from . import outbox

# SMTP refusing, a connection reset or a DNS hiccup: worth another try.
RETRIED = (smtplib.SMTPException, OSError)


@shared_task(
    name="approvals.send_mail",
    bind=True,
    ignore_result=True,
    autoretry_for=RETRIED,
    retry_backoff=2,
    retry_backoff_max=300,
    max_retries=8,
)
def send_mail(self, mail_id: int) -> bool:
    try:
        return outbox.deliver(mail_id)
    except RETRIED as error:
        if self.request.retries >= self.max_retries:
            outbox.give_up(mail_id, error)
        raise
