"""Secrets (writeOnly input fields, contract section 8) through the engine, in one process:
stored as tokens with their values encrypted on the run, given to handlers, shown as ``••••``
by the API, the admin, the pages and the e-mails, masked in logs and Sentry events.

The same on a real worker, with a ``pg_dump`` of the database: ``test_secrets_e2e.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import sentry_sdk
from django.apps import apps
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from sentry_sdk.transport import Transport

from approvals import outbox
from approvals.models import ApprovalRequest, Mail
from approvals.services import Origin, approval_decide
from runs import vault
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from runs.services import run_start
from workers.execution import execute
from workflows import registry, secrets
from workflows.secrets import MASK, TOKEN

from . import flows_secrets as flows

pytestmark = pytest.mark.django_db

KEY = "sk-live-9c1e5a7b3d2f4e6a"
PIN = 48_392_071  # more digits than a timestamp's microseconds
INPUT = {"ticket": "T-7", "creds": {"api_key": KEY, "user": "bob"}, "pins": [PIN]}
BASE_DIR = Path(__file__).resolve().parents[2]


@pytest.fixture
def documents(db) -> None:
    """The flows' documents saved and their handlers registered (other tests clear the
    registry), and ann, the approver."""
    for workflow_id, step_id, fn in [
        ("vault_child", "use_key", flows.use_key),
        ("vault_flow", "call", flows.call),
        ("vault_flow", "again", flows.again),
        ("vault_flow", "boom", flows.boom),
    ]:
        registry.register(workflow_id, step_id, fn)
    flows.child.save()
    flows.vault.save()
    get_user_model().objects.create_user("ann", "ann@example.com", "a-long-password-1")


@pytest.fixture
def offers():
    """Offers to workers are not sent: the tests run each attempt in this process."""
    with mock.patch("workers.tasks.execute_step.apply_async"):
        yield


def start(api: APIClient, body: dict[str, Any] | None = None) -> tuple[Run, dict[str, Any]]:
    answer = api.post(
        "/api/v1/runs", {"workflow": "vault_flow", "input": INPUT, **(body or {})}, format="json"
    )
    assert answer.status_code == 201, answer.content
    return Run.objects.get(id=answer.json()["id"]), answer.json()


def scheduled(run: Run) -> StepRun:
    return StepRun.objects.get(run=run, status="scheduled")


def run_to_the_gate(api: APIClient) -> Run:
    run, _ = start(api)
    execute(scheduled(run).id, worker="here")  # call, then again inline; the gate opens
    run.refresh_from_db()
    assert run.status == "pending_approval", run.error
    return run


def run_to_the_end(api: APIClient) -> Run:
    run = run_to_the_gate(api)
    request = ApprovalRequest.objects.get(run=run)
    ann = get_user_model().objects.get(username="ann")
    approval_decide(request_id=request.id, decision="approved", origin=Origin("api"), user=ann)
    child = Run.objects.get(parent_run=run)
    execute(scheduled(child).id, worker="here")
    run_advance(run_id=run.id)  # the child's end, asked of the parent (a message in production)
    execute(scheduled(run).id, worker="here")  # boom: fails, on_error continue
    run.refresh_from_db()
    assert run.status == "completed", run.error
    return run


def every_row() -> str:
    """Every row of every table the project's models (and Django's) have, as text."""
    rows = []
    for model in apps.get_models(include_auto_created=True):
        rows.extend(repr(row) for row in model._base_manager.values())
    return "\n".join(rows)


def assert_no_plaintext(text: str) -> None:
    assert KEY not in text
    assert str(PIN) not in text


def assert_masked(text: str, *, shows_mask: bool = True) -> None:
    """What people see: neither a value nor a token (which only the database holds)."""
    assert_no_plaintext(text)
    assert not TOKEN.search(text), TOKEN.search(text)
    if shows_mask:
        assert MASK in text


# --- the engine -------------------------------------------------------------------------------


def test_the_stored_input_holds_tokens_and_the_run_its_encrypted_values(
    api, documents, offers
) -> None:
    run, shown = start(api)

    assert shown["input"] == {
        "ticket": "T-7",
        "creds": {"api_key": MASK, "user": "bob"},
        "pins": [MASK],
    }
    token = run.input["creds"]["api_key"]
    assert TOKEN.fullmatch(token) and run.input["creds"]["user"] == "bob"
    assert KEY not in run.secrets
    assert vault.decrypt(run.secrets, run_id=run.id)[token] == KEY
    # The first step's input came through a template: "Bearer <token>", never the key.
    step = scheduled(run)
    assert step.input["auth"] == f"Bearer {token}" and step.input["key"] == token
    assert_no_plaintext(every_row())


def test_handlers_get_the_values_and_what_they_echo_is_stored_masked(
    api, documents, offers, caplog
) -> None:
    with caplog.at_level(logging.INFO):
        run = run_to_the_end(api)

    call = run.steps.get(step_id="call")
    # The handler saw the key (its digest), the bearer text and the pins with their type.
    assert call.output["sha"] == flows.digest(KEY)
    assert call.output["bearer"] is True
    assert TOKEN.fullmatch(call.output["pins"][0])
    assert call.output["echo"] == f"used {call.input['key']}"
    assert call.spans[0]["attributes"]["key"] == call.input["key"]
    # The next handler got the echo back as the key (its input, and prior).
    again = run.steps.get(step_id="again")
    assert again.output == {
        "echo": flows.digest(f"used {KEY}"),
        "prior": flows.digest(f"used {KEY}"),
    }
    # The child run inherits the parent's secrets through its input's tokens.
    child = Run.objects.get(parent_run=run)
    assert child.input == {"key": call.input["key"]}
    assert child.steps.get().output == {"sha": flows.digest(KEY)}
    # An error message that quotes the key is stored with its token.
    boom = run.steps.get(step_id="boom")
    assert boom.status == "failed"
    assert boom.error["message"] == f"RuntimeError: the service refused key {call.input['key']}"
    assert call.input["key"] in boom.error["traceback"]
    assert run.output["sha"] == flows.digest(KEY) and run.output["child"] == flows.digest(KEY)

    assert_no_plaintext(every_row())
    # The handler's log line: masked where it was made.
    assert KEY not in caplog.text
    assert f"calling the service with key {MASK}" in caplog.text


def test_the_api_shows_the_mask_everywhere(api, documents, offers) -> None:
    run = run_to_the_end(api)
    child = Run.objects.get(parent_run=run)

    detail = api.get(f"/api/v1/runs/{run.id}")
    assert detail.status_code == 200
    assert_masked(detail.content.decode())
    body = detail.json()
    assert body["input"]["creds"]["api_key"] == MASK
    steps = {step["step_id"]: step for step in body["steps"]}
    assert steps["call"]["input"]["auth"] == f"Bearer {MASK}"
    assert steps["call"]["output"]["echo"] == f"used {MASK}"
    assert steps["boom"]["error"]["message"] == f"RuntimeError: the service refused key {MASK}"
    assert body["output"]["echo"] == f"used {MASK}"
    for answer in (api.get("/api/v1/runs"), api.get(f"/api/v1/runs/{child.id}")):
        assert answer.status_code == 200
        assert_masked(answer.content.decode())


def test_an_input_error_does_not_repeat_the_secret(api, documents) -> None:
    wrong = "pk-not-a-valid-key-0042"
    answer = api.post(
        "/api/v1/runs",
        {"workflow": "vault_flow", "input": {"ticket": "T", "creds": {"api_key": wrong}}},
        format="json",
    )
    assert answer.status_code == 400
    (error,) = answer.json()["errors"]
    assert error["field"] == "input.creds.api_key"
    assert wrong not in answer.content.decode() and MASK in error["message"]


# --- the admin, the pages, the e-mails --------------------------------------------------------


def test_the_admin_shows_the_mask(api, documents, offers, admin_client: Client) -> None:
    run = run_to_the_end(api)
    child = Run.objects.get(parent_run=run)
    lists = [
        reverse("admin:runs_run_changelist"),
        reverse("admin:runs_steprun_changelist"),
        reverse("admin:approvals_approvalrequest_changelist"),
    ]
    # Pages that show an input, output, error or message holding a secret.
    showing = [
        reverse("admin:runs_run_change", args=[run.id]),
        reverse("admin:runs_run_change", args=[child.id]),
        *(
            reverse("admin:runs_steprun_change", args=[step.id])
            for step in run.steps.filter(step_id__in=["call", "again", "gate", "child", "boom"])
        ),
        reverse(
            "admin:approvals_approvalrequest_change",
            args=[ApprovalRequest.objects.get(run=run).id],
        ),
    ]
    for page in lists + showing:
        answer = admin_client.get(page)
        assert answer.status_code == 200, page
        assert_masked(answer.content.decode(), shows_mask=page in showing)


def test_the_approval_mail_and_pages_show_the_mask(api, documents, offers) -> None:
    run = run_to_the_gate(api)
    request = ApprovalRequest.objects.get(run=run)
    assert request.message == f"Use key {run.input['creds']['api_key']} for T-7?"

    (mail,) = Mail.objects.filter(approver__request=request)
    message = outbox.render(mail)
    html = message.alternatives[0][0]
    for text in (message.subject, message.body, html):
        assert_masked(text, shows_mask=text is not message.subject)
    assert f"Use key {MASK} for T-7?" in message.body

    ann = Client()
    ann.force_login(get_user_model().objects.get(username="ann"))
    for page in ("/", reverse("approvals:inbox"), reverse("approvals:detail", args=[request.id])):
        answer = ann.get(page)
        assert answer.status_code == 200, page
        assert_masked(answer.content.decode())
    token, _ = Token.objects.get_or_create(user=get_user_model().objects.get(username="ann"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    listed = client.get("/api/v1/approvals?status=pending")
    assert listed.status_code == 200 and listed.json()["results"]
    assert_masked(listed.content.decode())


# --- keys -------------------------------------------------------------------------------------


def test_encryption_round_trip_and_the_key_from_djflow_field_key(settings) -> None:
    settings.DJFLOW_FIELD_KEY = []
    plain = {"[secret:0123456789abcdef0123]": KEY, "[secret:0123456789abcdef0124]": PIN}
    from_secret_key = vault.encrypt(plain)
    assert KEY not in from_secret_key
    assert vault.decrypt(from_secret_key, run_id="r") == plain
    assert vault.encrypt({}) == "" and vault.decrypt("", run_id="r") == {}

    settings.DJFLOW_FIELD_KEY = ["field-key-A-0123456789abcdefghijklmnop"]
    from_field_key = vault.encrypt(plain)
    assert vault.decrypt(from_field_key, run_id="r") == plain
    # DJFLOW_FIELD_KEY, not SECRET_KEY, is the key now: the old blob does not open.
    with pytest.raises(vault.SecretsUnreadable, match="DJFLOW_FIELD_KEY"):
        vault.decrypt(from_secret_key, run_id="r")

    # Rotation: the new key first encrypts; the old one, after it, still decrypts.
    settings.DJFLOW_FIELD_KEY = [
        "field-key-B-0123456789abcdefghijklmnop",
        "field-key-A-0123456789abcdefghijklmnop",
    ]
    assert vault.decrypt(from_field_key, run_id="r") == plain
    rotated = vault.encrypt(plain)
    settings.DJFLOW_FIELD_KEY = ["field-key-B-0123456789abcdefghijklmnop"]
    assert vault.decrypt(rotated, run_id="r") == plain


def test_a_changed_key_fails_the_attempt_with_a_clear_error_not_garbage(
    api, documents, offers, settings
) -> None:
    run, _ = start(api)
    settings.DJFLOW_FIELD_KEY = ["another-key-0123456789abcdefghijklmnop"]
    with mock.patch.object(flows, "digest") as handler_ran:
        execute(scheduled(run).id, worker="here")
    call = run.steps.get(step_id="call")
    assert call.status == "failed" and call.output is None
    assert call.error["class"] == "fatal"
    assert f"the secrets of run {run.id} were encrypted with a key" in call.error["message"]
    assert "DJFLOW_FIELD_KEY" in call.error["message"]
    handler_ran.assert_not_called()
    run.refresh_from_db()
    assert run.status == "failed"


def test_a_changed_key_fails_a_subworkflow_step_rather_than_the_engine(
    api, documents, offers, settings
) -> None:
    run = run_to_the_gate(api)
    settings.DJFLOW_FIELD_KEY = ["another-key-0123456789abcdefghijklmnop"]
    request = ApprovalRequest.objects.get(run=run)
    ann = get_user_model().objects.get(username="ann")
    approval_decide(request_id=request.id, decision="approved", origin=Origin("api"), user=ann)
    run_advance(run_id=run.id)
    step = run.steps.get(step_id="child")
    assert step.status == "failed"
    assert "encrypted with a key this process does not have" in step.error["message"]
    assert not Run.objects.filter(parent_run=run).exists()


def test_a_short_djflow_field_key_is_refused_at_start(tmp_path: Path) -> None:
    environ = {**os.environ, "DJFLOW_VAR_DIR": str(tmp_path), "DJFLOW_FIELD_KEY": "short"}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=BASE_DIR,
        env={**environ, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "DJFLOW_FIELD_KEY: each comma-separated key must be at least 32 characters" in (
        done.stderr
    )


# --- Sentry -----------------------------------------------------------------------------------


class Captured(Transport):
    """A Sentry transport that keeps what would be sent."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.sent: list[str] = []

    def capture_envelope(self, envelope: Any) -> None:
        self.sent.append(envelope.serialize().decode("utf-8", errors="replace"))


