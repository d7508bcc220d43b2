"""What an approval step may ask for (contract sections 8 and 9): e-mail approvers outside
``DJFLOW_APPROVER_EMAIL_DOMAINS`` only for who holds ``approvals.mail_external``, at most 50
people per request, reminders no more often than ``DJFLOW_MIN_REMIND_MS``. Checked where a
version is saved (the service, the API, the admin, the builder), and when the request opens
for what only then resolves (groups) or was stored before the bound."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest, Approver, Mail
from runs.models import StepRun
from runs.services import run_start
from workflows import registry, sdk
from workflows.errors import InvalidDocument
from workflows.models import WorkflowVersion
from workflows.services import definition_save

from .builders import make_group, make_user

pytestmark = pytest.mark.django_db

HOUR = 3_600_000


def document(workflow: str = "pay", **step: Any) -> dict[str, Any]:
    step.setdefault("approvers", {"emails": ["ann@corp.example"]})
    return {
        "id": workflow,
        "limits": {"run_timeout_ms": 24 * HOUR},
        "steps": [{"id": "gate", "kind": "approval", "message": "Pay?", **step}],
    }


def refused(document: dict[str, Any], user: Any) -> dict[str, str]:
    """The errors saving ``document`` as ``user`` gets, by field."""
    with pytest.raises(InvalidDocument) as caught:
        definition_save(document=document, user=user)
    assert not WorkflowVersion.objects.filter(workflow_id=document["id"]).exists()
    return {e.field: e.message for e in caught.value.errors}


@pytest.fixture
def domains(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "APPROVER_EMAIL_DOMAINS": ["corp.example"]}


@pytest.fixture
def author(db) -> Any:
    """A user who may save any workflow (the global author permissions), and nothing more:
    what these tests vary is the right to mail outside the domains."""
    user = make_user("author")
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_workflow", "change_workflow"])
    )
    return type(user).objects.get(pk=user.pk)


# --- e-mail approvers outside the domains -------------------------------------------------


def test_with_no_domains_set_no_address_may_be_named_without_the_permission(author) -> None:
    errors = refused(document(approvers={"emails": ["ann@corp.example"]}), author)
    assert errors == {
        "steps[0].approvers.emails[0]": "'ann@corp.example' is outside the approver e-mail "
        "domains (DJFLOW_APPROVER_EMAIL_DOMAINS: none); naming it needs the permission "
        "approvals.mail_external"
    }


def test_addresses_in_the_domains_are_anyones_and_the_others_are_named(author, domains) -> None:
    fine = ["ann@corp.example", "Bob@CORP.example"]
    outside = ["eve@evil.example", "sub@mail.corp.example", "tricky@corp.example.evil.example"]
    errors = refused(document(approvers={"emails": [*fine, *outside]}), author)
    assert sorted(errors) == [f"steps[0].approvers.emails[{i}]" for i in (2, 3, 4)]
    assert "corp.example" in errors["steps[0].approvers.emails[2]"]
    assert definition_save(document=document(approvers={"emails": fine}), user=author).created


def test_nested_approval_steps_are_checked_too(author, domains) -> None:
    nested = {
        "id": "each",
        "kind": "foreach",
        "items": [1, 2],
        "do": {"id": "gate", "kind": "approval", "approvers": {"emails": ["x@evil.example"]}},
    }
    doc = {"id": "nested", "limits": {"run_timeout_ms": HOUR}, "steps": [nested]}
    assert list(refused(doc, author)) == ["steps[0].do.approvers.emails[0]"]


def test_the_permission_or_a_superuser_may_name_any_address(author, admin_user) -> None:
    author.user_permissions.add(Permission.objects.get(codename="mail_external"))
    author = type(author).objects.get(pk=author.pk)  # a fresh permission cache
    outside = document(approvers={"emails": ["eve@elsewhere.example"]})
    assert definition_save(document=outside, user=author).created
    other = document("pay2", approvers={"emails": ["eve@elsewhere.example"]})
    assert definition_save(document=other, user=admin_user).created


def test_an_inactive_user_or_anonymous_has_no_permission(author) -> None:
    from django.contrib.auth.models import AnonymousUser

    author.user_permissions.add(Permission.objects.get(codename="mail_external"))
    author.is_active = False
    author.save()
    author = type(author).objects.get(pk=author.pk)
    assert list(refused(document(), author)) == ["steps[0].approvers.emails[0]"]
    assert list(refused(document(), AnonymousUser())) == ["steps[0].approvers.emails[0]"]


def test_the_deployments_own_sync_is_not_held_to_the_domains() -> None:
    """The builders of WORKFLOW_MODULES are saved with no user (worker start-up,
    ``manage.py sync_workflows``): the operator's code and environment."""
    assert definition_save(document=document()).created


