"""Secrets end to end on a real worker: its handlers get the values, while ``pg_dump`` of the
whole database, the worker's log, the e-mails it sent and every API answer hold none of them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest
from approvals.services import Origin, approval_decide
from runs import services
from runs.models import Run
from tests.processes import database_url, wait_for
from workflows.secrets import MASK, TOKEN

from . import flows_secrets as flows

pytestmark = [pytest.mark.slow]

KEY = "sk-live-e2e-7b1d9f3a5c8e2046"
PIN = 90_817_263
INPUT = {"ticket": "T-9", "creds": {"api_key": KEY, "user": "bob"}, "pins": [PIN]}


def status_of(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(id=run.id)


def test_a_real_worker_gets_the_secret_and_nothing_stores_or_shows_it(
    celery_worker, celery_processes, tmp_path: Path
) -> None:
    mailbox = tmp_path / "mail"
    mailbox.mkdir()
    ann = get_user_model().objects.create_user("ann", "ann@example.com", "a-long-password-1")
    celery_worker(
        workflow_modules=["tests.runs.flows_secrets"],
        env={
            "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
            "EMAIL_FILE_PATH": str(mailbox),
        },
    )
    run = services.run_start(workflow="vault_flow", input=INPUT).run
    wait_for(
        lambda: status_of(run) == "pending_approval", timeout=30, message=celery_processes.logs
    )
    request = ApprovalRequest.objects.get(run=run)
    wait_for(lambda: list(mailbox.glob("*.log")), timeout=20, message=celery_processes.logs)
    approval_decide(request_id=request.id, decision="approved", origin=Origin("api"), user=ann)

    def ended() -> Run | None:
        fresh = Run.objects.get(id=run.id)
        return fresh if fresh.status in ("completed", "failed", "cancelled", "timed_out") else None

    run = wait_for(ended, timeout=60, interval=0.2, message=celery_processes.logs)
    assert run.status == "completed", run.error

    # The worker's handlers had the values: the key, the bearer text, the pins' type.
    call = run.steps.get(step_id="call")
    assert call.output["sha"] == flows.digest(KEY) and call.output["bearer"] is True
    assert run.steps.get(step_id="again").output["prior"] == flows.digest(f"used {KEY}")
    assert run.output["child"] == flows.digest(KEY)  # the child run's handler too
    assert run.steps.get(step_id="boom").status == "failed"

    # Every table of the database, as text: no value.
    dump = subprocess.run(
        ["pg_dump", "--data-only", "--no-owner", database_url(connection.settings_dict)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "vault_flow" in dump and TOKEN.search(dump)  # the dump is of this test's rows
    assert KEY not in dump and str(PIN) not in dump

    # The worker's log (the handler logged the key), the mail it sent.
    logs = celery_processes.logs()
    assert "calling the service with key" in logs
    assert KEY not in logs and not TOKEN.search(logs)
    mail = "\n".join(path.read_text() for path in mailbox.glob("*.log"))
    assert f"Use key {MASK} for T-9?" in mail
    assert KEY not in mail and not TOKEN.search(mail)

    # The API, read by someone who may read every run (the approver alone may not).
    ann.user_permissions.add(Permission.objects.get(codename="view_run"))
    api = APIClient()
    token, _ = Token.objects.get_or_create(user=ann)
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    child = Run.objects.get(parent_run=run)
    for path in (f"/api/v1/runs/{run.id}", f"/api/v1/runs/{child.id}", "/api/v1/runs"):
        answer = api.get(path)
        assert answer.status_code == 200, path
        text = answer.content.decode()
        assert KEY not in text and str(PIN) not in text and not TOKEN.search(text)
        assert MASK in text
