"""The compare page in headless Chromium, on Django's live server and under the site's
Content-Security-Policy: from the inspector's "Compare with…" form to the page, the changed
step marked, a prompt's folded texts opened. Screenshots go to test-artifacts/."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser import ARTIFACTS, chromium_page, docs_screenshot
from tests.runs.test_compare import OTHER_SECRET, SECRET, classify, document
from tests.runs.test_inspector_browser import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


def test_compare_two_runs_from_the_inspector(page, live_server, django_user_model, djflow) -> None:
    djflow.stub("cmp_flow.classify", side_effect=classify)
    djflow.stub("cmp_flow.polish", returns="polished")
    djflow.stub("cmp_flow.close", returns={"closed": True})
    djflow.define(document(polish=False))
    djflow.define(document(polish=True))
    djflow.model(reply="We will refund you.")
    a = djflow.start("cmp_flow", version=1, input={"question": "refund?", "api_key": SECRET})
    djflow.model(reply="We cannot refund this order, sorry.")
    b = djflow.start("cmp_flow", version=2, input={"question": "refund?", "api_key": OTHER_SECRET})
    assert (a.status, b.status) == ("completed", "completed")

    problems = sign_in(page, live_server, django_user_model)
    page.goto(f"{live_server.url}/runs/{a.id}/")
    page.fill("#compare-with", str(b.id))
    page.click("#compare-submit")
    page.wait_for_selector("table.compare")
    assert page.url == f"{live_server.url}/runs/{a.id}/compare/{b.id}/"
    docs_screenshot(page, "compare")

    draft = page.locator('tbody.step[data-step="draft"]')
    assert draft.get_attribute("data-change") == "changed"
    assert "changed" in draft.locator("td.calls-change").inner_text()
    assert page.locator('tbody.step[data-step="polish"]').get_attribute("data-change") == "added"
    assert page.locator('tbody.step[data-step="classify"]').get_attribute("data-change") == "same"
    # The changed step is marked so it stands out from the same ones.
    changed_bg = draft.locator("tr.step-row").evaluate("row => getComputedStyle(row).background")
    same = page.locator('tbody.step[data-step="classify"] tr.step-row')
    assert changed_bg != same.evaluate("row => getComputedStyle(row).background")

    # The model call's prompt and reply are folded until asked for.
    call = draft.locator("details.call").first
    prompt = call.locator("pre.prompt").first
    assert call.get_attribute("open") is None and not prompt.is_visible()
    call.locator("summary").click()
    assert call.get_attribute("open") is not None
    assert prompt.is_visible() and "Answer refund?" in prompt.inner_text()
    assert "+We cannot refund this order, sorry." in call.locator("pre.diff").inner_text()
    assert "••••" in page.content() and SECRET not in page.content()
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

    page.click("#run-b-link")
    page.wait_for_selector("#run-status")
    assert page.url == f"{live_server.url}/runs/{b.id}/"
    assert problems == []
