"""Run-end webhooks (a document's ``notify``, contract section 13): the secret sealed at save,
the delivery rows a run's end writes, and ``workers.notify`` sending them to local HTTP
servers (real sockets), retried, signed, refused by the address guard, given up visibly.

Messages are not sent here (on_commit does not fire inside a test's transaction): each
attempt is made by calling ``notify.deliver`` as the task does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from runs import services
from runs.engine import reconcile
from runs.models import NotifyDelivery
from tests.workers.http_servers import reply, serving
from workers import notify
from workflows import access, sdk, secrets
from workflows import notify as documents
from workflows.errors import InvalidDocument
from workflows.models import WorkflowVersion
from workflows.secrets import MASK
from workflows.services import definition_save
from workflows.validation import validate_document

pytestmark = pytest.mark.django_db

SECRET = "whsec-0123456789abcdef"


def document(url: str, events: list[str], secret: str | None = SECRET, **top: Any) -> dict:
    entry: dict[str, Any] = {"url": url, "events": events}
    if secret is not None:
        entry["secret"] = secret
    return {
        "id": top.pop("id", "hooked"),
        "steps": [{"id": "nap", "kind": "sleep", "ms": 60_000}],
        "notify": [entry],
        **top,
    }


@pytest.fixture
def tunables(settings) -> dict[str, Any]:
    settings.DJFLOW = {
        **settings.DJFLOW,
        "HTTP_ALLOW": ["127.0.0.1"],
        "NOTIFY_MAX_ATTEMPTS": 4,
        "NOTIFY_BACKOFF_SECONDS": 5.0,
        "NOTIFY_TIMEOUT_SECONDS": 5.0,
    }
    return settings.DJFLOW


def cancelled_run(doc: dict) -> Any:
    definition_save(document=doc)
    run = services.run_start(workflow=doc["id"], input={"ticket": "T-1"}).run
    return services.run_cancel(run_id=run.id, reason="test")


def due_now(delivery: NotifyDelivery) -> None:
    """As if the back-off had passed (the message a retry sends arrives then)."""
    NotifyDelivery.objects.filter(id=delivery.id).update(due_at=timezone.now())


def verify(secret: str, body: bytes, header: str) -> bool:
    """What a receiver does (the snippet of docs/reference/webhooks.md)."""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header)


# --- the secret at save -----------------------------------------------------------------------


def test_the_secret_is_stored_encrypted_and_shown_masked(admin_client) -> None:
    saved = definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    version = saved.version
    assert version.document["notify"][0]["secret"] == MASK
    assert SECRET not in json.dumps(version.document) and SECRET not in version.secrets
    assert SECRET not in version.content_hash
    assert documents.decrypt(version.secrets) == {0: SECRET}
    # The API shows the stored document.
    answer = admin_client.get("/api/v1/definitions/hooked/versions/1")
    assert answer.status_code == 200
    assert answer.json()["document"]["notify"][0]["secret"] == MASK
    assert SECRET not in answer.content.decode()


def test_a_save_holds_the_secrets_so_its_logs_and_error_reports_mask_them() -> None:
    # As a run's writeOnly input is (workflows.secrets.expose): an error report of the
    # request that saved the document carries its body and locals, the secret in plain text.
    secrets.forget()
    try:
        definition_save(document=document("https://hooks.example.com/x", ["failed"]))
        assert SECRET in secrets.exposed()
    finally:
        secrets.forget()


def test_the_same_body_finds_its_version_and_another_secret_makes_a_new_one() -> None:
    first = definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    again = definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    assert (again.created, again.version.id) == (False, first.version.id)
    other = definition_save(
        document=document("https://hooks.example.com/x", ["failed"], secret="another-secret")
    )
    assert other.created and other.version.number == 2
    # A pinned version with another secret is a conflict, as any other change is.
    with pytest.raises(Exception) as conflict:
        definition_save(
            document={**document("https://hooks.example.com/x", ["failed"]), "version": 2}
        )
    assert getattr(conflict.value, "status", None) == 409


def test_a_masked_secret_keeps_the_latest_versions_secret_for_the_same_url() -> None:
    definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    # A document copied from the API (•••• in place of the secret), one event added.
    edited = document("https://hooks.example.com/x", ["failed", "completed"], secret=MASK)
    saved = definition_save(document=edited)
    assert saved.created and documents.decrypt(saved.version.secrets) == {0: SECRET}
    # The same document copied again finds that version.
    assert definition_save(document=edited).created is False
    # A URL the latest version has no secret for cannot take ••••.
    with pytest.raises(InvalidDocument) as refused:
        definition_save(document=document("https://elsewhere.example.com/", ["failed"], MASK))
    assert [e.field for e in refused.value.errors] == ["notify[0].secret"]


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"url": "ftp://example.com/", "events": ["failed"]}, "notify[0].url"),
        ({"url": "http://", "events": ["failed"]}, "notify[0].url"),
        ({"url": "https://example.com/", "events": ["finished"]}, "notify[0].events[0]"),
        ({"url": "https://example.com/", "events": []}, "notify[0].events"),
        ({"url": "https://example.com/", "events": ["failed"], "sekret": "x"}, "notify[0].sekret"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(client, admin_user, entry, field) -> None:
    client.force_login(admin_user)
    doc = {"id": "bad_hook", "steps": [{"id": "nap", "kind": "sleep", "ms": 1}], "notify": [entry]}
    answer = client.post("/api/v1/definitions", doc, content_type="application/json")
    assert answer.status_code == 400, answer.content
    assert field in [error.get("field") for error in answer.json()["errors"]], answer.json()


def test_entries_are_bounded(client, admin_user) -> None:
    client.force_login(admin_user)
    entry = {"url": "https://example.com/", "events": ["failed"]}
    doc = {"id": "many", "steps": [{"id": "nap", "kind": "sleep", "ms": 1}]}
    doc["notify"] = [entry] * (documents.MAX_ENTRIES + 1)
    answer = client.post("/api/v1/definitions", doc, content_type="application/json")
    assert answer.status_code == 400
    assert "notify" in [error.get("field") for error in answer.json()["errors"]]


# --- the rows a run's end writes, and sending them --------------------------------------------


def test_an_end_the_entry_does_not_list_writes_nothing(tunables) -> None:
    run = cancelled_run(document("http://127.0.0.1:9/", ["completed", "failed"]))
    assert not NotifyDelivery.objects.filter(run=run).exists()


def test_a_webhook_is_retried_until_the_receiver_answers_and_is_signed(tunables) -> None:
    answers = iter([503, 500, 200])

    def flaky(h) -> None:
        reply(h, next(answers), "ok")

    with serving({"/hook": flaky}) as server:
        run = cancelled_run(document(server.url("/hook?token=abc"), ["cancelled"]))
        [delivery] = NotifyDelivery.objects.filter(run=run)
        assert (delivery.event, delivery.status, delivery.attempts) == ("cancelled", "pending", 0)

        assert notify.deliver(delivery.id) == "retrying"
        delivery.refresh_from_db()
        assert (delivery.attempts, delivery.response_status) == (1, 503)
        assert delivery.last_error == f"POST {server.url('/hook')} answered 503"  # no query
        # The back-off (5 s) has not passed: a second message sends nothing.
        assert notify.deliver(delivery.id) == "skipped"
        assert delivery.due_at > timezone.now() + timedelta(seconds=4)

        due_now(delivery)
        assert notify.deliver(delivery.id) == "retrying"
        delivery.refresh_from_db()
        # Doubled after the second failure.
        assert delivery.due_at > timezone.now() + timedelta(seconds=9)
        due_now(delivery)
        assert notify.deliver(delivery.id) == "delivered"
        # Delivered: nothing more is sent, whatever arrives.
        due_now(delivery)
        assert notify.deliver(delivery.id) == "skipped"

    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("delivered", 3, 200)
    assert len(server.seen) == 3
    bodies = {seen.body for seen in server.seen}
    assert len(bodies) == 1, "every retry sends the same bytes"
    seen = server.seen[-1]
    assert seen.method == "POST" and seen.path == "/hook?token=abc"
    assert verify(SECRET, seen.body, seen.headers["X-Djflow-Signature"])
    assert not verify("wrong", seen.body, seen.headers["X-Djflow-Signature"])
    assert seen.headers["X-Djflow-Event"] == "cancelled"
    assert seen.headers["X-Djflow-Delivery"] == str(delivery.id)
    sent = json.loads(seen.body)
    assert (sent["id"], sent["status"], sent["workflow"]) == (str(run.id), "cancelled", "hooked")
    assert sent["error"]["class"] == "cancelled" and isinstance(sent["steps"], list)


def test_a_delivery_holds_its_secret_so_error_reports_of_the_task_mask_it(tunables) -> None:
    # Sentry's events and Django's reports carry the frames' locals (the secret, read to
    # sign the body); they mask only what the context holds (workflows.secrets.expose).
    with serving({"/hook": lambda h: reply(h, 204)}) as server:
        run = cancelled_run(document(server.url("/hook"), ["cancelled"]))
        [delivery] = NotifyDelivery.objects.filter(run=run)
        secrets.forget()
        try:
            assert notify.deliver(delivery.id) == "delivered"
            assert SECRET in secrets.exposed()
        finally:
            secrets.forget()


def test_secrets_of_the_run_are_masked_in_the_body(tunables) -> None:
    schema = {
        "type": "object",
        "properties": {"key": {"type": "string", "writeOnly": True}},
    }
    with serving({"/hook": lambda h: reply(h, 204)}) as server:
        doc = document(server.url("/hook"), ["cancelled"], secret=None, input_schema=schema)
        definition_save(document=doc)
        run = services.run_start(workflow="hooked", input={"key": "sk-live-123456"}).run
        services.run_cancel(run_id=run.id)
        [delivery] = NotifyDelivery.objects.filter(run=run)
        assert notify.deliver(delivery.id) == "delivered"
    [seen] = server.seen
    assert "sk-live-123456" not in seen.body.decode()
    assert json.loads(seen.body)["input"] == {"key": MASK}
    # No secret in the entry: no signature.
    assert "X-Djflow-Signature" not in seen.headers


def test_a_forbidden_address_fails_the_delivery_at_once_and_visibly(tunables, settings) -> None:
    settings.DJFLOW = {**tunables, "HTTP_ALLOW": []}
    with serving({"/hook": lambda h: reply(h, 200)}) as server:
        run = cancelled_run(document(server.url("/hook"), ["cancelled"]))
        [delivery] = NotifyDelivery.objects.filter(run=run)
        assert notify.deliver(delivery.id) == "failed"
    assert server.seen == []
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("failed", 1)
    assert delivery.last_error == (
        f"POST {server.url('/hook')} refused: 127.0.0.1 is a loopback address; "
        "DJFLOW_HTTP_ALLOW does not list it"
    )


def test_a_redirect_is_not_followed_but_a_failed_attempt(tunables) -> None:
    # A receiver could otherwise send the signed run to an address the guard would refuse
    # (here only the allowed loopback, so the redirect target would have been reachable).
    with serving(
        {
            "/hook": lambda h: reply(h, 307, headers={"Location": "/inside"}),
            "/inside": lambda h: reply(h, 200),
        }
    ) as server:
        run = cancelled_run(document(server.url("/hook"), ["cancelled"]))
        [delivery] = NotifyDelivery.objects.filter(run=run)
        assert notify.deliver(delivery.id) == "retrying"
    assert [seen.path for seen in server.seen] == ["/hook"]
    delivery.refresh_from_db()
    assert (delivery.response_status, delivery.last_error) == (
        307,
        f"POST {server.url('/hook')} answered 307",
    )


def test_attempts_are_bounded_then_the_delivery_fails(tunables, settings) -> None:
    settings.DJFLOW = {**tunables, "NOTIFY_MAX_ATTEMPTS": 2}
    with serving({"/hook": lambda h: reply(h, 500)}) as server:
        run = cancelled_run(document(server.url("/hook"), ["cancelled"]))
        [delivery] = NotifyDelivery.objects.filter(run=run)
        assert notify.deliver(delivery.id) == "retrying"
        due_now(delivery)
        assert notify.deliver(delivery.id) == "failed"
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("failed", 2, 500)
    assert len(server.seen) == 2


def test_an_unreachable_receiver_is_a_failed_attempt(tunables) -> None:
    with serving({}) as server:
        url = server.url("/hook")
    # The server is gone: nothing listens on its port.
    run = cancelled_run(document(url, ["cancelled"]))
    [delivery] = NotifyDelivery.objects.filter(run=run)
    assert notify.deliver(delivery.id) == "retrying"
    delivery.refresh_from_db()
    assert delivery.last_error.startswith(f"POST {url} failed: ")


def test_the_reconciler_offers_again_a_delivery_whose_message_was_lost(tunables) -> None:
    run = cancelled_run(document("http://127.0.0.1:9/", ["cancelled"]))
    [delivery] = NotifyDelivery.objects.filter(run=run)
    now = timezone.now()
    # Just written: its message may still be on its way.
    assert notify.reoffer_lost(now, 100) == 0
    later = now + timedelta(seconds=tunables["LOST_MESSAGE_SECONDS"] + 1)
    assert notify.reoffer_lost(later, 100) == 1
    delivery.refresh_from_db()
    assert delivery.due_at == later
    # Offered: not again until it is lost again.
    assert notify.reoffer_lost(later, 100) == 0


def test_the_reconciler_tick_runs_the_reoffer(tunables) -> None:
    run = cancelled_run(document("http://127.0.0.1:9/", ["cancelled"]))
    lost = timezone.now() - timedelta(seconds=tunables["LOST_MESSAGE_SECONDS"] + 1)
    NotifyDelivery.objects.filter(run=run).update(due_at=lost)
    assert reconcile.reconcile()["notify_reoffered"] == 1
    assert NotifyDelivery.objects.get(run=run).due_at > lost


def test_the_admin_lists_deliveries_to_readers_of_the_run_only(
    admin_client, client, django_user_model, tunables
) -> None:
    run = cancelled_run(document("http://127.0.0.1:9/x?token=abc", ["cancelled"]))
    delivery = NotifyDelivery.objects.get(run=run)
    NotifyDelivery.objects.filter(id=delivery.id).update(status="failed", last_error="gone")
    page = admin_client.get(f"/admin/runs/notifydelivery/{delivery.id}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "gone" in text and "http://127.0.0.1:9/x" in text and "token=abc" not in text
    assert SECRET not in text
    staff = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(staff)
    assert client.get(f"/admin/runs/notifydelivery/{delivery.id}/change/").status_code in (
        302,
        403,
        404,
    )


def test_version_secrets_are_not_editable_in_the_admin(admin_client) -> None:
    saved = definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    page = admin_client.get(f"/admin/workflows/workflowversion/{saved.version.id}/change/")
    assert page.status_code == 200
    assert SECRET not in page.content.decode()
    assert saved.version.secrets not in page.content.decode()
    assert WorkflowVersion.objects.get(id=saved.version.id).secrets == saved.version.secrets


def test_the_readmes_receiver_snippet_works_pasted_and_verifies_what_is_sent() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "webhooks.md"
    [snippet] = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    scope: dict[str, Any] = {}
    exec(compile(snippet, str(page), "exec"), scope)  # its own asserts run here
    body = b'{"id":"r","status":"failed"}'
    assert scope["verified"](SECRET, body, documents.signature(SECRET, body))
    assert not scope["verified"](SECRET, body + b" ", documents.signature(SECRET, body))


def test_only_an_author_may_keep_a_secret_with_the_mask(client, django_user_model) -> None:
    definition_save(document=document("https://hooks.example.com/x", ["failed"]))
    outsider = django_user_model.objects.create_user("outsider")
    client.force_login(outsider)
    answers = [
        client.post(
            "/api/v1/definitions",
            document(url, ["failed"], secret=MASK),
            content_type="application/json",
        )
        for url in ("https://hooks.example.com/x", "https://other.example.com/")
    ]
    # The same answer whether the URL is listed or not: a non-author learns nothing of it.
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json() == answers[1].json()
    author = django_user_model.objects.create_user("author")
    access.grant(access.AUTHOR, "hooked", user=author)
    client.force_login(author)
    kept = client.post(
        "/api/v1/definitions",
        document("https://hooks.example.com/x", ["failed", "cancelled"], secret=MASK),
        content_type="application/json",
    )
    assert kept.status_code == 201, kept.content
    version = WorkflowVersion.objects.get(workflow_id="hooked", number=kept.json()["version"])
    assert documents.decrypt(version.secrets) == {0: SECRET}


def test_a_save_after_a_key_rotation_finds_the_version_saved_before(settings) -> None:
    old, new = "o" * 40, "n" * 40
    settings.DJFLOW_FIELD_KEY = [old]
    first = definition_save(
        document={**document("https://h.example.com/", ["failed"]), "version": 1}
    )
    settings.DJFLOW_FIELD_KEY = [new, old]
    again = definition_save(
        document={**document("https://h.example.com/", ["failed"]), "version": 1}
    )
    assert (again.created, again.version.id) == (False, first.version.id)
    # Still readable, and a new version is sealed with the new key.
    assert documents.decrypt(first.version.secrets) == {0: SECRET}
    settings.DJFLOW_FIELD_KEY = [new]
    with pytest.raises(documents.SecretsUnreadable):
        documents.decrypt(first.version.secrets)


def test_a_run_too_large_for_the_body_is_sent_without_its_journal(tunables, settings) -> None:
    run = cancelled_run(document("http://127.0.0.1:9/", ["cancelled"]))
    whole = json.loads(notify.render_body(run.id))
    assert isinstance(whole["steps"], list) and "steps_omitted" not in whole
    settings.DJFLOW = {**tunables, "NOTIFY_MAX_BODY_BYTES": len(json.dumps(whole)) // 2}
    cut = json.loads(notify.render_body(run.id))
    assert (cut["steps"], cut["steps_omitted"], cut["id"]) == (None, True, str(run.id))


def test_all_settled_is_checked_at_save() -> None:
    fan = {
        "id": "fan",
        "kind": "parallel",
        "mode": "all_settled",
        "branches": {"a": {"id": "one", "kind": "task"}},
    }
    good = {"id": "after", "kind": "task", "input": "${steps.fan.output.a.status}"}
    assert validate_document({"id": "wf", "steps": [fan, good]}) == []
    bad = {**good, "input": "${steps.fan.output.a.colour}"}
    [error] = validate_document({"id": "wf", "steps": [fan, bad]})
    assert error.field == "steps[1].input" and "(it has: status, output, error)" in error.message
    [error] = validate_document({"id": "wf", "steps": [{**fan, "mode": "eventually"}]})
    assert error.field == "steps[0].mode"


def test_the_builder_writes_mode_and_notify() -> None:
    flow = sdk.workflow(
        "built_hooks", notify=[{"url": "https://h.example.com/", "events": ["failed"]}]
    )
    flow.parallel("fan", mode="all_settled", branches={"a": sdk.task("one")})
    doc = flow.document()
    assert doc["notify"] == [{"url": "https://h.example.com/", "events": ["failed"]}]
    assert doc["steps"][0]["mode"] == "all_settled"
    assert "mode" not in sdk.parallel("p", branches={"a": sdk.task("two")})


def test_an_unexpected_error_is_a_failed_attempt_and_attempts_stay_bounded(
    tunables, settings, monkeypatch
) -> None:
    settings.DJFLOW = {**tunables, "NOTIFY_MAX_ATTEMPTS": 2}
    run = cancelled_run(document("http://127.0.0.1:9/", ["cancelled"]))
    [delivery] = NotifyDelivery.objects.filter(run=run)

    def broken(row: Any) -> str:
        raise KeyError("surprise")

    monkeypatch.setattr(notify, "_render", broken)
    assert notify.deliver(delivery.id) == "retrying"
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_error) == (1, "the attempt raised KeyError")
    # A worker lost during the second attempt: claimed, never recorded, offered again.
    NotifyDelivery.objects.filter(id=delivery.id).update(attempts=2, due_at=timezone.now())
    assert notify.deliver(delivery.id) == "failed"
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("failed", 2)