def test_the_api_answers_400_naming_the_field(author) -> None:
    api = APIClient()
    api.force_authenticate(author)
    answer = api.post("/api/v1/definitions", document(), format="json")
    assert answer.status_code == 400
    (error,) = answer.json()["errors"]
    assert error["field"] == "steps[0].approvers.emails[0]"
    assert "approvals.mail_external" in error["message"]
    assert not WorkflowVersion.objects.exists()


def test_the_admins_new_version_page_names_the_field(admin_user) -> None:
    definition_save(document=document(approvers={"users": ["author"]}), user=admin_user)
    staff = make_user("staff", is_staff=True)
    staff.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_workflow", "change_workflow"])
    )
    client = Client()
    client.force_login(staff)
    page = client.post(
        "/admin/workflows/workflow/pay/new-version/",
        {"document": json.dumps(document())},
    )
    assert page.status_code == 200
    html = page.content.decode()
    assert '<code class="djflow-field">steps[0].approvers.emails[0]</code>' in html
    assert "approvals.mail_external" in html
    assert WorkflowVersion.objects.filter(workflow_id="pay").count() == 1
    # A superuser saves the same document.
    root = Client()
    root.force_login(admin_user)
    root.post("/admin/workflows/workflow/pay/new-version/", {"document": json.dumps(document())})
    assert WorkflowVersion.objects.filter(workflow_id="pay").count() == 2


@pytest.fixture
def own_registry() -> Any:
    """Only the builders this test makes are synced (and the others come back after)."""
    state = registry.snapshot()
    registry.clear()
    yield
    registry.restore(state)


def test_the_builder_saving_as_a_user_is_held_to_the_domains(author, own_registry) -> None:
    flow = sdk.workflow("built", limits={"run_timeout_ms": HOUR})
    flow.approval("gate", approvers={"emails": ["eve@elsewhere.example"]}, email_details=True)
    with pytest.raises(InvalidDocument) as caught:
        flow.save(user=author)
    assert [e.field for e in caught.value.errors] == ["steps[0].approvers.emails[0]"]
    with pytest.raises(sdk.SyncError) as failed:
        sdk.sync_modules([], user=author)
    assert "steps[0].approvers.emails[0]" in str(failed.value)
    # Synced by the deployment (no user), it saves.
    ((workflow_id, saved),) = sdk.sync_modules([])
    assert (workflow_id, saved.created) == ("built", True)
    assert saved.version.document["steps"][0]["email_details"] is True


def test_a_stored_version_whose_author_may_not_mail_outside_fails_the_step(
    author, settings
) -> None:
    """Versions are immutable and may predate the rule (or the author lost the permission
    since): the request does not open, and the step names the address."""
    settings.DJFLOW = {**settings.DJFLOW, "APPROVER_EMAIL_DOMAINS": ["corp.example"]}
    grant = Permission.objects.get(codename="mail_external")
    author.user_permissions.add(grant)
    author = type(author).objects.get(pk=author.pk)
    emails = ["in@corp.example", "eve@elsewhere.example"]
    definition_save(document=document(approvers={"emails": emails}), user=author)
    author.user_permissions.remove(grant)
    run = run_start(workflow="pay", input={}).run
    gate = StepRun.objects.get(run=run, step_id="gate")
    assert gate.status == "failed"
    assert gate.error == {
        "class": "invalid_input",
        "message": "approvers.emails[1]: 'eve@elsewhere.example' is outside the approver "
        "e-mail domains, and the author of version 1 (author) does not hold the permission "
        "approvals.mail_external",
    }
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()


