"""The run's admin page in headless Chromium at a laptop's 1280 px: its journal (the step
runs' table) fits the page, nothing of it cut off at the right (issue 37)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runs.models import StepRun
from tests.browser import ARTIFACTS, chromium_page
from tests.runs import inspector_scenes as scenes
from tests.runs.test_inspector_browser import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


def test_the_step_runs_table_fits_a_1280_px_window(page, live_server, django_user_model) -> None:
    problems = sign_in(page, live_server, django_user_model)
    run = scenes.failed_run(input={"ticket": "T-1"})
    # What a real journal holds: a worker named by its host, an error naming a URL (no space
    # to break a line at).
    message = (
        "HTTPSConnectionPool(host='api.provider.example.com',port=443):Max_retries_exceeded"
        "_with_url:/v1/chat/completions?request=8f14e45fceea167a5a36dedd4bea2543"
    )
    StepRun.objects.filter(run=run).update(worker="celery@worker-7f9c2d4b1e-host.internal")
    StepRun.objects.filter(run=run, status="failed").update(
        error={"class": "fatal", "message": message}
    )
    page.goto(f"{live_server.url}/admin/runs/run/{run.id}/change/")
    page.screenshot(path=str(ARTIFACTS / "admin_run_1280.png"), full_page=True)
    journal = page.locator(".inline-group table").last
    # Nothing past the window: the page does not scroll sideways, and every cell of the
    # journal, its last column's too, is within the window.
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    boxes = [cell.bounding_box() for cell in journal.locator("td").all()]
    assert max(box["x"] + box["width"] for box in boxes if box is not None) <= 1280
    cost = journal.locator("td.field-cost_usd").first.bounding_box()
    assert cost["x"] + cost["width"] <= 1280
    assert problems == []