def refuse(key: str) -> None:
    header = f"Bearer {key}"  # a local variable: Sentry sends the frame's variables
    raise RuntimeError(f"the service refused {header}")


def test_sentry_events_are_scrubbed() -> None:
    from config.sentry import init_sentry

    transport = Captured()
    init_sentry(
        dsn="https://public@127.0.0.1/1",
        environment="test",
        traces_sample_rate=0.0,
        transport=transport,
    )
    try:
        with secrets.exposing([KEY]):
            logging.getLogger("tests.sentry").warning("about to use %s", KEY)  # a breadcrumb
            try:
                refuse(KEY)
            except RuntimeError:
                sentry_sdk.capture_exception()
        sentry_sdk.capture_message("stored as [secret:0123456789abcdef0123]")
        sentry_sdk.flush()
    finally:
        sentry_sdk.get_client().close()
        # No DSN: an inactive client, as in the other tests. The integrations it installed
        # stay installed (httpx2's among them), and an inactive client with Sentry's default
        # propagation still adds trace headers to every outgoing request.
        sentry_sdk.init(trace_propagation_targets=[])

    sent = "\n".join(transport.sent)
    assert len(transport.sent) == 2
    assert "the service refused Bearer" in sent and "about to use" in sent
    assert KEY not in sent and not TOKEN.search(sent)
    assert json.dumps(MASK)[1:-1] in sent or MASK in sent


