"""A security review of the permission model (CONTRACT section 8): each hole found as a
regression test. Holes fixed in the same change are plain tests; those left open are
``xfail(strict=True)`` with the hole named, so fixing one turns its test red until the marker
goes. The last tests pin attacks that were tried and found refused.

Users here hold no global permission unless a test gives one; ``creator`` holds only
``workflows.add_workflow`` (may save version 1 of a new id, so becomes its author).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from tests.test_access import BILLING, admin_client, api_for, person, start, user_with
from workflows import access
from workflows.models import WorkerHeartbeat, WorkflowVersion
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

# Another team's workflow: its input_schema bounds what its handlers may be given.
PAYROLL = {
    "id": "payroll",
    "input_schema": {
        "type": "object",
        "required": ["amount"],
        "properties": {"amount": {"type": "integer", "maximum": 10}},
    },
    "steps": [
        {"id": "gate", "kind": "wait_event", "event": "paid", "key": "k"},
        {"id": "pay", "kind": "task"},
    ],
}


@pytest.fixture
def billing() -> WorkflowVersion:
    return definition_save(document=BILLING).version


@pytest.fixture
def payroll() -> WorkflowVersion:
    return definition_save(document=PAYROLL).version


def fresh(user: Any) -> Any:
    """The user again, without the permission caches of the object in hand."""
    return get_user_model().objects.get(pk=user.pk)


def give(user: Any, codename: str) -> Any:
    user.user_permissions.add(Permission.objects.get(codename=codename))
    return fresh(user)


def creator(name: str, *, staff: bool = False) -> Any:
    return give(person(name, staff=staff), "add_workflow")


def calls_payroll(workflow: str = "mine", **step: Any) -> dict[str, Any]:
    child = {"id": "call", "kind": "subworkflow", "workflow": "payroll", **step}
    return {"id": workflow, "steps": [child]}


# --- 1. a subworkflow step runs any workflow (fixed) ----------------------------------------


def test_a_subworkflow_step_may_name_only_a_workflow_its_author_may_start(
    payroll: WorkflowVersion,
) -> None:
    """Hole: anyone with add_workflow saved ``{"kind": "subworkflow", "workflow": "payroll"}``
    in a workflow of their own, started it, and so ran payroll (its handlers, with their
    input) without any role on it; the child's output came back as their step's output."""
    mallory = creator("mallory")
    client = api_for(mallory)
    refused = client.post("/api/v1/definitions", calls_payroll(), format="json")
    assert refused.status_code == 400
    # The same answer as for a workflow that does not exist: the id does not leak.
    missing = client.post("/api/v1/definitions", calls_payroll("mine2"), format="json")
    assert missing.status_code == 400
    assert refused.json()["errors"] == [
        {"field": "steps[0].workflow", "message": "unknown workflow 'payroll'"}
    ]
    # Not even through a pinned version number, which exists or not.
    for number in (1, 7):
        pinned = client.post("/api/v1/definitions", calls_payroll(version=number), format="json")
        assert pinned.json()["errors"] == refused.json()["errors"]
    assert not Run.objects.filter(workflow_id="payroll").exists()

    # A viewer of payroll sees it, and is told they may not start it.
    access.grant("viewer", "payroll", user=mallory)
    seen = api_for(fresh(mallory)).post("/api/v1/definitions", calls_payroll(), format="json")
    assert seen.status_code == 400
    assert seen.json()["errors"][0]["field"] == "steps[0].workflow"
    assert "may not start runs of workflow 'payroll'" in seen.json()["errors"][0]["message"]

    # A starter of payroll may: the step starts what they could start themselves.
    access.grant("starter", "payroll", user=mallory)
    ok = api_for(fresh(mallory)).post("/api/v1/definitions", calls_payroll(), format="json")
    assert ok.status_code == 201, ok.content
    # Recursion into the workflow being saved needs no other role.
    own = {"id": "loops", "steps": [{"id": "again", "kind": "subworkflow", "workflow": "loops"}]}
    assert client.post("/api/v1/definitions", own, format="json").status_code == 201


def test_code_that_saves_with_no_user_may_still_call_any_workflow(
    payroll: WorkflowVersion,
) -> None:
    # The builder's sync is trusted (CONTRACT section 8).
    assert definition_save(document=calls_payroll()).created


# --- 2. a child run's input skipped its own input_schema (fixed) ------------------------------


def test_a_child_run_never_gets_an_input_its_input_schema_refuses(
    payroll: WorkflowVersion,
) -> None:
    # Even an author who may start payroll: a start of their own would be a 400 naming input.
    alice = creator("alice")
    access.grant("starter", "payroll", user=alice)
    alice = fresh(alice)
    refused = api_for(alice).post(
        "/api/v1/runs", {"workflow": "payroll", "input": {"amount": 10**6}}, format="json"
    )
    assert refused.status_code == 400
    document = calls_payroll(input={"amount": 10**6})
    assert api_for(alice).post("/api/v1/definitions", document, format="json").status_code == 201
    run = services.run_start(workflow="mine", user=alice).run
    # The child is refused, like the start it stands for: no payroll step is ever planned
    # with that input, and the parent's step fails naming why.
    assert not StepRun.objects.filter(run__workflow_id="payroll").exists()
    call = StepRun.objects.get(run=run, step_id="call")
    assert call.status == "failed"
    assert call.error["class"] == "invalid_input"
    assert "input.amount" in call.error["message"]
    run_advance(run_id=run.id)  # what the advance message sent on commit does
    run.refresh_from_db()
    assert (run.status, run.error["class"], run.error["step"]) == (
        "failed",
        "invalid_input",
        "call",
    )
    # An input the schema accepts starts the child as before.
    fine = calls_payroll("fine", input={"amount": 5})
    assert api_for(alice).post("/api/v1/definitions", fine, format="json").status_code == 201
    parent = services.run_start(workflow="fine", user=alice).run
    assert Run.objects.get(parent_run=parent).input == {"amount": 5}


# --- 3. a handler name without a dot (fixed) ---------------------------------------------------


def test_a_handler_name_without_a_workflow_part_is_no_persons_to_claim() -> None:
    """Hole: ``send_email`` (a name ``@handler("send_email")`` registers) was read as
    belonging to workflow ``send_email``; anyone with add_workflow created that id, became
    its author, and ran the handler with any input."""
    mallory = creator("mallory")
    document = {"id": "send_email", "steps": [{"id": "x", "kind": "task", "handler": "send_email"}]}
    response = api_for(mallory).post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "steps[0].handler"
    assert "belongs to no workflow" in response.json()["errors"][0]["message"]
    # An author of every workflow, and trusted code, may name it.
    boss = give(person("boss"), "change_workflow")
    assert api_for(boss).post("/api/v1/definitions", document, format="json").status_code == 201
    assert definition_save(document={**document, "id": "mailer"}).created


# --- 4. squatting a namespace the deployment's workers serve (open) -------------------------


@pytest.mark.parametrize(
    "stopped_ago",
    [None, 20],  # live; stopped 20 s ago (restarting), within UNSERVABLE_SECONDS (60 s)
)
def test_a_new_workflow_id_cannot_claim_handlers_a_worker_serves(
    settings, stopped_ago: int | None
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "UNSERVABLE_SECONDS": 60.0}
    now = timezone.now()
    seen = now if stopped_ago is None else now - timedelta(seconds=stopped_ago)
    WorkerHeartbeat.objects.create(
        hostname="celery@w1",
        handlers=["shared.send_email"],
        queues=["default"],
        started_at=now - timedelta(minutes=5),
        last_seen=seen,
        stopped_at=None if stopped_ago is None else seen,
    )
    mallory = creator("mallory")
    document = {
        "id": "shared",
        "steps": [{"id": "x", "kind": "task", "handler": "shared.send_email"}],
    }
    response = api_for(mallory).post("/api/v1/definitions", document, format="json")
    assert response.status_code == 403
    assert "belongs to the deployment" in response.json()["errors"][0]["message"]
    # Another id, whose name no served handler starts with, is anyone's with add_workflow.
    other = {"id": "sharedx", "steps": [{"id": "x", "kind": "task"}]}
    assert api_for(mallory).post("/api/v1/definitions", other, format="json").status_code == 201


# --- 5. the admin's workflow filter lists every workflow (fixed) ----------------------------


def test_the_admin_run_filter_lists_only_workflows_the_user_sees(billing: WorkflowVersion) -> None:
    """Hole: the run list's "By workflow" filter listed every workflow id in the database."""
    for workflow in ("audit", "secret_project"):
        definition_save(document={"id": workflow, "steps": [{"id": "a", "kind": "task"}]})
        services.run_start(workflow=workflow)
    start()
    viewer = user_with("viewer", staff=True)
    access.grant("viewer", "audit", user=viewer)
    page = admin_client(fresh(viewer)).get(reverse("admin:runs_run_changelist")).content.decode()
    # The filter is shown (two choices), with the user's workflows only.
    assert "workflow__id__exact=billing" in page and "workflow__id__exact=audit" in page
    assert "secret_project" not in page


