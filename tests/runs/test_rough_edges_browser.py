"""The rough edges a new user met on the run page in their first hour (issue 37), in headless
Chromium under the site's Content-Security-Policy: a condition without ``else`` draws no empty
box, the page's attempts are the API's, an approval shows in the audit and waits (not runs)
on the timeline, Cancel asks before it acts, and every page has its icon (no 404)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from approvals.models import ApprovalRequest
from runs.models import Run
from runs.services import run_start
from runs.status import RunStatus
from tests.browser import ARTIFACTS, chromium_page
from tests.runs.test_inspector_browser import sign_in
from workflows.services import definition_save

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# A condition with no else, whose then holds an approval: the first hour's run.
DOCUMENT = {
    "id": "refund",
    "steps": [
        {
            "id": "check",
            "kind": "condition",
            "if": {"path": "input.amount", "op": "exists"},
            "then": [
                {
                    "id": "sign_off",
                    "kind": "approval",
                    "approvers": {"users": ["root"]},
                    "message": "Refund ${input.amount}?",
                }
            ],
        }
    ],
}


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


def start() -> Run:
    run = run_start(workflow="refund", input={"amount": 30}).run
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING_APPROVAL
    return run


def test_the_first_hours_run_page(page, live_server, django_user_model) -> None:
    problems = sign_in(page, live_server, django_user_model)
    definition_save(document=DOCUMENT)
    run = start()
    page.goto(f"{live_server.url}/runs/{run.id}/")
    page.wait_for_timeout(300)  # the icon's request

    # 5. The page names its icon, and /favicon.ico answers (a 404 on every page before).
    assert page.get_attribute("link[rel=icon]", "href") == "/favicon.ico"
    icon = page.request.get(f"{live_server.url}/favicon.ico")
    assert icon.status == 200 and icon.body()[:4] == b"\x00\x00\x01\x00"

    # 1. No frame for the missing else, only its labelled line; every arrow ends on a box.
    assert page.locator("svg.graph rect.frame").count() == 1
    assert page.locator("svg.graph text.lane").all_text_contents() == ["then", "else"]
    assert page.locator("svg.graph text.bypass").text_content() == "else"

    # 4. Cancel asks first: its button is hidden until the question is opened.
    yes = page.locator("#confirm-cancel button[type=submit]")
    assert not yes.is_visible()
    page.click("#confirm-cancel > summary")
    assert yes.is_visible() and "Cancel this run?" in page.inner_text("#confirm-cancel")
    shot = ARTIFACTS / "rough_edges_confirm_cancel.png"
    page.screenshot(path=str(shot), full_page=True)
    assert Run.objects.get(id=run.id).status == RunStatus.PENDING_APPROVAL

    # 3. An approval decided in the inbox shows in the audit, and its bar says it waited.
    request = ApprovalRequest.objects.get(run=run)
    page.goto(f"{live_server.url}/approvals/{request.id}/")
    page.click("button.approve")
    page.wait_for_load_state()
    page.goto(f"{live_server.url}/runs/{run.id}/")
    audit = page.inner_text("#audit")
    assert "No one has acted" not in audit
    row = page.locator("#audit tr.audit-row").first.inner_text()
    assert "root" in row and "approval approved" in row and "sign_off" in row
    bar = page.locator('svg.timeline g.attempt[data-step="sign_off"] rect.run')
    assert bar.get_attribute("class") == "run waited"
    title = page.locator('svg.timeline g.attempt[data-step="sign_off"] title').text_content()
    assert "waited" in title and "ran" not in title
    summary = page.locator('details.attempt-detail[data-step="sign_off"] summary').inner_text()
    assert "waited" in summary and "ran" not in summary
    page.screenshot(path=str(ARTIFACTS / "rough_edges_approved.png"), full_page=True)

    # 2. The page's attempts are the API's, and its journal rows the API's steps_total.
    api = page.request.get(f"{live_server.url}/api/v1/runs/{run.id}").json()
    assert page.inner_text("#run-attempts") == str(api["attempts"])
    assert page.inner_text("#run-journal-rows") == str(api["steps_total"])

    # 4. The question's button acts.
    other = start()
    page.goto(f"{live_server.url}/runs/{other.id}/")
    page.click("#confirm-cancel > summary")
    page.click("#confirm-cancel button[type=submit]")
    page.wait_for_selector("#run-status.s-cancelled")
    assert problems == []
