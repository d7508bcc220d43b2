"""The e-mails: rendered from the rows when sent, with the link in both parts; an SMTP
failure leaves the mail queued with its error and raises, so Celery retries it."""

from __future__ import annotations

import smtplib
from datetime import timedelta

import pytest
from django.core import mail as django_mail
from django.utils import timezone

from approvals import gates, outbox
from approvals.models import ApprovalRequest, Mail
from approvals.tasks import RETRIED
from approvals.tokens import read_token

from .builders import approver, decide_by_link, link_client, make_group, make_user, start_approval

pytestmark = pytest.mark.django_db

LOCMEM = "django.core.mail.backends.locmem.EmailBackend"


class RefusingBackend:
    """An e-mail backend whose SMTP server refuses every message."""

    def __init__(self, *args, **kwargs):
        pass

    def send_messages(self, messages):
        raise smtplib.SMTPException("421 try again later")


@pytest.fixture(autouse=True)
def locmem(settings):
    settings.EMAIL_BACKEND = LOCMEM
    settings.SITE_URL = "https://flows.example.com"


def sent_to(address: str) -> django_mail.EmailMultiAlternatives:
    found = [m for m in django_mail.outbox if m.to == [address]]
    assert len(found) == 1, [m.to for m in django_mail.outbox]
    return found[0]


def html_of(message) -> str:
    ((body, kind),) = message.alternatives
    assert kind == "text/html"
    return body


def token_in(text: str) -> str:
    start = text.index("https://flows.example.com/approvals/link/")
    end = text.index("/", start + len("https://flows.example.com/approvals/link/"))
    return text[start + len("https://flows.example.com/approvals/link/") : end]


def test_request_mails_carry_the_link_in_both_parts() -> None:
    make_user("bob")
    _, request = start_approval(
        users=["bob"], emails=["ext@example.org"], timeout_ms=86_400_000, email_details=True
    )
    queued = Mail.objects.filter(approver__request=request, kind="request")
    assert queued.count() == 2
    for mail in queued:
        assert outbox.deliver(mail.id) is True
    message = sent_to("ext@example.org")
    assert message.subject == "Approval needed: sign_off of expense"
    ext = approver(request, "ext@example.org")
    for part in (message.body, html_of(message)):
        assert "https://flows.example.com/approvals/link/" in part
        # The link is ext's own: its token reads back to ext's approver row.
        assert read_token(token_in(part)).id == ext.id
        assert "Pay 120 EUR to Acme Paper?" in part
        assert "Acme Paper" in part and "amount" in part  # the details, as the step asks
        assert "Deadline:" in part or "Deadline</td>" in part
    assert "&quot;vendor&quot;" in html_of(message)  # escaped in HTML
    assert '"vendor": "Acme Paper"' in message.body  # not in text
    bob_mail = sent_to("bob@example.com")
    assert read_token(token_in(bob_mail.body)).id == approver(request, "bob").id
    assert Mail.objects.filter(approver__request=request, status="sent").count() == 2


IBAN = "DE89 3704 0044 0532 0130 00"
WITH_IBAN = {"amount": "${input.amount}", "vendor": "${input.vendor}", "iban": IBAN}