# --- 6. a run showed children of workflows the caller may not see (fixed) -------------------


def test_a_run_lists_only_the_children_the_caller_may_read(payroll: WorkflowVersion) -> None:
    definition_save(document=calls_payroll("parent", input={"amount": 1}))
    olga = person("olga", staff=True)
    access.grant("operator", "parent", user=olga)
    run = services.run_start(workflow="parent").run
    child = Run.objects.get(parent_run=run)
    assert api_for(olga).get(f"/api/v1/runs/{child.id}").status_code == 404
    shown = api_for(olga).get(f"/api/v1/runs/{run.id}").json()["children"]
    page = admin_client(olga).get(reverse("admin:runs_run_change", args=[run.id]))
    assert shown == []
    assert str(child.id) not in page.content.decode()
    # A reader of both sees the child, in the API and the admin.
    access.grant("viewer", "payroll", user=olga)
    olga = fresh(olga)
    shown = api_for(olga).get(f"/api/v1/runs/{run.id}").json()["children"]
    assert [row["id"] for row in shown] == [str(child.id)]
    page = admin_client(olga).get(reverse("admin:runs_run_change", args=[run.id]))
    assert str(child.id) in page.content.decode()


# --- 7. admins outside the role model (fixed) ----------------------------------------------


@pytest.mark.parametrize(
    ("codename", "url"),
    [
        # Fixed: the versions admin answered to the model permission only.
        ("view_workflowversion", "admin:workflows_workflowversion_changelist"),
        ("view_event", "admin:runs_event_changelist"),
    ],
)
def test_admins_of_related_rows_show_only_visible_workflows(
    billing: WorkflowVersion, payroll: WorkflowVersion, codename: str, url: str
) -> None:
    services.event_send(name="paid", key="payroll-secret-key")  # trusted: resumes payroll
    viewer = give(user_with("viewer", staff=True), codename)
    page = admin_client(viewer).get(reverse(url))
    assert page.status_code == 200
    text = page.content.decode()
    assert "payroll" not in text


