"""Who may do what (CONTRACT section 8): the role matrix through the API and the admin, and the
attacks a security review found, each as a regression test.

Every user here is made without global permissions; each holds one role on the workflow
``billing`` (or none). ``other`` is a run someone else started; ``own`` one the user started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import services
from runs.engine.delivery import match_missed
from runs.models import Event, Run, RunAction, StepRun
from runs.status import RunStatus, StepStatus
from tests.moves import unchecked
from workflows import access
from workflows.models import WorkflowVersion
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-password-1"
ROLES = ("author", "starter", "operator", "viewer", "nobody", "superuser")

BILLING = {
    "id": "billing",
    "steps": [
        {"id": "gate", "kind": "wait_event", "event": "approved", "key": "${input.ticket}"},
        {"id": "charge", "kind": "task"},
    ],
}


def person(name: str, *, staff: bool = False, superuser: bool = False) -> Any:
    users = get_user_model().objects
    if superuser:
        return users.create_superuser(name, f"{name}@example.com", PASSWORD)
    return users.create_user(name, f"{name}@example.com", PASSWORD, is_staff=staff)


def api_for(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def user_with(role: str, *, staff: bool = False) -> Any:
    user = person(f"{role}_user", staff=staff, superuser=role == "superuser")
    if role in access.ROLES:
        access.grant(role, "billing", user=user)
    return user


def start(user: Any = None, ticket: str = "T-1") -> Run:
    return services.run_start(workflow="billing", input={"ticket": ticket}, user=user).run


@pytest.fixture
def billing() -> WorkflowVersion:
    return definition_save(document=BILLING).version


def in_status(run: Run, status: str) -> Run:
    with unchecked():  # put where the test needs it, not a move of the engine
        Run.objects.filter(id=run.id).update(status=status)
    return Run.objects.get(id=run.id)


# --- the matrix through the API -------------------------------------------------------------

# (call, {role: expected status}); every role not named answers like "nobody".
DEFINITION_CALLS: dict[str, dict[str, int]] = {
    "read definition": {"author": 200, "starter": 200, "operator": 200, "viewer": 200},
    "read version": {"author": 200, "starter": 200, "operator": 200, "viewer": 200},
    "save version": {"author": 201, "starter": 403, "operator": 403, "viewer": 403},
    "start run": {"author": 201, "starter": 201, "operator": 403, "viewer": 403},
}
NOBODY = {
    "read definition": 404,
    "read version": 404,
    "save version": 403,
    "start run": 404,
    "read other": 404,
    "read own": 404,
    "pause other": 404,
    "pause own": 404,
    "resume other": 404,
    "cancel other": 404,
    "retry other": 404,
}
RUN_CALLS: dict[str, dict[str, int]] = {
    "read other": {"author": 200, "starter": 404, "operator": 200, "viewer": 200},
    "read own": {"author": 200, "starter": 200, "operator": 200, "viewer": 200},
    "pause other": {"author": 200, "starter": 404, "operator": 200, "viewer": 403},
    "pause own": {"author": 200, "starter": 200, "operator": 200, "viewer": 403},
    "resume other": {"author": 200, "starter": 404, "operator": 200, "viewer": 403},
    "cancel other": {"author": 200, "starter": 404, "operator": 200, "viewer": 403},
    "retry other": {"author": 200, "starter": 404, "operator": 200, "viewer": 403},
}
CALLS = {**DEFINITION_CALLS, **RUN_CALLS}


def expected(call: str, role: str) -> int:
    if role == "superuser":
        return CALLS[call]["author"]
    return CALLS[call].get(role, NOBODY[call])


def _call(call: str, client: APIClient, user: Any) -> Any:
    if call == "read definition":
        return client.get("/api/v1/definitions/billing")
    if call == "read version":
        return client.get("/api/v1/definitions/billing/versions/1")
    if call == "save version":
        document = {**BILLING, "description": "a new version"}
        return client.post("/api/v1/definitions", document, format="json")
    if call == "start run":
        return client.post(
            "/api/v1/runs", {"workflow": "billing", "input": {"ticket": "T-9"}}, format="json"
        )
    what, whose = call.split()
    # "own": started by the user, when they may start; else by someone else like "other".
    owner = user if whose == "own" and access.STARTER in access.roles(user, "billing") else None
    run = start(owner)
    if what == "read":
        return client.get(f"/api/v1/runs/{run.id}")
    status = {
        "pause": RunStatus.RUNNING,
        "resume": RunStatus.PAUSED,
        "cancel": RunStatus.RUNNING,
        "retry": RunStatus.FAILED,
    }[what]
    in_status(run, status)
    return client.post(f"/api/v1/runs/{run.id}/{what}")


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix_through_the_api(billing: WorkflowVersion, role: str, call: str) -> None:
    user = user_with(role)
    response = _call(call, api_for(user), user)
    assert response.status_code == expected(call, role), response.content
    if response.status_code in (403, 404):
        # Every refusal names what it is about, never a bare 500 or an empty body.
        assert response.json()["errors"][0]["field"] in ("id", "workflow")


@pytest.mark.parametrize("role", ROLES)
def test_lists_show_only_what_the_role_may_see(billing: WorkflowVersion, role: str) -> None:
    definition_save(document={"id": "secret_project", "steps": [{"id": "a", "kind": "task"}]})
    user = user_with(role)
    other = start(None)
    own = start(user) if access.STARTER in access.roles(user, "billing") else None
    client = api_for(user)
    workflows = {row["id"] for row in client.get("/api/v1/definitions").json()["results"]}
    runs = {row["id"] for row in client.get("/api/v1/runs").json()["results"]}
    if role == "superuser":
        assert workflows == {"billing", "secret_project"}
    elif role == "nobody":
        assert workflows == set()
    else:
        assert workflows == {"billing"}
    sees_other = role in ("author", "operator", "viewer", "superuser")
    assert (str(other.id) in runs) is sees_other
    if own is not None:
        assert str(own.id) in runs
    if role == "nobody":
        assert runs == set()


def test_a_role_held_through_a_group_counts(billing: WorkflowVersion) -> None:
    grace = person("grace")
    group = Group.objects.create(name="billing-ops")
    grace.groups.add(group)
    access.grant("operator", "billing", group=group)
    run = start()
    response = api_for(grace).post(f"/api/v1/runs/{run.id}/pause")
    assert response.status_code == 200
    access.revoke("operator", "billing", group=group)
    grace = get_user_model().objects.get(pk=grace.pk)  # a fresh permission cache
    assert api_for(grace).get(f"/api/v1/runs/{run.id}").status_code == 404


@pytest.mark.parametrize("through", ["user", "group"])
def test_a_starter_by_the_workflows_own_role_is_not_asked_for_global_permissions(
    billing: WorkflowVersion, settings, through: str
) -> None:
    """POST /runs asks the workflow's own roles (guardian) first: a starter there is not asked
    for Django's global permissions, which could only add roles. Two of a start's statements
    fewer for the least-privileged client (bench.starts)."""
    settings.DJFLOW = {**settings.DJFLOW, "START_INLINE_PER_SECOND": 0}
    sam = person("sam")
    if through == "group":
        group = Group.objects.create(name="billing-clients")
        sam.groups.add(group)
        access.grant("starter", "billing", group=group)
    else:
        access.grant("starter", "billing", user=sam)
    client = api_for(sam)
    with CaptureQueriesContext(connection) as queries:
        response = client.post("/api/v1/runs", {"workflow": "billing"}, format="json")
    sql = [q["sql"] for q in queries.captured_queries]
    assert response.status_code == 201, response.json()
    assert [q for q in sql if "guardian_" in q], sql
    assert not [
        q for q in sql if "auth_user_user_permissions" in q or "auth_group_permissions" in q
    ], sql
    # A role elsewhere still counts: a viewer here who holds runs.add_run starts too, and one
    # who holds neither is told no.
    vic = person("vic")
    access.grant("viewer", "billing", user=vic)
    assert api_for(vic).post(
        "/api/v1/runs", {"workflow": "billing"}, format="json"
    ).status_code == (403)
    vic.user_permissions.add(
        Permission.objects.get(content_type__app_label="runs", codename="add_run")
    )
    vic = get_user_model().objects.get(pk=vic.pk)  # a fresh permission cache
    assert api_for(vic).post(
        "/api/v1/runs", {"workflow": "billing"}, format="json"
    ).status_code == (201)


@pytest.mark.parametrize(
    ("global_perm", "read", "start_status", "pause"),
    [
        ("runs.view_run", 200, 403, 403),
        ("runs.add_run", 404, 201, 404),
        ("runs.change_run", 200, 403, 200),
        ("workflows.change_workflow", 200, 201, 200),
    ],
)
def test_global_permissions_give_a_role_on_every_workflow(
    billing: WorkflowVersion, global_perm: str, read: int, start_status: int, pause: int
) -> None:
    user = person("gus")
    app, codename = global_perm.split(".")
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label=app, codename=codename)
    )
    client = api_for(user)
    run = start()
    assert client.get(f"/api/v1/runs/{run.id}").status_code == read
    started = client.post("/api/v1/runs", {"workflow": "billing"}, format="json")
    assert started.status_code == start_status
    assert client.post(f"/api/v1/runs/{run.id}/pause").status_code == pause


# --- the attacks, each a regression test ----------------------------------------------------


def test_a_non_author_cannot_publish_a_version_the_next_start_would_run(
    billing: WorkflowVersion,
) -> None:
    mallory = user_with("starter")
    evil = {"id": "billing", "steps": [{"id": "charge", "kind": "task", "handler": "billing.x"}]}
    response = api_for(mallory).post("/api/v1/definitions", evil, format="json")
    assert response.status_code == 403
    assert response.json()["errors"][0]["field"] == "id"
    assert WorkflowVersion.objects.filter(workflow_id="billing").count() == 1
    run = api_for(mallory).post("/api/v1/runs", {"workflow": "billing"}, format="json").json()
    assert run["version"] == 1


def test_a_new_workflow_needs_add_workflow_and_its_first_saver_becomes_its_author() -> None:
    nobody = person("nobody")
    document = {"id": "fresh", "steps": [{"id": "a", "kind": "task"}]}
    assert api_for(nobody).post("/api/v1/definitions", document, format="json").status_code == 403
    ann = person("ann")
    ann.user_permissions.add(Permission.objects.get(codename="add_workflow"))
    assert api_for(ann).post("/api/v1/definitions", document, format="json").status_code == 201
    assert access.roles(get_user_model().objects.get(pk=ann.pk), "fresh") == access.ALL
    # A second user with add_workflow cannot add versions to ann's workflow.
    ben = person("ben")
    ben.user_permissions.add(Permission.objects.get(codename="add_workflow"))
    again = {**document, "description": "mine now"}
    assert api_for(ben).post("/api/v1/definitions", again, format="json").status_code == 403


def test_a_handler_of_a_workflow_the_saver_does_not_author_is_a_400(
    billing: WorkflowVersion,
) -> None:
    definition_save(document={"id": "payroll", "steps": [{"id": "pay", "kind": "task"}]})
    author = user_with("author")
    document = {
        "id": "billing",
        "steps": [
            {"id": "own", "kind": "task", "handler": "billing.charge"},
            {"id": "steal", "kind": "task", "handler": "payroll.pay"},
        ],
    }
    response = api_for(author).post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {
            "field": "steps[1].handler",
            "message": "handler 'payroll.pay' belongs to workflow 'payroll', which you do not "
            "author",
        }
    ]
    access.grant("author", "payroll", user=author)
    author = get_user_model().objects.get(pk=author.pk)
    assert api_for(author).post("/api/v1/definitions", document, format="json").status_code == 201


def test_an_event_from_a_non_operator_resumes_no_wait_now_or_later(
    billing: WorkflowVersion,
) -> None:
    waiting = start(None, ticket="T-1")
    wait = StepRun.objects.get(run=waiting, step_id="gate")
    assert wait.status == StepStatus.WAITING
    for role in ("viewer", "starter", "nobody"):
        mallory = user_with(role)
        answer = api_for(mallory).post(
            "/api/v1/events", {"name": "approved", "key": "T-1"}, format="json"
        )
        assert answer.status_code == 200
        assert answer.json()["matched"] == 0
    wait.refresh_from_db()
    assert wait.status == StepStatus.WAITING
    # Stored, but scoped to nothing: a run reaching the wait later does not take them.
    later = start(None, ticket="T-1")
    assert StepRun.objects.get(run=later, step_id="gate").status == StepStatus.WAITING
    assert Event.objects.filter(scoped=True).count() == 3
    # The operator's event resumes both, and the run records who sent it.
    olga = user_with("operator")
    answer = api_for(olga).post("/api/v1/events", {"name": "approved", "key": "T-1"}, format="json")
    assert answer.json()["matched"] == 2
    detail = api_for(olga).get(f"/api/v1/runs/{waiting.id}").json()
    assert [(a["action"], a["by"]) for a in detail["actions"]] == [("event", "operator_user")]


def test_the_reconciler_never_hands_a_wait_an_event_out_of_its_senders_scope(
    billing: WorkflowVersion,
) -> None:
    waiting = start(None, ticket="T-1")
    viewer = user_with("viewer")
    services.event_send(name="approved", key="T-1", user=viewer)
    assert match_missed(batch=10) == 0
    assert StepRun.objects.get(run=waiting, step_id="gate").status == StepStatus.WAITING


def test_idempotency_keys_are_per_caller(billing: WorkflowVersion) -> None:
    ada, bob = user_with("starter"), person("bob")
    access.grant("starter", "billing", user=bob)
    body = {"workflow": "billing", "idempotency_key": "order-55", "input": {"ticket": "A"}}
    first = api_for(ada).post("/api/v1/runs", body, format="json")
    assert first.status_code == 201
    # Bob's same key is his own: a new run, and Ada's stays hidden from him.
    theirs = api_for(bob).post("/api/v1/runs", {**body, "input": {"ticket": "B"}}, format="json")
    assert theirs.status_code == 201
    assert theirs.json()["id"] != first.json()["id"]
    assert theirs.json()["input"] == {"ticket": "B"}
    again = api_for(bob).post("/api/v1/runs", body, format="json")
    assert (again.status_code, again.json()["id"]) == (200, theirs.json()["id"])


def test_every_operator_action_records_who_and_when(billing: WorkflowVersion) -> None:
    olga = user_with("operator")
    client = api_for(olga)
    run = start()
    client.post(f"/api/v1/runs/{run.id}/pause")
    client.post(f"/api/v1/runs/{run.id}/resume")
    client.post(f"/api/v1/runs/{run.id}/cancel")
    in_status(run, RunStatus.FAILED)
    client.post(f"/api/v1/runs/{run.id}/retry")
    actions = client.get(f"/api/v1/runs/{run.id}").json()["actions"]
    assert [(a["action"], a["by"]) for a in actions] == [
        ("pause", "operator_user"),
        ("resume", "operator_user"),
        ("cancel", "operator_user"),
        ("retry", "operator_user"),
    ]
    assert all(a["at"] for a in actions)
    # A refused action records nothing.
    viewer = user_with("viewer")
    assert api_for(viewer).post(f"/api/v1/runs/{run.id}/pause").status_code == 403
    assert RunAction.objects.filter(run=run).count() == 4


def test_tracebacks_only_for_operators(billing: WorkflowVersion) -> None:
    starter = user_with("starter")
    run = start(starter)
    StepRun.objects.filter(run=run, step_id="gate").update(
        status=StepStatus.FAILED,
        error={"class": "fatal", "message": "boom", "traceback": "Traceback: /srv/app.py"},
    )
    mine = api_for(starter).get(f"/api/v1/runs/{run.id}").json()
    [gate] = [step for step in mine["steps"] if step["step_id"] == "gate"]
    assert gate["error"] == {"class": "fatal", "message": "boom"}
    olga = user_with("operator")
    theirs = api_for(olga).get(f"/api/v1/runs/{run.id}").json()
    [gate] = [step for step in theirs["steps"] if step["step_id"] == "gate"]
    assert gate["error"]["traceback"] == "Traceback: /srv/app.py"


def test_an_operator_reads_a_journal_whose_error_is_not_an_object(
    billing: WorkflowVersion,
) -> None:
    """The engine writes errors as objects; one written otherwise (by hand, in the database)
    still reads, for an operator and for the run's starter: it has no traceback to hide."""
    starter = user_with("starter")
    run = start(starter)
    StepRun.objects.filter(run=run, step_id="gate").update(status=StepStatus.FAILED, error=5)
    for reader in (user_with("operator"), starter):
        response = api_for(reader).get(f"/api/v1/runs/{run.id}")
        assert response.status_code == 200, response.content
        [gate] = [step for step in response.json()["steps"] if step["step_id"] == "gate"]
        assert gate["error"] == 5


