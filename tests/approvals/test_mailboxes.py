"""E-mail approvers are parsed once, the way they are sent (issue 36): the approver domain rule
checks the address Django's SMTP backend delivers to, one bare mailbox per entry, and the
approver row (and so the mail) holds exactly that address.

The attack: ``x@evil.com(@example.com`` ended in ``example.com`` for a rule that took the
text after the last ``@``, and Django's ``sanitize_address`` (through which its SMTP backend
passes every recipient into RCPT TO) reads it as ``x@evil.com`` with a comment, so the
author's text and a working approval link went to evil.com."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from django.core.mail import EmailMessage
from django.core.mail.message import sanitize_address
from rest_framework.test import APIClient

from approvals import outbox
from approvals.models import ApprovalRequest, Mail
from runs.models import StepRun
from runs.services import run_start
from workflows.mailbox import MailboxProblem, mailbox
from workflows.models import WorkflowVersion
from workflows.services import definition_save

from .test_bounds import author, refused

__all__ = ["author"]  # a fixture

pytestmark = pytest.mark.django_db

FIELD = "steps[0].approvers.emails[0]"

# Each is refused at save, for everyone: what each would have become on the wire (through
# sanitize_address) is in the comment. The ones marked "passed" got through the old rule
# (text after the last @) with DJFLOW_APPROVER_EMAIL_DOMAINS=example.com.
REFUSED = [
    "x@evil.com(@example.com",  # passed; RCPT TO x@evil.com
    "x@evil.com(a comment)@example.com",  # passed; a parse error in the mailer
    "(c)x@evil.com",  # a comment first
    "x@evil.com (@example.com)",
    "Eve <x@evil.com>",  # a display name
    "x@example.com <x@evil.com>",
    '"x@example.com" <x@evil.com>',
    "x@evil.com, y@example.com",  # passed; a list
    "x@evil.com,y@example.com",  # passed
    "x@evil.com;y@example.com",  # passed
    "undisclosed: x@evil.com, y@example.com;",  # a group
    "g:x@evil.com;@example.com",  # passed
    '"x@evil.com"@example.com',  # passed; a quoted local part
    '"x"@example.com',
    "x%evil.com@example.com",  # passed; the percent hack: example.com's relay forwards it
    "x!evil.com@example.com",  # passed; a bang path
    "@example.com:x@evil.com",  # a source route
    "@evil.com:x@example.com",  # passed
    "x@example.com.",  # passed; a trailing dot
    "x@.example.com",
    "x..y@example.com",
    ".x@example.com",
    "x@example..com",
    "x@-example.com",
    "x@example",  # one label
    "x@[127.0.0.1]",  # a domain literal
    "x@ex\u0430mple.com",  # a Cyrillic a: another domain (xn--exmple-4nf.com)
    "x@example.\uff43\uff4f\uff4d",  # fullwidth com: IDNA maps it to example.com
    "x@évil.example",  # an IDN in Unicode: write it as xn--vil-bma.example
    "é@example.com",  # a non-ASCII local part (SMTPUTF8)
    "x@evil.com\r\n@example.com",  # passed; CR/LF
    "x@example.com\r\nBcc: y@evil.com",
    "x@example.com\nBcc: y@evil.com",
    "x@evil.com\x00@example.com",  # passed; NUL
    "x @example.com",
    " x@example.com",
    "x@example.com ",
    "x@evil.com\t@example.com",
    "x",
    "x@",
    "@example.com",
    "x@@example.com",
    "a" * 65 + "@example.com",  # a local part over 64
    "x@" + "a" * 64 + ".com",  # a label over 63
]

# (entry, the address mail goes to).
ACCEPTED = [
    ("ann@example.com", "ann@example.com"),
    ("Ann@EXAMPLE.COM", "Ann@example.com"),
    ("ann.lee+pay@mail.example.com", "ann.lee+pay@mail.example.com"),
    ("o'brien@example.com", "o'brien@example.com"),
    ("x_y-z=1@sub-1.example.co.uk", "x_y-z=1@sub-1.example.co.uk"),
    ("x@xn--vil-bma.example", "x@xn--vil-bma.example"),
]


def document(workflow: str = "pay", emails: list[str] | None = None) -> dict[str, Any]:
    return {
        "id": workflow,
        "limits": {"run_timeout_ms": 86_400_000},
        "steps": [
            {
                "id": "gate",
                "kind": "approval",
                "message": "Pay?",
                "approvers": {"emails": emails or ["ann@example.com"]},
            }
        ],
    }


@pytest.fixture
def domains(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "APPROVER_EMAIL_DOMAINS": ["example.com"]}


@pytest.mark.parametrize("entry", REFUSED)
def test_every_entry_that_is_not_one_bare_mailbox_is_refused(entry: str) -> None:
    with pytest.raises(MailboxProblem):
        mailbox(entry)


@pytest.mark.parametrize("entry", REFUSED)
def test_an_author_held_to_the_domains_gets_a_400_naming_the_entry(
    entry: str, author, domains
) -> None:
    """The regression: on the old rule the entries marked "passed" saved, and the mail went
    where sanitize_address sends it."""
    errors = refused(document(emails=[entry]), author)
    assert FIELD in errors, errors


@pytest.mark.parametrize("entry", ["x@evil.com(@example.com", "x@evil.com, y@example.com"])
def test_the_deployment_and_superusers_are_held_to_the_shape_too(entry, admin_user) -> None:
    """May mail anywhere, but still one bare mailbox per entry: what the rule reads is what
    is sent, whoever saves."""
    assert FIELD in refused(document(emails=[entry]), None)
    assert FIELD in refused(document(emails=[entry]), admin_user)


@pytest.mark.parametrize(("entry", "delivered"), ACCEPTED)
def test_an_accepted_entry_is_the_address_the_smtp_backend_delivers_to(entry, delivered) -> None:
    assert mailbox(entry) == delivered
    # What Django's SMTP backend puts in RCPT TO: each of message.recipients() through
    # sanitize_address with the message's encoding.
    message = EmailMessage("s", "b", "from@example.com", [mailbox(entry)])
    assert [sanitize_address(r, message.encoding or "utf-8") for r in message.recipients()] == [
        delivered
    ]


def test_the_domain_rule_reads_the_delivered_domain(author, domains) -> None:
    fine = ["Ann@EXAMPLE.COM", "bob@example.com"]
    assert definition_save(document=document(emails=fine), user=author).created
    errors = refused(document("other", emails=["x@mail.example.com"]), author)
    assert "outside the approver e-mail domains" in errors[FIELD]


def test_the_api_answers_400_naming_the_field(author, domains) -> None:
    api = APIClient()
    api.force_authenticate(author)
    answer = api.post(
        "/api/v1/definitions", document(emails=["x@evil.com(@example.com"]), format="json"
    )
    assert answer.status_code == 400
    assert [e["field"] for e in answer.json()["errors"]] == [FIELD]


def test_the_approver_row_and_the_mail_hold_the_delivered_address(domains) -> None:
    definition_save(document=document(emails=["Ann@EXAMPLE.COM", "ann@example.com"]))
    run = run_start(workflow="pay", input={}).run
    # One person (the same mailbox twice), under the address mail goes to.
    person = ApprovalRequest.objects.get(run=run).people.get()
    assert person.email == "Ann@example.com"
    assert list(Mail.objects.values_list("to", flat=True)) == ["Ann@example.com"]


def test_a_version_stored_before_the_parser_fails_the_step_and_mails_no_one() -> None:
    """Versions are immutable and may predate the rule: the request does not open."""
    saved = definition_save(document=document()).version
    bad = document(emails=["x@evil.com(@example.com"])
    WorkflowVersion.objects.filter(pk=saved.pk).update(document={**bad, "version": 1})
    run = run_start(workflow="pay", input={}).run
    gate = StepRun.objects.get(run=run, step_id="gate")
    assert gate.status == "failed"
    assert gate.error["class"] == "invalid_input"
    assert gate.error["message"].startswith("approvers.emails[0]: must be one bare e-mail")
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()


class Envelopes:
    """aiosmtpd's handler: keeps each message's RCPT TO."""

    def __init__(self) -> None:
        self.rcpt_tos: list[list[str]] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.rcpt_tos.append(list(envelope.rcpt_tos))
        return "250 OK"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_on_the_wire_rcpt_to_is_the_address_the_rule_checked(settings) -> None:
    """Django's real SMTP backend against a local SMTP server: RCPT TO is the normalised
    address, the one whose domain the rule read."""
    port = free_port()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", port, 5
    definition_save(document=document(emails=["Ann.Lee+pay@Mail.EXAMPLE.com"]))
    run_start(workflow="pay", input={})
    envelopes = Envelopes()
    server = Controller(envelopes, hostname="127.0.0.1", port=port)
    server.start()
    try:
        assert outbox.deliver(Mail.objects.get().id)
    finally:
        server.stop()
    assert envelopes.rcpt_tos == [["Ann.Lee+pay@mail.example.com"]]
