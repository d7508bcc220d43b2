"""Mailing site users and groups needs a permission (issue 36): an approval step's
``approvers`` and ``escalate_to`` and a hand-off's ``group`` mail the people they name with
the author's text. Before, anyone who may author a workflow could mail any user or group
of the site, and tell from the step's error which names exist. Now naming anyone but
oneself needs ``approvals.mail_users``, checked at save (a 400 naming the field) and again
when the step runs (a version saved before the rule, an author who lost the permission),
and the answer is the same for a real name and a made-up one."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest, Mail, Notification
from runs.models import StepRun
from runs.services import run_start
from workflows.services import NAMING_PEOPLE, definition_save

from .builders import make_group, make_user
from .test_bounds import refused

pytestmark = pytest.mark.django_db


def approval(workflow: str = "pay", **approvers: Any) -> dict[str, Any]:
    extra = approvers.pop("extra", {})
    return {
        "id": workflow,
        "limits": {"run_timeout_ms": 86_400_000},
        "steps": [{"id": "gate", "kind": "approval", "approvers": approvers, **extra}],
    }


def handoff(workflow: str = "tell", group: str = "finance") -> dict[str, Any]:
    return {"id": workflow, "steps": [{"id": "tell", "kind": "handoff", "group": group}]}


@pytest.fixture
def people(db) -> None:
    make_group("finance", make_user("bob"), make_user("cy"))


@pytest.fixture
def author(people) -> Any:
    user = make_user("author")
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_workflow", "change_workflow"])
    )
    return type(user).objects.get(pk=user.pk)


def allow(user: Any) -> Any:
    user.user_permissions.add(Permission.objects.get(codename="mail_users"))
    return type(user).objects.get(pk=user.pk)


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (approval(users=["bob"]), "steps[0].approvers.users[0]"),
        (approval(users=["author", "bob"]), "steps[0].approvers.users[1]"),
        (approval(groups=["finance"]), "steps[0].approvers.groups[0]"),
        (
            approval(users=["author"], extra={"escalate_to": {"users": ["cy"]}}),
            "steps[0].escalate_to.users[0]",
        ),
        (
            approval(users=["author"], extra={"escalate_to": {"groups": ["finance"]}}),
            "steps[0].escalate_to.groups[0]",
        ),
        (handoff(), "steps[0].group"),
    ],
)
def test_naming_others_without_the_permission_is_a_400_naming_the_field(
    author, document, field
) -> None:
    assert refused(document, author) == {field: NAMING_PEOPLE}


@pytest.mark.parametrize(
    ("real", "made_up"),
    [
        (approval(users=["bob"]), approval(users=["nobody"])),
        (approval(groups=["finance"]), approval(groups=["ghosts"])),
        (handoff(group="finance"), handoff(group="ghosts")),
    ],
)
def test_a_real_name_and_a_made_up_one_get_the_same_answer(author, real, made_up) -> None:
    """No probe: the answer does not depend on whether the name exists."""
    assert refused(real, author) == refused(made_up, author)


def test_an_author_may_name_themselves(author) -> None:
    document = approval(users=["author"], extra={"escalate_to": {"users": ["author"]}})
    assert definition_save(document=document, user=author).created


def test_the_permission_the_deployment_and_superusers_may_name_anyone(author, admin_user) -> None:
    named = approval(users=["bob"], groups=["finance"])
    assert definition_save(document=named, user=allow(author)).created
    assert definition_save(document=handoff(), user=author).created
    assert definition_save(document=approval("ops", groups=["finance"])).created
    assert definition_save(document=approval("root", users=["cy"]), user=admin_user).created


def test_the_api_answers_400_naming_the_field(author) -> None:
    api = APIClient()
    api.force_authenticate(author)
    answer = api.post("/api/v1/definitions", approval(users=["bob"]), format="json")
    assert answer.status_code == 400
    assert answer.json()["errors"] == [
        {"field": "steps[0].approvers.users[0]", "message": NAMING_PEOPLE}
    ]


def _lose_permission(author: Any) -> Any:
    author.user_permissions.remove(Permission.objects.get(codename="mail_users"))
    return type(author).objects.get(pk=author.pk)


@pytest.mark.parametrize("name", ["bob", "nobody"])
def test_a_stored_version_whose_author_may_not_name_people_fails_the_step(author, name) -> None:
    """The author lost the permission after saving (or saved before the rule): the request
    does not open, no one is mailed, and the error is the same whether the user exists."""
    definition_save(document=approval(users=[name]), user=allow(author))
    _lose_permission(author)
    run = run_start(workflow="pay", input={}).run
    gate = StepRun.objects.get(run=run, step_id="gate")
    assert gate.status == "failed"
    assert gate.error == {
        "class": "invalid_input",
        "message": f"approvers.users[0]: {NAMING_PEOPLE} (the author of version 1 does not "
        "hold it)",
    }
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()


@pytest.mark.parametrize("group", ["finance", "ghosts"])
def test_a_stored_handoff_whose_author_may_not_name_groups_fails_alike(author, group) -> None:
    definition_save(document=handoff(group=group), user=allow(author))
    _lose_permission(author)
    run = run_start(workflow="tell", input={}).run
    tell = StepRun.objects.get(run=run, step_id="tell")
    assert tell.status == "failed"
    assert tell.error["message"] == (
        f"group: {NAMING_PEOPLE} (the author of version 1 does not hold it)"
    )
    assert not Notification.objects.exists() and not Mail.objects.exists()


def test_with_the_permission_kept_the_step_mails_the_group(author) -> None:
    definition_save(document=handoff(), user=allow(author))
    run = run_start(workflow="tell", input={}).run
    assert StepRun.objects.get(run=run, step_id="tell").status == "succeeded"
    assert sorted(Mail.objects.values_list("to", flat=True)) == [
        "bob@example.com",
        "cy@example.com",
    ]