def test_a_stored_version_mails_inside_the_domains_whoever_wrote_it(author, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "APPROVER_EMAIL_DOMAINS": ["corp.example"]}
    definition_save(document=document(approvers={"emails": ["in@corp.example"]}), user=author)
    run = run_start(workflow="pay", input={}).run
    assert ApprovalRequest.objects.get(run=run).people.get().email == "in@corp.example"
    # And the deployment's own versions mail anywhere.
    definition_save(document=document("ops", approvers={"emails": ["x@elsewhere.example"]}))
    run = run_start(workflow="ops", input={}).run
    assert Mail.objects.filter(to="x@elsewhere.example").exists()


# --- at most 50 people ------------------------------------------------------------------------


def addresses(count: int) -> list[str]:
    return [f"p{n}@corp.example" for n in range(count)]


def test_fifty_listed_approvers_save_and_fifty_one_are_refused(author, domains) -> None:
    assert definition_save(document=document(approvers={"emails": addresses(50)}), user=author)
    many = document("many", approvers={"emails": addresses(50), "users": ["author"]})
    assert refused(many, author) == {
        "steps[0].approvers": "names 51 approvers; a request asks at most 50"
    }


def test_a_person_named_twice_counts_once(author, domains) -> None:
    twice = [*addresses(50), "P0@corp.example"]
    assert definition_save(document=document(approvers={"emails": twice}), user=author).created


def test_groups_that_resolve_to_more_than_fifty_fail_the_step_as_invalid_input() -> None:
    make_group("everyone", *[make_user(f"u{n}") for n in range(40)])
    make_group("more", *[make_user(f"v{n}") for n in range(11)])
    definition_save(document=document(approvers={"groups": ["everyone", "more"]}))
    run = run_start(workflow="pay", input={}).run
    run.refresh_from_db()
    gate = StepRun.objects.get(run=run, step_id="gate")
    assert gate.status == "failed"
    assert gate.error == {
        "class": "invalid_input",
        "message": "approvers: resolve to 51 people; a request asks at most 50",
    }
    assert run.status == "failed"
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()


def test_groups_that_resolve_to_fifty_open_the_request() -> None:
    make_group("everyone", *[make_user(f"u{n}") for n in range(50)])
    definition_save(document=document(approvers={"groups": ["everyone"]}))
    run = run_start(workflow="pay", input={}).run
    assert Approver.objects.filter(request__run=run).count() == 50
    assert Mail.objects.count() == 50


# --- reminders --------------------------------------------------------------------------------


def test_reminders_more_often_than_the_floor_are_refused_at_save(author) -> None:
    fast = document(approvers={"users": ["author"]}, remind_after_ms=1, timeout_ms=HOUR)
    assert refused(fast, author) == {
        "steps[0].remind_after_ms": "is 1 ms; reminders come at most every 600000 ms "
        "(DJFLOW_MIN_REMIND_MS): raise it, or leave it out for no reminders"
    }
    # The deployment's own sync too: the floor bounds the work, whoever saves.
    assert "steps[0].remind_after_ms" in refused(fast, None)
    at_floor = document(approvers={"users": ["author"]}, remind_after_ms=600_000)
    assert definition_save(document=at_floor, user=author).created


def test_the_floor_is_a_setting(author, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "MIN_REMIND_MS": 60_000}
    doc = document(approvers={"users": ["author"]}, remind_after_ms=60_000)
    assert definition_save(document=doc, user=author).created
    assert "steps[0].remind_after_ms" in refused(
        document("faster", approvers={"users": ["author"]}, remind_after_ms=59_999), author
    )


def test_a_version_stored_under_a_lower_floor_is_held_to_the_current_one(author, settings) -> None:
    """A stored version is immutable: its remind_after_ms of one second stays in the
    document, and the request that opens now reminds no more often than the floor."""
    settings.DJFLOW = {**settings.DJFLOW, "MIN_REMIND_MS": 1_000}
    doc = document(approvers={"users": ["author"]}, remind_after_ms=1_000, timeout_ms=HOUR)
    definition_save(document=doc, user=author)
    settings.DJFLOW = {**settings.DJFLOW, "MIN_REMIND_MS": 600_000}
    run = run_start(workflow="pay", input={}).run
    request = ApprovalRequest.objects.get(run=run)
    assert request.remind_after_ms == 600_000
    from runs.models import Timer

    (timer,) = Timer.objects.filter(run=run, purpose="approval_reminder")
    assert (timer.fire_at - request.created_at).total_seconds() == 600
