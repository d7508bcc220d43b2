"""The runs admin: read-only lists and pages, and actions that go through the services."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from runs.models import Run, RunAction, StepRun
from runs.status import RunStatus, StepStatus

from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:runs_run_changelist"


@pytest.fixture
def version():
    return WorkflowVersionFactory()


def _staff(*codenames: str) -> Client:
    user = get_user_model().objects.create_user(
        username="operator", password="a-long-password-1", is_staff=True
    )
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def _messages(response) -> list[tuple[str, str]]:
    return [(m.level_tag, m.message) for m in get_messages(response.wsgi_request)]


def _act(client: Client, action: str, runs: list[Run]):
    return client.post(
        reverse(CHANGELIST),
        {"action": action, "_selected_action": [str(r.id) for r in runs]},
        follow=True,
    )


# --- lists and pages --------------------------------------------------------------------------


def test_run_list_shows_columns_and_filters(admin_client: Client, version) -> None:
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    running = RunFactory(version=version, status=RunStatus.RUNNING)
    response = admin_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    html = response.content.decode()
    assert str(failed.id) in html and str(running.id) in html
    for heading in ("Workflow", "Version", "Status", "Created at", "Finished at", "Cost usd"):
        assert heading in html
    # No add button: runs are started by the API, the builder or a parent run.
    assert reverse("admin:runs_run_add") not in html

    filtered = admin_client.get(reverse(CHANGELIST), {"status__exact": "failed"})
    assert filtered.status_code == 200
    assert list(filtered.context["cl"].queryset) == [failed]
    by_workflow = admin_client.get(reverse(CHANGELIST), {"workflow__id__exact": "support_ticket"})
    assert set(by_workflow.context["cl"].queryset) == {failed, running}


@pytest.mark.parametrize("field", ["id", "correlation", "idempotency_key"])
def test_run_search_by_id_correlation_and_key(admin_client: Client, version, field: str) -> None:
    wanted = RunFactory(version=version, correlation="crm-7781", idempotency_key="order-55")
    RunFactory(version=version, correlation="crm-1", idempotency_key="order-1")
    term = {"id": str(wanted.id)[:13], "correlation": "7781", "idempotency_key": "order-55"}[field]
    response = admin_client.get(reverse(CHANGELIST), {"q": term})
    assert response.status_code == 200
    assert list(response.context["cl"].queryset) == [wanted]


def test_run_change_page_is_read_only_with_the_journal(admin_client: Client, version) -> None:
    run = RunFactory(version=version, status=RunStatus.FAILED, correlation="crm-9")
    StepRunFactory(run=run, step_id="classify")
    StepRunFactory(run=run, step_id="send", status=StepStatus.FAILED, worker="celery@w7")
    url = reverse("admin:runs_run_change", args=[run.id])
    response = admin_client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    # A view-only page: no save or delete, every field read-only.
    assert 'name="_save"' not in html
    assert reverse("admin:runs_run_delete", args=[run.id]) not in html
    assert response.context["adminform"].form.fields == {}
    # Who acted on it, then the journal, as read-only tables.
    actions, inline = response.context["inline_admin_formsets"]
    assert actions.formset.model is RunAction
    assert inline.formset.model is StepRun
    assert not inline.has_add_permission and not inline.has_change_permission
    for text in ("classify", "send", "celery@w7", "fatal", "boom", "crm-9"):
        assert text in html
    # A POST changes nothing.
    before = Run.objects.filter(id=run.id).values().get()
    assert admin_client.post(url, {"status": "completed"}).status_code == 403
    assert Run.objects.filter(id=run.id).values().get() == before


def test_parent_and_children_are_linked(admin_client: Client, version) -> None:
    parent = RunFactory(version=version)
    step = StepRunFactory(run=parent, step_id="research", kind="subworkflow")
    child = RunFactory(version=version, parent_run=parent, parent_step_run=step)
    parent_page = admin_client.get(reverse("admin:runs_run_change", args=[parent.id]))
    assert reverse("admin:runs_run_change", args=[child.id]) in parent_page.content.decode()
    child_page = admin_client.get(reverse("admin:runs_run_change", args=[child.id])).content
    assert reverse("admin:runs_run_change", args=[parent.id]) in child_page.decode()
    assert "step research" in child_page.decode()


def test_nobody_adds_or_deletes_runs(admin_client: Client, version) -> None:
    run = RunFactory(version=version)
    assert admin_client.get(reverse("admin:runs_run_add")).status_code == 403
    assert admin_client.get(reverse("admin:runs_run_delete", args=[run.id])).status_code == 403
    response = admin_client.get(reverse(CHANGELIST))
    actions = dict(response.context["action_form"].fields["action"].choices)
    assert "delete_selected" not in actions
    assert set(actions) == {"", "cancel_runs", "retry_runs"}


def test_step_run_list_filters_and_page(admin_client: Client, version) -> None:
    run = RunFactory(version=version)
    ok = StepRunFactory(run=run, step_id="classify")
    failed = StepRunFactory(run=run, step_id="draft", kind="agent", status=StepStatus.FAILED)
    listing = admin_client.get(reverse("admin:runs_steprun_changelist"))
    assert listing.status_code == 200
    assert "classify" in listing.content.decode()
    by_status = admin_client.get(
        reverse("admin:runs_steprun_changelist"), {"status__exact": "failed"}
    )
    assert list(by_status.context["cl"].queryset) == [failed]
    by_kind = admin_client.get(reverse("admin:runs_steprun_changelist"), {"kind__exact": "task"})
    assert list(by_kind.context["cl"].queryset) == [ok]
    page = admin_client.get(reverse("admin:runs_steprun_change", args=[failed.id]))
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert "Traceback ..." in page.content.decode()
    assert admin_client.get(reverse("admin:runs_steprun_add")).status_code == 403


# --- actions ----------------------------------------------------------------------------------


def test_cancel_action_cancels_and_reports_each_run(admin_client: Client, version) -> None:
    running = RunFactory(version=version)
    step = StepRunFactory(run=running, step_id="draft", status=StepStatus.RUNNING)
    completed = RunFactory(version=version, status=RunStatus.COMPLETED)
    response = _act(admin_client, "cancel_runs", [running, completed])
    assert response.status_code == 200
    reported = _messages(response)
    assert ("success", f"Run {running.id} cancelled.") in reported
    assert any(
        level == "error" and str(completed.id) in text and "completed" in text
        for level, text in reported
    ), reported
    running.refresh_from_db()
    completed.refresh_from_db()
    step.refresh_from_db()
    assert running.status == RunStatus.CANCELLED
    assert running.error["class"] == "cancelled"
    assert step.status == StepStatus.CANCELLED
    assert completed.status == RunStatus.COMPLETED


def test_retry_action_retries_failed_runs_only(
    admin_client: Client, version, django_capture_on_commit_callbacks
) -> None:
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    running = RunFactory(version=version)
    with django_capture_on_commit_callbacks() as callbacks:
        response = _act(admin_client, "retry_runs", [failed, running])
    reported = _messages(response)
    assert ("success", f"Run {failed.id} retried.") in reported
    assert any(level == "error" and str(running.id) in text for level, text in reported)
    failed.refresh_from_db()
    running.refresh_from_db()
    assert (failed.status, failed.generation) == (RunStatus.RUNNING, 2)
    assert (running.status, running.generation) == (RunStatus.RUNNING, 1)
    # One advance for the one run retried, sent after commit.
    assert len(callbacks) == 1


def test_a_view_only_operator_sees_runs_but_cannot_act(version) -> None:
    client = _staff("view_run", "view_steprun")
    run = RunFactory(version=version)
    StepRunFactory(run=run)
    listing = client.get(reverse(CHANGELIST))
    assert listing.status_code == 200
    assert str(run.id) in listing.content.decode()
    assert listing.context["action_form"] is None or not {"cancel_runs", "retry_runs"} & set(
        dict(listing.context["action_form"].fields["action"].choices)
    )
    page = client.get(reverse("admin:runs_run_change", args=[run.id]))
    assert page.status_code == 200
    assert "classify" in page.content.decode()
    response = _act(client, "cancel_runs", [run])
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    assert not any(level == "success" for level, _ in _messages(response))


def test_an_operator_with_the_change_permission_may_act(version) -> None:
    client = _staff("view_run", "change_run")
    run = RunFactory(version=version)
    response = _act(client, "cancel_runs", [run])
    assert ("success", f"Run {run.id} cancelled.") in _messages(response)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