@pytest.mark.parametrize(
    ("codename", "url"),
    [
        ("view_approvalrequest", "admin:approvals_approvalrequest_changelist"),
        ("view_decision", "admin:approvals_decision_changelist"),
        ("view_notification", "admin:approvals_notification_changelist"),
    ],
)
def test_the_approvals_admins_show_only_visible_workflows(
    billing: WorkflowVersion, codename: str, url: str
) -> None:
    from approvals.services import Origin, approval_decide
    from tests.approvals.builders import make_group, make_user, start_approval

    payer = make_user("payer")
    make_group("finance", payer)
    _, request = start_approval("payroll_approval", users=["payer"], then_handoff="finance")
    approval_decide(request_id=request.id, decision="approved", origin=Origin("api"), user=payer)
    viewer = give(user_with("viewer", staff=True), codename)
    page = admin_client(viewer).get(reverse(url))
    assert page.status_code == 200
    text = page.content.decode()
    # Its workflow, its id, or its approver's name (the decisions' "by", the notified user).
    shown = [mark for mark in ("payroll_approval", str(request.id), "payer") if mark in text]
    assert shown == []


# --- 8. the workflow's history showed role grants to every reader (fixed) ----------------------


def test_role_grants_are_not_shown_to_those_the_roles_page_refuses(
    billing: WorkflowVersion,
) -> None:
    """Hole: the Roles page is for authors and operators, but each grant is logged on the
    workflow, whose admin history every viewer and starter read: who holds which role."""
    author = user_with("author", staff=True)
    person("zoe")
    roles = reverse("admin:workflows_workflow_roles", args=["billing"])
    admin_client(author).post(roles, {"role": "operator", "kind": "user", "name": "zoe"})
    viewer = user_with("viewer", staff=True)
    assert admin_client(viewer).get(roles).status_code == 403
    url = reverse("admin:workflows_workflow_history", args=["billing"])
    history = admin_client(viewer).get(url)
    assert history.status_code == 403
    assert "zoe" not in history.content.decode()
    assert "zoe" in admin_client(author).get(url).content.decode()