@pytest.mark.parametrize("asked", [None, False])
def test_mails_carry_the_message_and_link_but_no_details_unless_asked(asked) -> None:
    """The details are the step input: a mailbox keeps what it is sent for years, forwards
    it, and shows it to whoever reads over a shoulder; the page behind the link shows them."""
    fields = {} if asked is None else {"email_details": asked}
    make_user("bob")
    _, request = start_approval(
        users=["bob"], emails=["ext@example.org"], input=WITH_IBAN, **fields
    )
    assert request.email_details is False
    for mail in Mail.objects.filter(approver__request=request):
        outbox.deliver(mail.id)
    for address in ("bob@example.com", "ext@example.org"):
        message = sent_to(address)
        for part in (message.body, html_of(message)):
            assert "Pay 120 EUR to Acme Paper?" in part  # the message
            assert "https://flows.example.com/approvals/link/" in part  # the link
            assert IBAN not in part and "iban" not in part
            assert "Details" not in part
    # Reminders alike.
    ApprovalRequest.objects.filter(id=request.id).update(remind_after_ms=60_000)
    gates.remind(step_run_id=request.step_run_id, now=request.created_at + timedelta(minutes=1))
    django_mail.outbox.clear()
    for mail in Mail.objects.filter(kind="reminder"):
        outbox.deliver(mail.id)
    assert len(django_mail.outbox) == 2
    for message in django_mail.outbox:
        for part in (message.body, html_of(message)):
            assert "Pay 120 EUR to Acme Paper?" in part
            assert IBAN not in part


def test_a_step_that_asks_for_them_mails_the_details() -> None:
    _, request = start_approval(emails=["ext@example.org"], input=WITH_IBAN, email_details=True)
    assert request.email_details is True
    outbox.deliver(Mail.objects.get(approver__request=request).id)
    message = sent_to("ext@example.org")
    for part in (message.body, html_of(message)):
        assert "Details" in part and IBAN in part


def test_the_mailed_link_opens_the_confirmation_page() -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"])
    outbox.deliver(Mail.objects.get(approver__request=request).id)
    token = token_in(sent_to("bob@example.com").body)
    page = link_client(approver(request, "bob")).get(f"/approvals/link/{token}/")
    assert page.status_code == 200
    assert "Pay 120 EUR to Acme Paper?" in page.content.decode()


def test_a_reminder_shows_who_decided_so_far() -> None:
    for name in ("bob", "cy"):
        make_user(name)
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    decide_by_link(request, "cy", "approved", comment="ok")
    ApprovalRequest.objects.filter(id=request.id).update(remind_after_ms=60_000)
    first_slot = request.created_at + timedelta(minutes=1)
    assert gates.remind(step_run_id=request.step_run_id, now=first_slot) == 1  # bob only
    reminder = Mail.objects.get(kind="reminder")
    assert reminder.to == "bob@example.com"
    outbox.deliver(reminder.id)
    message = sent_to("bob@example.com")
    assert message.subject.startswith("Reminder: approval still needed")
    for part in (message.body, html_of(message)):
        assert "Decided so far" in part
        assert "cy approved" in part
        assert "/approvals/link/" in part
        assert "Deadline" not in part  # no timeout_ms: no deadline


def test_handoff_mail_has_the_notification_and_its_page() -> None:
    bob = make_user("bob")
    make_group("finance", bob)
    run, request = start_approval(users=["bob"], then_handoff="finance")
    decide_by_link(request, "bob", "approved")
    handoff = Mail.objects.get(kind="handoff")
    outbox.deliver(handoff.id)
    message = sent_to("bob@example.com")
    assert message.subject == "Hand-off from expense: tell_finance"
    for part in (message.body, html_of(message)):
        assert "Paid Acme Paper" in part
        assert "https://flows.example.com/notifications/" in part
        assert str(run.id) in part


def test_escalation_mail() -> None:
    from runs.services import run_start
    from workflows.services import definition_save

    make_user("bob")
    make_user("boss")
    definition_save(
        document={
            "id": "urgent",
            "steps": [
                {
                    "id": "ok",
                    "kind": "approval",
                    "approvers": {"users": ["bob"]},
                    "message": "Ship it?",
                    "timeout_ms": 60_000,
                    "escalate_to": {"users": ["boss"]},
                }
            ],
        }
    )
    run = run_start(workflow="urgent", input={}).run
    request = ApprovalRequest.objects.get(run=run)
    assert gates.expire(request.step_run_id, timezone.now() + timedelta(minutes=2))
    escalation = Mail.objects.get(kind="escalation")
    outbox.deliver(escalation.id)
    message = sent_to("boss@example.com")
    assert message.subject.startswith("Escalation: Approval 'ok' of urgent expired")
    for part in (message.body, html_of(message)):
        assert "Ship it?" in part
        assert "https://flows.example.com/notifications/" in part