def test_flowers_error_text_shows_the_mask(api, documents, offers) -> None:
    from workers.task_events import _error_text

    run = run_to_the_end(api)
    boom = run.steps.get(step_id="boom")
    text = _error_text(mock.Mock(id=boom.id))
    assert text == f"fatal: RuntimeError: the service refused key {MASK}"
    assert not re.search(TOKEN, text)


# --- what a context holds, and Django's error reports -----------------------------------------


def test_a_request_holds_its_secrets_until_it_ends_and_a_task_starts_with_none(
    api, documents, offers
) -> None:
    from celery.signals import task_prerun

    start(api)
    assert secrets.exposed() == frozenset()  # the middleware let go of them
    run_start(workflow="vault_flow", input=INPUT)  # outside a request: held
    assert KEY in secrets.exposed()
    task_prerun.send(sender=None, task_id="t", task=None, args=(), kwargs={})
    assert secrets.exposed() == frozenset()


def test_what_a_context_holds_is_bounded() -> None:
    secrets.forget()
    try:
        secrets.expose(f"value-{n:04d}" for n in range(secrets.MAX_EXPOSED + 10))
        held = secrets.exposed()
        assert len(held) == secrets.MAX_EXPOSED
        assert "value-0000" not in held and f"value-{secrets.MAX_EXPOSED + 9:04d}" in held
    finally:
        secrets.forget()