def test_ids_do_not_leak_a_run_one_may_not_see_is_the_same_404_as_none(
    billing: WorkflowVersion,
) -> None:
    nobody = user_with("nobody")
    run = start()
    hidden = api_for(nobody).get(f"/api/v1/runs/{run.id}")
    missing = api_for(nobody).get("/api/v1/runs/00000000-0000-0000-0000-000000000000")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["errors"][0]["field"] == missing.json()["errors"][0]["field"] == "id"


# --- the matrix through the admin -----------------------------------------------------------


def admin_client(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


ADMIN_PAGES: dict[str, Callable[[Run], str]] = {
    "run list": lambda run: reverse("admin:runs_run_changelist"),
    "run page": lambda run: reverse("admin:runs_run_change", args=[run.id]),
    "workflow page": lambda run: reverse("admin:workflows_workflow_change", args=["billing"]),
    "new version": lambda run: reverse("admin:workflows_workflow_new_version", args=["billing"]),
    "roles": lambda run: reverse("admin:workflows_workflow_roles", args=["billing"]),
}
# 200 shown; 302 the admin's "does not exist" redirect (or sign-in); 403 refused. A user with
# no role anywhere gets 403 for every page of the app whatever the id: nothing leaks.
ADMIN_EXPECTED = {
    "author": {"run list": 200, "run page": 200, "workflow page": 200, "new version": 200,
               "roles": 200},
    "operator": {"run list": 200, "run page": 200, "workflow page": 200, "new version": 403,
                 "roles": 200},
    "viewer": {"run list": 200, "run page": 200, "workflow page": 200, "new version": 403,
               "roles": 403},
    "starter": {"run list": 200, "run page": 302, "workflow page": 200, "new version": 403,
                "roles": 403},
    "nobody": {"run list": 403, "run page": 403, "workflow page": 403, "new version": 302,
               "roles": 302},
    "superuser": {"run list": 200, "run page": 200, "workflow page": 200, "new version": 200,
                  "roles": 200},
}  # fmt: skip


@pytest.mark.parametrize("page", list(ADMIN_PAGES))
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix_through_the_admin(billing: WorkflowVersion, role: str, page: str) -> None:
    user = user_with(role, staff=True)
    run = start()  # someone else's
    response = admin_client(user).get(ADMIN_PAGES[page](run))
    assert response.status_code == ADMIN_EXPECTED[role][page]
    if page == "run list" and response.status_code == 200:
        sees = str(run.id) in response.content.decode()
        assert sees is (role != "starter")


@pytest.mark.parametrize(("role", "cancelled"), [("operator", True), ("viewer", False)])
def test_the_admin_cancel_action_answers_to_the_run_operators(
    billing: WorkflowVersion, role: str, cancelled: bool
) -> None:
    user = user_with(role, staff=True)
    run = start()
    response = admin_client(user).post(
        reverse("admin:runs_run_changelist"),
        {"action": "cancel_runs", "_selected_action": [str(run.id)]},
        follow=True,
    )
    assert response.status_code == 200
    run.refresh_from_db()
    assert (run.status == RunStatus.CANCELLED) is cancelled
    if cancelled:
        assert RunAction.objects.get(run=run).actor_name == "operator_user"


def test_authors_grant_roles_in_the_admin_and_operators_only_viewer(
    billing: WorkflowVersion,
) -> None:
    author, operator, zoe = (
        user_with("author", staff=True),
        user_with("operator", staff=True),
        person("zoe"),
    )
    url = reverse("admin:workflows_workflow_roles", args=["billing"])
    page = admin_client(author).get(url).content.decode()
    assert "author_user" in page and "operator_user" in page
    response = admin_client(author).post(url, {"role": "starter", "kind": "user", "name": "zoe"})
    assert response.status_code == 302
    assert access.STARTER in access.roles(get_user_model().objects.get(pk=zoe.pk), "billing")
    refused = admin_client(operator).post(url, {"role": "author", "kind": "user", "name": "zoe"})
    assert refused.status_code == 200 and "you may not grant" in refused.content.decode()
    allowed = admin_client(operator).post(url, {"role": "viewer", "kind": "user", "name": "zoe"})
    assert allowed.status_code == 302
    unknown = admin_client(author).post(url, {"role": "viewer", "kind": "user", "name": "nope"})
    assert "no user" in unknown.content.decode()


def test_grant_role_command(billing: WorkflowVersion, capsys: pytest.CaptureFixture[str]) -> None:
    person("zed")
    call_command("grant_role", "operator", "billing", "--user", "zed")
    zed = get_user_model().objects.get(username="zed")
    assert access.OPERATOR in access.roles(zed, "billing")
    call_command("grant_role", "billing", "--list")
    assert "operator\tuser\tzed" in capsys.readouterr().out
    call_command("grant_role", "operator", "billing", "--user", "zed", "--revoke")
    zed = get_user_model().objects.get(username="zed")
    assert access.roles(zed, "billing") == frozenset()
    with pytest.raises(CommandError, match="unknown workflow"):
        call_command("grant_role", "operator", "nope", "--user", "zed")
    with pytest.raises(CommandError, match="no user"):
        call_command("grant_role", "operator", "billing", "--user", "ghost")


def test_a_subworkflow_step_may_call_only_workflows_its_author_may_start(
    billing: WorkflowVersion,
) -> None:
    definition_save(document={"id": "payroll", "steps": [{"id": "pay", "kind": "task"}]})
    author = user_with("author")
    calling = {
        "id": "billing",
        "steps": [{"id": "child", "kind": "subworkflow", "workflow": "payroll"}],
    }
    response = api_for(author).post("/api/v1/definitions", calling, format="json")
    assert response.status_code == 400
    # Invisible to the author: the same answer as a workflow that does not exist.
    assert response.json()["errors"] == [
        {"field": "steps[0].workflow", "message": "unknown workflow 'payroll'"}
    ]
    access.grant("viewer", "payroll", user=author)
    author = get_user_model().objects.get(pk=author.pk)
    response = api_for(author).post("/api/v1/definitions", calling, format="json")
    assert response.json()["errors"][0]["message"].startswith(
        "you may not start runs of workflow 'payroll'"
    )
    access.grant("starter", "payroll", user=author)
    author = get_user_model().objects.get(pk=author.pk)
    assert api_for(author).post("/api/v1/definitions", calling, format="json").status_code == 201
