"""The run inspector in headless Chromium (Debian's, driven by Playwright), on Django's live
server and under the site's Content-Security-Policy: a finished run, a failed run with
retries, a run waiting for approval (its link leads to the request), a foreach of 50 items,
and a live run that a real worker moves on while the page is open (the page follows without
reloading, and stops asking once the run has ended). Screenshots go to test-artifacts/."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from runs import services
from runs.models import Run
from tests.approvals.builders import start_approval
from tests.browser import ARTIFACTS, chromium_page, docs_screenshot
from tests.processes import wait_for
from tests.runs import inspector_scenes as scenes

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-long-password-1"


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


def sign_in(page: Any, live_server: Any, django_user_model: Any) -> list[str]:
    """Sign in as a superuser; returns the list the page's CSP violations, uncaught script
    errors and failed loads go to."""
    django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    problems: list[str] = []
    page.on(
        "console",
        lambda m: problems.append(m.text) if "Content Security" in m.text else None,
    )
    page.on("pageerror", lambda error: problems.append(str(error)))
    # Every file the pages load (the inspector's style sheet and script, the icon) is found.
    page.on(
        "response",
        lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None,
    )
    page.goto(f"{live_server.url}/accounts/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_load_state()
    return problems


def node(page: Any, step: str) -> Any:
    return page.locator(f'svg.graph g.node[data-step="{step}"]')


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"inspector_{name}.png"), full_page=True)


def test_finished_failed_waiting_and_foreach_runs(page, live_server, django_user_model) -> None:
    problems = sign_in(page, live_server, django_user_model)

    finished = scenes.finished_run()
    page.goto(f"{live_server.url}/runs/{finished.id}/")
    assert page.inner_text("#run-status") == "completed"
    assert page.get_attribute("#live", "data-live") == "false"
    assert page.locator("svg.graph g.node").count() == 8
    assert node(page, "answer").get_attribute("data-status") == "succeeded"
    assert node(page, "triage").get_attribute("class") == "node s-none"
    assert page.locator("svg.timeline g.attempt").count() == 7
    # The graph is drawn in the page, boxes laid out top to bottom.
    classify, close = node(page, "classify").bounding_box(), node(page, "close").bounding_box()
    assert classify["y"] + classify["height"] < close["y"]
    assert page.locator("#run-actions button").count() == 0  # ended: nothing to do
    shot(page, "finished")
    docs_screenshot(page, "inspector")

    failed = scenes.failed_run(input={"ticket": "T-1"})
    page.goto(f"{live_server.url}/runs/{failed.id}/")
    assert page.inner_text("#run-status") == "failed"
    assert "the model refused" in page.inner_text("#run-error")
    assert node(page, "draft").get_attribute("data-status") == "failed"
    assert node(page, "publish").get_attribute("data-status") == ""
    assert page.locator("svg.timeline rect.backoff").count() == 2
    # Retry asks first (issue 37): its question opens from the summary.
    assert page.locator("#run-actions summary").all_inner_texts() == ["Retry…"]
    third = page.locator('details.attempt-detail[data-step="draft"][data-attempt="3"]')
    # The graph's node leads to its latest attempt, opened.
    assert third.get_attribute("open") is None
    node(page, "draft").locator("a").click()
    page.wait_for_selector('details.attempt-detail[data-step="draft"][data-attempt="3"][open]')
    diff = third.locator("pre.diff").first
    assert diff.is_visible()
    # The injected markup is text in the diff, never markup in the page.
    assert "<script>alert(1)</script>" in diff.inner_text()
    assert page.locator("pre.diff script").count() == 0
    assert "FRAME-3" in third.locator("pre.traceback").inner_text()
    shot(page, "failed_retries")
    # A dry run of a retry from draft with an edited input: what would run again, nothing done.
    assert not page.is_visible("#rerun-form")  # folded until asked for
    page.click("#rerun > summary")
    page.select_option("#rerun-step", "draft")
    page.fill("#rerun-input", '{"ticket": "T-2"}')
    page.click("#rerun-preview")
    page.wait_for_selector("#rerun-dry-run")
    assert page.inner_text("#rerun-again") == "draft, publish"
    assert page.inner_text("#rerun-kept") == "fetch"
    assert "input.ticket" in page.inner_text("#rerun-input-changes")
    assert page.input_value("#rerun-input") == '{"ticket": "T-2"}'
    shot(page, "retry_dry_run")
    assert Run.objects.values_list("generation", flat=True).get(id=failed.id) == 1

    waiting, request = start_approval(users=["root"])
    page.goto(f"{live_server.url}/runs/{waiting.id}/")
    assert page.inner_text("#run-status") == "pending_approval"
    assert page.get_attribute("#live", "data-live") == "true"
    link = page.locator("#waiting-links a")
    assert link.get_attribute("href") == f"/approvals/{request.id}/"
    assert node(page, "sign_off").get_attribute("data-status") == "waiting"
    shot(page, "waiting_approval")
    docs_screenshot(page, "inspector-waiting-approval")
    link.click()
    page.wait_for_url(f"**/approvals/{request.id}/")
    assert page.locator("button.approve").count() == 1

    fanout = scenes.foreach_run(items=50, failed=(7, 31))
    page.goto(f"{live_server.url}/runs/{fanout.id}/")
    assert node(page, "work").count() == 1
    assert node(page, "work").get_attribute("data-summary") == "2 failed · 48 succeeded"
    assert "50 items: 2 failed · 48 succeeded" in node(page, "each").text_content()
    assert page.locator("svg.timeline g.attempt").count() == 53
    shot(page, "foreach_50")
    page.locator("#graph").screenshot(path=str(ARTIFACTS / "inspector_foreach_50_graph.png"))
    assert problems == []


@pytest.mark.slow
def test_a_live_run_updates_without_reloading(
    page, live_server, django_user_model, celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=["workflows.examples.support_ticket"])
    run = services.run_start(workflow="support_ticket", input={"ticket": "B: it crashes"}).run

    def status() -> str:
        return Run.objects.values_list("status", flat=True).get(id=run.id)

    wait_for(lambda: status() == "waiting", timeout=30, message=celery_processes.logs)
    problems = sign_in(page, live_server, django_user_model)
    page.goto(f"{live_server.url}/runs/{run.id}/")
    assert page.inner_text("#run-status") == "waiting"
    assert node(page, "approval").get_attribute("data-status") == "waiting"
    assert node(page, "send").get_attribute("data-status") == ""
    # A mark in the page's memory: gone if the page were reloaded.
    page.evaluate("window.__stayed = 42")
    page.locator('details.attempt-detail[data-step="classify"] summary').click()
    polls: list[float] = []
    page.on("request", lambda r: polls.append(time.monotonic()) if "part=live" in r.url else None)

    services.event_send(name="approved", key="B: it crashes", payload={"ok": True})
    # (Not wait_for_function: the page's CSP allows no eval, rightly.)
    page.wait_for_selector("#run-status.s-completed", timeout=30_000)
    assert page.evaluate("window.__stayed") == 42
    assert node(page, "send").get_attribute("data-status") == "succeeded"
    assert page.get_attribute("#live", "data-live") == "false"
    # What the reader opened stays open across refreshes.
    assert page.locator('details.attempt-detail[data-step="classify"]').get_attribute("open") == ""
    shot(page, "live_completed")
    # The ended run's page asks no more.
    asked = len(polls)
    page.wait_for_timeout(4_500)
    assert len(polls) == asked
    assert problems == []