def test_djangos_error_reports_mask_the_secrets_in_hand(rf) -> None:
    from django.views.debug import get_exception_reporter_class

    # Escaped differently in HTML and in a repr; assembled, so the report's source lines
    # (this test's own code) do not hold it.
    odd = "".join(["sk-a", "&", "b<c>", "'d", '"e', "\\", "nf"])
    request = rf.get("/")
    with secrets.exposing([KEY, odd]):
        try:
            refuse(KEY + odd)
        except RuntimeError:
            reporter = get_exception_reporter_class(request)(request, *sys.exc_info())
            text, html = reporter.get_traceback_text(), reporter.get_traceback_html()
    assert "the service refused Bearer" in text and "header" in text  # the frame's variable
    for report in (text, html):
        assert KEY not in report
        assert MASK in report
    assert "sk-a&amp;b&lt;c&gt;" not in html and "sk-a&b<c>" not in text


def test_a_start_handed_to_a_worker_answers_with_the_secrets_masked(
    api, documents, offers, settings
) -> None:
    """Past its pace POST /runs answers with the run as created, not read back: masked alike."""
    settings.DJFLOW = {**settings.DJFLOW, "START_INLINE_PER_SECOND": 0}
    with mock.patch("runs.tasks.advance.apply_async"):
        run, body = start(api)
    assert (body["status"], body["steps"]) == ("pending", [])
    assert_masked(json.dumps(body, ensure_ascii=False))
    assert body["input"]["creds"]["api_key"] == MASK
    # What a read of the run answers (no worker has planned it here).
    assert body == api.get(f"/api/v1/runs/{run.id}").json()