def test_a_workflows_readers_read_its_versions_and_journal_in_the_admin(
    billing: WorkflowVersion, payroll: WorkflowVersion
) -> None:
    """Not a leak but its mirror: the version, journal and operator-action inlines and the
    versions admin asked for global model permissions, so a role on one workflow showed none
    of them (CONTRACT section 8: "the run shows it")."""
    run = start()
    operator = user_with("operator", staff=True)
    client = admin_client(operator)
    client.post(
        reverse("admin:runs_run_changelist"),
        {"action": "cancel_runs", "_selected_action": [str(run.id)]},
    )
    page = client.get(reverse("admin:runs_run_change", args=[run.id])).content.decode()
    assert "the journal" in page and "field-step" in page and "field-attempt" in page
    assert "Operator actions" in page and "operator_user" in page
    workflow = client.get(reverse("admin:workflows_workflow_change", args=["billing"]))
    assert "diff with previous" in workflow.content.decode()
    mine = WorkflowVersion.objects.get(workflow_id="billing")
    theirs = WorkflowVersion.objects.get(workflow_id="payroll")
    assert (
        client.get(reverse("admin:workflows_workflowversion_change", args=[mine.pk])).status_code
        == 200
    )
    hidden = client.get(reverse("admin:workflows_workflowversion_change", args=[theirs.pk]))
    assert hidden.status_code == 302  # the admin's "does not exist"
    nobody = person("nobody", staff=True)
    listing = admin_client(nobody).get(reverse("admin:workflows_workflowversion_changelist"))
    assert listing.status_code == 403


# --- 9. a deleted user's idempotency keys fall into the trusted scope (open) ------------------


def test_deleting_users_keeps_idempotency_keys_in_their_own_scope(
    billing: WorkflowVersion,
) -> None:
    ada, bob = user_with("starter"), person("bob")
    access.grant("starter", "billing", user=bob)
    for who, ticket in ((ada, "ada's"), (fresh(bob), "bob's")):
        services.run_start(
            workflow="billing", input={"ticket": ticket}, idempotency_key="K", user=who
        )
    ada.delete()
    # Trusted code (the SDK's Workflow.start, a command) gets a run of its own, not ada's.
    trusted = services.run_start(workflow="billing", input={"ticket": "sdk"}, idempotency_key="K")
    assert trusted.created and trusted.run.input == {"ticket": "sdk"}
    bob.delete()  # not an IntegrityError on run_idempotency_key_no_user


# --- attacks tried and refused ---------------------------------------------------------------


def test_recent_actions_on_the_admin_index_are_the_users_own(billing: WorkflowVersion) -> None:
    secret = {"id": "secret_project", "steps": [{"id": "a", "kind": "task"}]}
    boss = creator("boss", staff=True)
    boss.is_staff = True
    boss.save()
    admin_client(boss).post(
        reverse("admin:workflows_workflow_add"), {"document": str(secret).replace("'", '"')}
    )
    assert WorkflowVersion.objects.filter(workflow_id="secret_project").exists()
    viewer = user_with("viewer", staff=True)
    assert "secret_project" not in admin_client(viewer).get("/admin/").content.decode()


