"""Budgets (CONTRACT section 17): budget_exceeded as a resumable run status, for a run's
limits.max_cost_usd and for an account's budget, on the ``djflow`` fixture's virtual clock."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from runs import services
from runs.engine import costs
from runs.engine.reconcile import reoffer_lost
from runs.models import Account, RunAction, StepRun
from runs.serializers import RunSerializer

DAY = 86_400
# $1,000 per million tokens: a call of max_tokens 100 has a worst case of about $0.11.
PRICES = {"openai:dear": {"input": 1000, "output": 1000}}


@pytest.fixture
def priced(settings: Any) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "PRICES": PRICES}


def _document(workflow_id: str, *, steps: int = 2, **limits: Any) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "limits": {"run_timeout_ms": 40 * DAY * 1000, **limits},
        "steps": [
            {
                "id": f"ask{n}",
                "kind": "recipe",
                "model": "openai:dear",
                "prompt": "hi",
                "max_tokens": 100,
            }
            for n in range(steps)
        ],
    }


def _reason(run: Any) -> str:
    from runs.selectors import run_get

    return RunSerializer(run_get(run_id=run.id, user=None)).data["reason"]


def test_a_run_over_its_limit_waits_and_a_top_up_lets_the_step_go_on(djflow, priced) -> None:
    djflow.model(reply="ok")
    run = djflow.start(_document("bx_run", max_cost_usd=0.15))
    assert run.status == "budget_exceeded", run.error
    assert run.step("ask0")["status"] == "succeeded"
    waiting = StepRun.objects.get(run_id=run.id, step_id="ask1")
    assert waiting.status == "scheduled" and waiting.budget_wait["limit"] == "run"
    reason = _reason(run)
    assert "limits.max_cost_usd (0.15)" in reason and "worst case is $0.1" in reason
    # The reconciler does not offer it again, however long it waits.
    djflow.advance(3600)
    assert reoffer_lost(dt.datetime.now(dt.UTC) + dt.timedelta(hours=1), 100) == 0
    assert run.status == "budget_exceeded"

    with djflow._settling():
        services.run_budget_add(run_id=run.id, add_usd=Decimal("0.5"))
    assert run.status == "completed", run.error
    assert run.step("ask1")["status"] == "succeeded"
    # The attempt that waited is the one that ran: no attempt was spent on the wait.
    assert StepRun.objects.filter(run_id=run.id, step_id="ask1").count() == 1
    assert RunAction.objects.filter(run_id=run.id, action="budget").exists()


def test_on_budget_fail_fails_the_step_with_class_budget_exceeded(djflow, priced) -> None:
    djflow.model(reply="ok")
    run = djflow.start(_document("bx_fail", max_cost_usd=0.15, on_budget="fail"))
    assert run.status == "failed"
    assert run.error["class"] == "budget_exceeded", run.error
    assert "limits.max_cost_usd (0.15)" in run.error["message"]


def test_a_budget_exceeded_run_can_be_cancelled(djflow, priced) -> None:
    djflow.model(reply="ok")
    run = djflow.start(_document("bx_cancel", max_cost_usd=0.15))
    assert run.status == "budget_exceeded"
    with djflow._settling():
        services.run_cancel(run_id=run.id)
    assert run.status == "cancelled"
    assert StepRun.objects.get(run_id=run.id, step_id="ask1").status == "cancelled"


def test_raising_an_accounts_budget_resumes_its_runs(djflow, priced) -> None:
    services.account_save(name="acme", budget_usd=Decimal("0.15"), period=None, user=None)
    djflow.model(reply="ok")
    run = djflow.start(_document("bx_account"), account="acme")
    assert run.status == "budget_exceeded", run.error
    assert "account acme's budget ($0.150000)" in _reason(run)
    account = Account.objects.get(name="acme")
    assert account.reserved_usd == 0 and Decimal("0") < account.spent_usd <= Decimal("0.15")
    with djflow._settling():
        services.account_save(name="acme", budget_usd=Decimal("1"), period=None, user=None)
    assert run.status == "completed", run.error
    account.refresh_from_db()
    assert account.reserved_usd == 0
    assert account.spent_usd == run.cost_usd


def test_a_new_day_resumes_a_daily_budget_on_the_virtual_clock(djflow, priced) -> None:
    services.account_save(name="daily", budget_usd=Decimal("0.15"), period="day", user=None)
    djflow.model(reply="ok")
    run = djflow.start(_document("bx_daily"), account="daily")
    assert run.status == "budget_exceeded", run.error
    wait = StepRun.objects.get(run_id=run.id, step_id="ask1").budget_wait
    assert wait["until"] is not None
    djflow.advance(DAY)
    assert run.status == "completed", run.error
    account = Account.objects.get(name="daily")
    # The new day's spend only: the first call was yesterday's.
    assert account.spent_usd < run.cost_usd


def test_costs_hold_and_settle_an_account_budget_and_refuse_past_it(db) -> None:
    from tests.runs.factories import RunFactory, StepRunFactory

    Account.objects.create(name="acct", budget_usd=Decimal("0.10"))
    run = RunFactory(account="acct")
    first = StepRunFactory(run=run, status="running", step_id="a", kind="recipe")
    second = StepRunFactory(run=run, status="running", step_id="b", kind="recipe")
    held = costs.reserve(step_run_id=first.id, run_id=run.id, amount=Decimal("0.06"))
    assert held.account == "acct"
    with pytest.raises(costs.OverBudget) as over:
        costs.reserve(step_run_id=second.id, run_id=run.id, amount=Decimal("0.06"))
    assert over.value.wait["limit"] == "account" and over.value.wait["asked_usd"] == "0.060000"
    costs.settle(held, actual=Decimal("0.01"))
    account = Account.objects.get(name="acct")
    assert (account.spent_usd, account.reserved_usd) == (Decimal("0.01"), Decimal(0))
    costs.reserve(step_run_id=second.id, run_id=run.id, amount=Decimal("0.06"))


def test_the_inspector_shows_why_and_its_operators_top_up_the_run(
    djflow, priced, admin_user, django_user_model
) -> None:
    from django.test import Client

    djflow.model(reply="ok")
    run = djflow.start(_document("bx_page", max_cost_usd=0.15))
    assert run.status == "budget_exceeded"
    client = Client()
    client.force_login(admin_user)
    page = client.get(f"/runs/{run.id}/").content.decode()
    assert 'id="run-budget-reason"' in page and "waits for budget" in page
    assert f'action="/runs/{run.id}/top-up/"' in page
    # A bad amount is refused, naming the field; nothing moves.
    refused = client.post(f"/runs/{run.id}/top-up/", {"add_usd": "lots"})
    assert refused.status_code == 400 and "an amount of USD" in refused.content.decode()
    with djflow._settling():
        answer = client.post(f"/runs/{run.id}/top-up/", {"add_usd": "0.5"})
    assert answer.status_code == 302
    assert run.status == "completed", run.error
    # One who may not operate the run sees no form, and may not post it.
    from workflows import access

    vera = django_user_model.objects.create_user(username="vera", password="a-long-password-1")
    access.grant("viewer", "bx_page", user=vera)
    other = djflow.start(_document("bx_page", max_cost_usd=0.15))
    viewer = Client()
    viewer.force_login(vera)
    assert "top-up-form" not in viewer.get(f"/runs/{other.id}/").content.decode()
    assert viewer.post(f"/runs/{other.id}/top-up/", {"add_usd": "1"}).status_code == 403
    assert other.status == "budget_exceeded"


def test_the_workflows_operators_are_told_in_app_and_by_mail_once(
    djflow, priced, django_user_model, mailoutbox
) -> None:
    from approvals.models import Notification
    from workflows import access
    from workflows.services import definition_save

    definition_save(document=_document("bx_told", max_cost_usd=0.15))
    olga = django_user_model.objects.create_user(username="olga", email="olga@example.com")
    vera = django_user_model.objects.create_user(username="vera", email="vera@example.com")
    access.grant("operator", "bx_told", user=olga)
    access.grant("viewer", "bx_told", user=vera)
    djflow.model(reply="ok")
    run = djflow.start("bx_told")
    assert run.status == "budget_exceeded"
    told = Notification.objects.filter(run_id=run.id)
    assert [(n.user.username, n.kind) for n in told] == [("olga", "budget")]
    assert "waits for budget" in told[0].body and "ask1" in told[0].title
    mails = [m for m in mailoutbox if "olga@example.com" in m.to]
    assert len(mails) == 1 and "Waiting for budget" in mails[0].subject
    assert f"/runs/{run.id}/" in mails[0].body
    assert not [m for m in mailoutbox if "vera@example.com" in m.to]
    # Waiting again (a top-up too small) tells no one twice about the same attempt.
    with djflow._settling():
        services.run_budget_add(run_id=run.id, add_usd=Decimal("0.000001"))
    assert run.status == "budget_exceeded"
    assert Notification.objects.filter(run_id=run.id).count() == 1


def test_the_admin_sets_an_accounts_budget_and_shows_its_spend_per_workflow(
    djflow, priced, admin_user
) -> None:
    from django.test import Client

    djflow.model(reply="ok")
    with djflow._settling():
        services.account_save(name="acme", budget_usd=Decimal("0.15"), period="", user=None)
    run = djflow.start(_document("bx_admin"), account="acme")
    assert run.status == "budget_exceeded"
    client = Client()
    client.force_login(admin_user)
    listed = client.get("/admin/runs/account/").content.decode()
    assert "acme" in listed
    page = client.get("/admin/runs/account/acme/change/").content.decode()
    assert "bx_admin: $" in page and "(1 runs)" in page
    # Raised through the admin as through the API: the run goes on.
    with djflow._settling():
        answer = client.post("/admin/runs/account/acme/change/", {"budget_usd": "5", "period": ""})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert Account.objects.get(name="acme").budget_usd == Decimal("5")
    assert run.status == "completed", run.error
