"""The runs list in headless Chromium: sign in, filter by workflow and status, see a bad cost
named on the page, and follow a row into the run's inspector.

Needs Debian's Chromium (``apt-get install -y chromium``); Playwright drives it. Screenshots
go to ``test-artifacts/``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone

from runs.status import RunStatus
from tests.browser import ARTIFACTS, chromium_page, docs_screenshot
from workflows.services import definition_save

from .factories import RunFactory, WorkflowVersionFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-long-password-1"


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


@pytest.fixture
def runs() -> dict[str, Any]:
    """Twelve runs of two workflows over the last hours, in several statuses and accounts."""
    vic = get_user_model().objects.create_user("vic", password=PASSWORD)
    vic.user_permissions.set(Permission.objects.filter(codename="view_run"))
    support = WorkflowVersionFactory()
    nightly = definition_save(
        document={"id": "nightly_report", "steps": [{"id": "a", "kind": "task"}]}
    ).version
    now = timezone.now()
    statuses = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.RUNNING, RunStatus.WAITING]
    made = [
        RunFactory(
            version=nightly if n % 2 else support,
            status=statuses[n % 4],
            account="sales" if n % 3 else "ops",
            correlation=f"crm-{7700 + n}",
            cost_usd=Decimal(n) / 7,
            created_at=now - timedelta(minutes=17 * n),
        )
        for n in range(12)
    ]
    return {
        "all": made,
        "nightly_failed": [
            r for r in made if r.workflow_id == "nightly_report" and r.status == RunStatus.FAILED
        ],
    }


def test_filter_the_runs_and_open_one_in_the_inspector(page, live_server, runs) -> None:
    page.goto(f"{live_server.url}/runs/")
    page.wait_for_url("**/accounts/login/?next=/runs/")
    page.fill("#id_username", "vic")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/runs/")
    assert page.locator("tr[data-run]").count() == 12

    # Filter: one workflow (typed, offered by the list), one status.
    page.fill("#id_workflow", "nightly_report")
    page.select_option("#id_status", "failed")
    page.click("button.primary")
    page.wait_for_url(re.compile(r".*/runs/\?.*workflow=nightly_report.*status=failed.*"))
    expected = [str(run.id) for run in runs["nightly_failed"]]
    rows = page.locator("tr[data-run]")
    assert [rows.nth(i).get_attribute("data-run") for i in range(rows.count())] == expected
    assert set(page.locator("tr[data-run] td.status").all_inner_texts()) == {"Failed"}
    # The form shows the filters in force, and a way to clear them.
    assert page.input_value("#id_workflow") == "nightly_report"
    assert page.is_visible("text=Clear filters")
    page.screenshot(path=str(ARTIFACTS / "runs-list.png"), full_page=True)
    docs_screenshot(page, "runs-list")

    # A bad value is named on the page, not answered with an error page.
    page.fill("#id_cost_min", "-1")
    page.click("button.primary")
    page.wait_for_selector("#problems")
    assert "Cost from (USD): Ensure this value is greater than or equal to 0" in (
        page.inner_text("#problems")
    )
    page.screenshot(path=str(ARTIFACTS / "runs-list-bad-filter.png"), full_page=True)
    page.fill("#id_cost_min", "")
    page.click("button.primary")
    page.wait_for_selector("tr[data-run]")

    # Each row leads into the run's inspector.
    target = expected[0]
    page.click(f"tr[data-run='{target}'] td:first-child a")
    page.wait_for_url(f"**/runs/{target}/")
    assert target in page.content()
