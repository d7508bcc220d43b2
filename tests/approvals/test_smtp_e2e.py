"""Mail over real SMTP: a worker sends approval e-mails to a local SMTP server (aiosmtpd,
on loopback). While the server is down the send fails and Celery retries it; once the
server is up, the mail arrives, once, with its link."""

from __future__ import annotations

import socket
from email import message_from_bytes, policy
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from django.contrib.auth import get_user_model

from approvals.models import Mail
from runs import services
from runs.models import Run
from tests.processes import wait_for
from tests.runs.flows import ensure_effects_table

pytestmark = [pytest.mark.slow]


class Inbox:
    """aiosmtpd's handler: keeps every message it is given."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(message_from_bytes(envelope.content, policy=policy.default))
        return "250 OK"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_mail_that_smtp_refuses_is_retried_and_arrives_once_the_server_is_up(
    celery_processes, transactional_db
) -> None:
    ensure_effects_table()
    get_user_model().objects.create_user("ann", "ann@example.com", "a-long-password-1")
    get_user_model().objects.create_user("bob", "bob@example.com", "a-long-password-1")
    port = free_port()
    celery_processes.worker(
        workflow_modules=["tests.approvals.flows"],
        env={
            "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
            "EMAIL_HOST": "127.0.0.1",
            "EMAIL_PORT": str(port),
            "EMAIL_TIMEOUT": "2",
            "SITE_URL": "http://127.0.0.1:8000",
        },
    )
    run = services.run_start(workflow="release", input={"version": "9.9"}).run

    def refused() -> bool:
        mails = list(Mail.objects.filter(approver__request__run=run))
        return len(mails) == 3 and all(m.tries >= 1 and m.last_error for m in mails)

    wait_for(refused, timeout=30, interval=0.2, message=celery_processes.logs)
    assert Run.objects.get(id=run.id).status == "pending_approval"  # the run never waited
    assert not Mail.objects.filter(status="sent").exists()
    assert "refused" in Mail.objects.first().last_error.lower()

    inbox = Inbox()
    server = Controller(inbox, hostname="127.0.0.1", port=port)
    server.start()
    try:
        wait_for(
            lambda: Mail.objects.filter(status="sent").count() == 3,
            timeout=40,
            interval=0.2,
            message=celery_processes.logs,
        )
    finally:
        server.stop()
    assert sorted(str(m["To"]) for m in inbox.messages) == [
        "ann@example.com",
        "bob@example.com",
        "ops@example.com",
    ]
    first = inbox.messages[0]
    assert "Ship release 9.9?" in first.get_body(("plain",)).get_content()
    assert "/approvals/link/" in first.get_body(("html",)).get_content()
    assert all(m.tries >= 2 for m in Mail.objects.all())
