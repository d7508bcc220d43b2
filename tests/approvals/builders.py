"""Builders for the approvals web tests: a saved workflow with an approval step, a run of it
waiting on its request, approvers who are users or plain e-mail addresses.

The engine opens the request in the transaction that starts the run (an approval is an
engine-only step), so no worker is needed.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from approvals.models import ApprovalRequest, Approver
from approvals.tokens import make_token
from runs.models import Run
from runs.services import run_start
from workflows.services import definition_save

PASSWORD = "a-long-password-1"


def make_user(username: str, email: str | None = None, **extra: Any) -> Any:
    return get_user_model().objects.create_user(
        username=username,
        email=email if email is not None else f"{username}@example.com",
        password=PASSWORD,
        **extra,
    )


def make_group(name: str, *users: Any) -> Group:
    group = Group.objects.create(name=name)
    group.user_set.add(*users)
    return group


def approval_document(
    workflow: str = "expense",
    *,
    users: list[str] | None = None,
    groups: list[str] | None = None,
    emails: list[str] | None = None,
    quorum: int = 1,
    timeout_ms: int | None = None,
    then_handoff: str | None = None,
    **step_fields: Any,
) -> dict[str, Any]:
    approvers: dict[str, Any] = {}
    if users:
        approvers["users"] = users
    if groups:
        approvers["groups"] = groups
    if emails:
        approvers["emails"] = emails
    step: dict[str, Any] = {
        "id": "sign_off",
        "kind": "approval",
        "approvers": approvers,
        "quorum": quorum,
        "message": "Pay ${input.amount} EUR to ${input.vendor}?",
        "input": {"amount": "${input.amount}", "vendor": "${input.vendor}"},
        **step_fields,
    }
    if timeout_ms is not None:
        step["timeout_ms"] = timeout_ms
    steps: list[dict[str, Any]] = [step]
    if then_handoff:
        steps.append(
            {
                "id": "tell_finance",
                "kind": "handoff",
                "group": then_handoff,
                "message": "Paid ${input.vendor}",
            }
        )
    return {
        "id": workflow,
        "limits": {"run_timeout_ms": 86_400_000},
        "steps": steps,
    }


def start_approval(
    workflow: str = "expense",
    *,
    amount: int = 120,
    vendor: str = "Acme Paper",
    **document: Any,
) -> tuple[Run, ApprovalRequest]:
    """Save the document, start a run and return it with its (pending) request."""
    definition_save(document=approval_document(workflow, **document))
    run = run_start(workflow=workflow, input={"amount": amount, "vendor": vendor}).run
    run.refresh_from_db()
    return run, ApprovalRequest.objects.get(run=run)


def approver(request: ApprovalRequest, label: str) -> Approver:
    """The approver row of a user name or a plain e-mail address."""
    for person in request.people.select_related("user"):
        if person.label == label:
            return person
    raise LookupError(label)


def link_path(person: Approver) -> str:
    return f"/approvals/link/{make_token(person)}/"


def link_client(person: Approver) -> Client:
    """A browser that may use ``person``'s link: signed in as them when they are a user of
    the site (their link works for nobody else), anonymous for a plain address."""
    client = Client()
    if person.user is not None:
        client.force_login(person.user)
    return client


def decide_by_link(
    request: ApprovalRequest, label: str, decision: str = "approved", **data: Any
) -> Any:
    """``label``'s decision through their link, as they would post it (signed in when they
    are a user); extra keyword arguments are the comment or request headers."""
    person = approver(request, label)
    headers = {k: data.pop(k) for k in list(data) if k.isupper()}
    return link_client(person).post(link_path(person), {"decision": decision, **data}, **headers)