def test_a_mail_is_sent_once() -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"])
    mail = Mail.objects.get(approver__request=request)
    assert outbox.deliver(mail.id) is True
    assert outbox.deliver(mail.id) is False
    assert len(django_mail.outbox) == 1


def test_an_smtp_failure_keeps_the_mail_queued_and_raises(settings) -> None:
    settings.EMAIL_BACKEND = f"{__name__}.RefusingBackend"
    make_user("bob")
    _, request = start_approval(users=["bob"])
    mail = Mail.objects.get(approver__request=request)
    with pytest.raises(smtplib.SMTPException) as raised:
        outbox.deliver(mail.id)
    # The task retries exactly these errors (autoretry_for).
    assert isinstance(raised.value, RETRIED)
    mail.refresh_from_db()
    assert mail.status == "queued"
    assert mail.tries == 1
    assert mail.last_error == "SMTPException: 421 try again later"
    assert mail.sent_at is None
    # The server recovers: the retry sends it.
    settings.EMAIL_BACKEND = LOCMEM
    assert outbox.deliver(mail.id) is True
    mail.refresh_from_db()
    assert (mail.status, mail.tries) == ("sent", 2)
    assert len(django_mail.outbox) == 1


def test_the_last_retry_that_fails_marks_the_mail_failed_with_its_error(settings) -> None:
    from approvals.tasks import send_mail

    settings.EMAIL_BACKEND = f"{__name__}.RefusingBackend"
    make_user("bob")
    _, request = start_approval(users=["bob"])
    mail = Mail.objects.get(approver__request=request)

    def attempt(retries: int) -> None:
        # The task's body as the worker runs it on that retry (autoretry wraps ``run``;
        # ``apply`` would close the test's database connection after the task).
        send_mail.push_request(retries=retries)
        try:
            with pytest.raises(smtplib.SMTPException):
                send_mail._orig_run(mail.id)
        finally:
            send_mail.pop_request()

    attempt(send_mail.max_retries - 1)  # a retry follows: the mail stays queued
    mail.refresh_from_db()
    assert (mail.status, mail.tries) == ("queued", 1)
    attempt(send_mail.max_retries)  # the last: given up, with its error
    mail.refresh_from_db()
    assert (mail.status, mail.last_error) == ("failed", "SMTPException: 421 try again later")
    far = timezone.now() + timedelta(hours=1)
    assert outbox.reoffer_unsent(far, 100) == 0  # never offered again


def test_email_details_is_read_for_approvals_at_any_depth() -> None:
    from runs.services import run_start
    from workflows.services import definition_save

    make_user("bob")

    def gate(step_id: str, details: bool) -> dict:
        return {
            "id": step_id,
            "kind": "approval",
            "approvers": {"users": ["bob"]},
            "email_details": details,
        }

    definition_save(
        document={
            "id": "deep",
            "limits": {"run_timeout_ms": 3_600_000},
            "steps": [
                {
                    "id": "both",
                    "kind": "parallel",
                    "branches": {
                        "left": gate("left_gate", True),
                        "right": [
                            {
                                "id": "pick",
                                "kind": "condition",
                                "if": {"path": "input.go", "op": "eq", "value": True},
                                "then": [gate("then_gate", False)],
                                "else": [gate("else_gate", True)],
                            }
                        ],
                    },
                },
                {"id": "each", "kind": "foreach", "items": [1], "do": gate("item_gate", True)},
            ],
        }
    )
    run = run_start(workflow="deep", input={"go": False}).run
    opened = dict(ApprovalRequest.objects.filter(run=run).values_list("step_id", "email_details"))
    assert opened == {"left_gate": True, "else_gate": True}