def test_the_roles_page_refuses_a_post_without_its_csrf_token(billing: WorkflowVersion) -> None:
    author = user_with("author", staff=True)
    person("zoe")
    client = Client(enforce_csrf_checks=True)
    client.force_login(author)
    url = reverse("admin:workflows_workflow_roles", args=["billing"])
    assert client.post(url, {"role": "author", "kind": "user", "name": "zoe"}).status_code == 403
    assert access.roles(fresh(get_user_model().objects.get(username="zoe")), "billing") == set()


def test_an_operator_cannot_grant_author_or_starter_on_the_roles_page(
    billing: WorkflowVersion,
) -> None:
    operator = user_with("operator", staff=True)
    url = reverse("admin:workflows_workflow_roles", args=["billing"])
    for role in ("author", "starter", "operator"):
        for revoke in ("", "on"):
            body = {"role": role, "kind": "user", "name": "operator_user", "revoke": revoke}
            admin_client(operator).post(url, body)
    assert access.roles(fresh(operator), "billing") == {"operator", "viewer"}


def test_admin_autocomplete_shows_only_visible_workflows_and_runs(
    billing: WorkflowVersion, payroll: WorkflowVersion
) -> None:
    hidden = services.run_start(workflow="payroll", input={"amount": 1}).run
    viewer = user_with("viewer", staff=True)
    client = admin_client(viewer)
    for field in ("workflow", "parent_run"):
        answer = client.get(
            "/admin/autocomplete/",
            {"app_label": "runs", "model_name": "run", "field_name": field, "term": ""},
        )
        assert answer.status_code == 200
        assert "payroll" not in answer.content.decode()
        assert str(hidden.id) not in answer.content.decode()


def test_a_revoked_starter_and_an_inactive_user_lose_their_runs(billing: WorkflowVersion) -> None:
    sam = user_with("starter")
    run = start(sam)
    client = api_for(sam)
    assert client.get(f"/api/v1/runs/{run.id}").status_code == 200
    access.revoke("starter", "billing", user=sam)
    assert client.get(f"/api/v1/runs/{run.id}").status_code == 404
    assert client.post(f"/api/v1/runs/{run.id}/cancel").status_code == 404
    olga = user_with("operator")
    get_user_model().objects.filter(pk=olga.pk).update(is_active=False)
    assert api_for(olga).get(f"/api/v1/runs/{run.id}").status_code == 401
    assert not access.roles(fresh(olga), "billing")


def test_admin_lookups_cannot_reach_runs_outside_the_users_roles(
    billing: WorkflowVersion, payroll: WorkflowVersion
) -> None:
    hidden = services.run_start(workflow="payroll", input={"amount": 1}).run
    viewer = user_with("viewer", staff=True)
    client = admin_client(viewer)
    runs = reverse("admin:runs_run_changelist")
    hidden_page = reverse("admin:runs_run_change", args=[hidden.id])
    for query in (
        {"workflow__id__exact": "payroll"},
        {"q": str(hidden.id)},
        {"id__exact": str(hidden.id)},
    ):
        listed = client.get(runs, query).content.decode()
        assert hidden_page not in listed
    steps = reverse("admin:runs_steprun_changelist")
    listed = client.get(steps, {"q": str(hidden.id)}).content.decode()
    assert hidden_page not in listed
    for page in ("change", "history"):
        url = reverse(f"admin:runs_run_{page}", args=[hidden.id])
        assert client.get(url).status_code == 302  # the admin's "does not exist"
    version = WorkflowVersion.objects.get(workflow_id="payroll")
    url = reverse("admin:workflows_workflowversion_change", args=[version.pk])
    assert client.get(url).status_code == 302
    assert api_for(viewer).get("/api/v1/definitions/payroll/versions/1").status_code == 404
