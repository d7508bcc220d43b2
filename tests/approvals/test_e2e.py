"""Approvals end to end: a real worker sends the e-mails (the file-based backend, so the
test reads the link from the mail that was sent), Django's live server answers the link,
the inbox and the API, and Chromium clicks the buttons. The concurrency cases send real
concurrent HTTP requests to that server.
"""

from __future__ import annotations

import email
import re
import threading
import time
from collections.abc import Callable, Iterator
from email import policy
from pathlib import Path
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from approvals.models import ApprovalRequest, Decision, Mail
from runs import services
from runs.models import Run, StepRun
from tests.browser import ARTIFACTS, chromium_page, docs_screenshot
from tests.processes import wait_for
from tests.runs.flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.approvals.flows"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")
LINK = re.compile(r"https?://\S+/approvals/link/[^/\s]+/")


@pytest.fixture
def people(transactional_db) -> dict[str, Any]:
    users = get_user_model().objects
    return {
        name: users.create_user(name, f"{name}@example.com", "a-long-password-1")
        for name in ("ann", "bob", "cy")
    }


@pytest.fixture
def mailbox(tmp_path: Path) -> Path:
    folder = tmp_path / "mail"
    folder.mkdir()
    return folder


@pytest.fixture
def worker(celery_processes, live_server, mailbox: Path, people, settings) -> Any:
    """A worker that sends mail to files in ``mailbox``, with links to the live server.
    Reminders may come every second (the nudge flow), here and in the worker."""
    ensure_effects_table()
    settings.DJFLOW = {**settings.DJFLOW, "MIN_REMIND_MS": 1_000}
    return celery_processes.worker(
        workflow_modules=FLOWS,
        env={
            "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
            "EMAIL_FILE_PATH": str(mailbox),
            "SITE_URL": live_server.url,
            "DJFLOW_RECONCILE_SECONDS": "2",
            "DJFLOW_MIN_REMIND_MS": "1000",
        },
        concurrency=4,
    )


def start(workflow: str, input: dict[str, Any]) -> Run:
    return services.run_start(workflow=workflow, input=input).run


def status_of(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(id=run.id)


def until_pending(run: Run, logs: Callable[[], str]) -> None:
    wait_for(lambda: status_of(run) == "pending_approval", timeout=20, message=logs)


def ended(run: Run, logs: Callable[[], str], timeout: float = 30.0) -> Run:
    def done() -> Run | None:
        fresh = Run.objects.get(id=run.id)
        return fresh if fresh.status in TERMINAL else None

    return wait_for(done, timeout=timeout, interval=0.1, message=logs)


def mails(mailbox: Path) -> list[email.message.EmailMessage]:
    """Every message the file-based backend wrote (one file per connection, messages
    separated by a line of dashes)."""
    found = []
    for path in sorted(mailbox.glob("*.log")):
        for chunk in path.read_text().split("-" * 79):
            if chunk.strip():
                found.append(email.message_from_string(chunk.strip(), policy=policy.default))
    return found


def link_in_mail(mailbox: Path, to: str, run: Run, logs: Callable[[], str]) -> str:
    """The approval link sent to ``to`` for ``run``, read from the mail's text part."""
    request = ApprovalRequest.objects.get(run=run)

    def find() -> str | None:
        for message in mails(mailbox):
            if message["To"] != to:
                continue
            text = message.get_body(("plain",)).get_content()
            html = message.get_body(("html",)).get_content()
            match = LINK.search(text)
            if match and request.message in text and match.group(0) in html:
                return match.group(0)
        return None

    return wait_for(find, timeout=20, interval=0.2, message=logs)


# --- the browser ---------------------------------------------------------------------------


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


@pytest.mark.browser
def test_approve_from_the_emailed_link_in_a_browser(
    worker, page, mailbox, celery_processes
) -> None:
    run = start("release", {"version": "2.4", "changes": ["faster"]})
    wait_for(
        lambda: status_of(run) == "pending_approval", timeout=20, message=celery_processes.logs
    )
    link = link_in_mail(mailbox, "ann@example.com", run, celery_processes.logs)

    # ann is a user of the site: her link asks her to sign in, then comes back to it.
    page.goto(link)
    assert "/accounts/login/" in page.url
    assert "Ship release" not in page.locator("body").inner_text()
    page.fill("input[name=username]", "ann")
    page.fill("input[name=password]", "a-long-password-1")
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.url == link
    body = page.locator("body")
    assert "Ship release 2.4?" in body.inner_text()
    assert "faster" in body.inner_text()  # the details: the draft step's output
    page.screenshot(path=str(ARTIFACTS / "approval-confirm.png"), full_page=True)
    docs_screenshot(page, "approval")
    # Opening the page decided nothing.
    assert status_of(run) == "pending_approval"
    assert not Decision.objects.filter(request__run=run).exists()

    page.fill("textarea[name=comment]", "ship it")
    page.click("button[value=approved]")
    page.wait_for_load_state()
    assert "approved" in page.locator("body").inner_text().lower()
    page.screenshot(path=str(ARTIFACTS / "approval-approved.png"), full_page=True)

    run = ended(run, celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output["approval"] == {"decision": "approved", "by": "ann", "comment": "ship it"}
    assert [step for step, *_ in effects(run.id)] == ["draft", "ship"]
    decision = Decision.objects.get(request__run=run)
    assert (decision.channel, decision.by, decision.ip) == ("link", "ann", "127.0.0.1")
    assert decision.user.username == "ann"
    assert "Chrome" in decision.user_agent and decision.token_id is not None

    # The same link again: already used, a clear page, nothing changes.
    page.goto(link)
    assert "already" in page.locator("body").inner_text().lower()
    assert Decision.objects.filter(request__run=run).count() == 1


@pytest.mark.browser
def test_reject_with_a_comment_from_the_emailed_link_in_a_browser(
    worker, page, mailbox, celery_processes
) -> None:
    run = start("release", {"version": "3.0"})
    wait_for(
        lambda: status_of(run) == "pending_approval", timeout=20, message=celery_processes.logs
    )
    link = link_in_mail(mailbox, "ops@example.com", run, celery_processes.logs)

    page.goto(link)
    assert "Ship release 3.0?" in page.locator("body").inner_text()
    page.screenshot(path=str(ARTIFACTS / "approval-confirm-reject.png"), full_page=True)
    page.fill("textarea[name=comment]", "not before the freeze ends")
    page.click("button[value=rejected]")
    page.wait_for_load_state()
    assert "rejected" in page.locator("body").inner_text().lower()
    page.screenshot(path=str(ARTIFACTS / "approval-rejected.png"), full_page=True)

    run = ended(run, celery_processes.logs)
    assert (run.status, run.error["class"], run.error["step"]) == ("failed", "rejected", "gate")
    assert "not before the freeze ends" in run.error["message"]
    assert [step for step, *_ in effects(run.id)] == ["draft"]  # ship never ran
    assert Decision.objects.get(request__run=run).by == "ops@example.com"


# --- concurrent requests against the running server -----------------------------------------


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls in threads released at one moment; their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        results[index] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def signed_in(link: str, username: str) -> requests.Session:
    """A browser session signed in as ``username`` on the server ``link`` points at."""
    client = requests.Session()
    login = f"{link.split('/approvals/')[0]}/accounts/login/"
    form = client.get(login, timeout=20)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    done = client.post(
        login,
        data={"csrfmiddlewaretoken": token, "username": username, "password": "a-long-password-1"},
        timeout=20,
    )
    assert done.ok and "sessionid" in client.cookies, done.text[:300]
    return client


def form_poster(link: str, username: str | None = None) -> Callable[[str], requests.Response]:
    """GET the link page as a browser would (cookie and CSRF token), then a function that
    POSTs the form with a decision; signed in as ``username`` for a user's link."""
    client = signed_in(link, username) if username else requests.Session()
    page = client.get(link, timeout=20)
    assert page.status_code == 200, page.text[:500]
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)

    def post(decision: str) -> requests.Response:
        return client.post(
            link,
            data={"csrfmiddlewaretoken": token, "decision": decision, "comment": ""},
            timeout=20,
        )

    return post


class Api:
    """A user's API client against the live server."""

    def __init__(self, live_server: Any, user: Any) -> None:
        token, _ = Token.objects.get_or_create(user=user)
        self.base = f"{live_server.url}/api/v1"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Token {token.key}"

    def post(self, path: str, json: Any) -> requests.Response:
        return self.session.post(f"{self.base}{path}", json=json, timeout=20)


def api_client(live_server: Any, user: Any) -> Api:
    return Api(live_server, user)


def test_two_approvers_clicking_at_the_same_moment_give_one_outcome(
    worker, mailbox, celery_processes
) -> None:
    for attempt in range(3):
        run = start("release", {"version": f"5.{attempt}"})
        until_pending(run, celery_processes.logs)
        posters = [
            form_poster(
                link_in_mail(mailbox, f"{name}@example.com", run, celery_processes.logs), name
            )
            for name in ("ann", "bob")
        ]
        answers = together([lambda p=p: p("approved") for p in posters])
        codes = sorted(answer.status_code for answer in answers)
        assert codes == [200, 409], [a.text[:300] for a in answers]
        run = ended(run, celery_processes.logs)
        assert run.status == "completed", run.error
        assert Decision.objects.filter(request__run=run).count() == 1
        assert StepRun.objects.filter(run=run, step_id="ship").count() == 1
        assert [step for step, *_ in effects(run.id)] == ["draft", "ship"]


def test_a_form_submitted_twice_at_once_counts_once(worker, mailbox, celery_processes) -> None:
    run = start("release", {"version": "6.0"})
    until_pending(run, celery_processes.logs)
    post = form_poster(link_in_mail(mailbox, "bob@example.com", run, celery_processes.logs), "bob")
    answers = together([lambda: post("approved"), lambda: post("approved")])
    codes = sorted(answer.status_code for answer in answers)
    assert codes[0] == 200 and codes[1] in (409, 410), [a.text[:300] for a in answers]
    run = ended(run, celery_processes.logs)
    assert run.status == "completed"
    assert Decision.objects.filter(request__run=run).count() == 1
    assert [step for step, *_ in effects(run.id)] == ["draft", "ship"]


def test_quorum_two_of_three_through_the_api_at_once(
    worker, live_server, people, celery_processes
) -> None:
    run = start("pair", {"pr": 42})
    until_pending(run, celery_processes.logs)
    request = ApprovalRequest.objects.get(run=run)
    clients = [api_client(live_server, people[name]) for name in ("ann", "bob", "cy")]
    answers = together(
        [lambda c=c: c.post(f"/approvals/{request.id}/approve", json={}) for c in clients]
    )
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200, 200, 409], [a.text[:300] for a in answers]
    run = ended(run, celery_processes.logs)
    assert run.status == "completed", run.error
    assert Decision.objects.filter(request=request).count() == 2
    assert [step for step, *_ in effects(run.id)] == ["merge"]


def test_a_decision_racing_the_deadline_timer_has_one_outcome(
    worker, live_server, people, celery_processes, celery_beat
) -> None:
    celery_beat(env={"DJFLOW_RECONCILE_SECONDS": "2"})
    client = api_client(live_server, people["ann"])
    outcomes = []
    for n in range(6):
        run = start("hurry", {"n": n})
        until_pending(run, celery_processes.logs)
        request = ApprovalRequest.objects.get(run=run)
        # Aim the decision at the deadline: a little before, at, and after it.
        aim = request.deadline.timestamp() + (n - 3) * 0.2
        time.sleep(max(0.0, aim - time.time()))
        answer = client.post(f"/approvals/{request.id}/approve", json={"comment": f"n={n}"})
        run = ended(run, celery_processes.logs)
        request.refresh_from_db()
        gate = StepRun.objects.get(run=run, step_id="gate")
        decided = Decision.objects.filter(request=request).count()
        if answer.status_code == 200:
            assert (request.status, gate.status, run.status, decided) == (
                "approved",
                "succeeded",
                "completed",
                1,
            )
            assert [step for step, *_ in effects(run.id)] == ["after"]
        else:
            assert answer.status_code == 409, answer.text
            assert (request.status, gate.status, decided) == ("expired", "timed_out", 0)
            assert (run.status, run.error["class"]) == ("failed", "timeout")
            assert effects(run.id) == []
        outcomes.append(answer.status_code)
    # Both sides of the race were exercised.
    assert 200 in outcomes and 409 in outcomes, outcomes


# --- durable time and nesting on the real worker and beat --------------------------------------


def test_reminders_then_escalation_then_the_run_goes_on(
    worker, mailbox, people, celery_processes, celery_beat
) -> None:
    celery_beat(env={"DJFLOW_RECONCILE_SECONDS": "2"})
    run = start("nudge", {"what": "the budget"})
    until_pending(run, celery_processes.logs)
    request = ApprovalRequest.objects.get(run=run)
    run = ended(run, celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"gate": "timeout"}
    request.refresh_from_db()
    # Reminders are due at 1, 2 and 3 s; the last one races the 3.5 s deadline on the
    # 1 s tick, and one that fires after the request expired mails nobody.
    reminded = Mail.objects.filter(kind="reminder", approver__request=request).count() // 2
    assert request.status == "expired" and reminded in (2, 3), reminded
    assert request.escalated_at is not None

    def sent() -> list[tuple[str, str]]:
        return sorted((str(m["To"]), str(m["Subject"])) for m in mails(mailbox))

    # Every mail goes out: the requests, the reminders to each, and the escalation.
    total = 2 * (1 + reminded) + 1
    got = wait_for(
        lambda: len(sent()) == total and sent(), timeout=20, message=celery_processes.logs
    )
    to = [address for address, _ in got]
    assert to.count("ann@example.com") == to.count("ops@example.com") == 1 + reminded
    assert to.count("cy@example.com") == 1
    escalation = next(subject for address, subject in got if address == "cy@example.com")
    assert "expired" in escalation.lower()
    assert people["cy"].notifications.get().kind == "escalation"


def test_approvals_inside_foreach_items_decided_through_the_api(
    worker, live_server, people, celery_processes
) -> None:
    run = start("batch", {"bills": ["gas", "rent", "water"]})
    until_pending(run, celery_processes.logs)
    requests_ = wait_for(
        lambda: (
            len(ApprovalRequest.objects.filter(run=run)) == 3
            and list(ApprovalRequest.objects.filter(run=run).order_by("path"))
        ),
        timeout=20,
    )
    assert [r.message for r in requests_] == ["Pay gas?", "Pay rent?", "Pay water?"]
    client = api_client(live_server, people["ann"])
    for request in reversed(requests_):
        answer = client.post(f"/approvals/{request.id}/approve", json={"comment": request.path})
        assert answer.status_code == 200, answer.text
    run = ended(run, celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == ["each[0]/", "each[1]/", "each[2]/"]
    assert [step for step, *_ in effects(run.id)] == ["pay"]


def test_an_approval_inside_a_subworkflow_decided_from_its_link(
    worker, mailbox, people, celery_processes
) -> None:
    run = start("contract", {"doc": "NDA"})
    child = wait_for(lambda: Run.objects.filter(parent_run=run).first(), timeout=20)
    until_pending(child, celery_processes.logs)
    until_pending(run, celery_processes.logs)  # the parent waits for people too
    post = form_poster(
        link_in_mail(mailbox, "bob@example.com", child, celery_processes.logs), "bob"
    )
    assert post("approved").status_code == 200
    run = ended(run, celery_processes.logs)
    assert (run.status, run.output) == ("completed", "bob"), run.error
    assert Run.objects.get(id=child.id).status == "completed"


@pytest.mark.browser
def test_a_handoff_shows_in_the_header_and_the_inbox_decides_in_a_browser(
    worker, page, live_server, people, celery_processes
) -> None:
    from django.contrib.auth.models import Group

    Group.objects.create(name="oncall").user_set.add(people["bob"])
    run = start("oncall", {"host": "db-2"})
    until_pending(run, celery_processes.logs)  # the hand-off did not block the run

    page.goto(f"{live_server.url}/approvals/")
    page.fill("input[name=username]", "bob")
    page.fill("input[name=password]", "a-long-password-1")
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.locator("#unread-count").inner_text() == "1"
    assert "Wipe /tmp on db-2?" in page.locator("main").inner_text()
    page.screenshot(path=str(ARTIFACTS / "approvals-inbox.png"), full_page=True)

    page.click("a[href$='/notifications/']")
    assert "Disk full on db-2" in page.locator("main").inner_text()
    page.screenshot(path=str(ARTIFACTS / "notifications.png"), full_page=True)
    page.click("text=Mark as read")
    page.wait_for_load_state()
    assert page.locator("#unread-count").count() == 0
    assert people["bob"].notifications.get().read_at is not None

    page.goto(f"{live_server.url}/approvals/")
    page.click("#pending a:text('wipe')")
    page.fill("textarea[name=comment]", "go")
    page.click("button[value=approved]")
    page.wait_for_load_state()
    run = ended(run, celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"decision": "approved", "by": "bob", "comment": "go"}
    assert Decision.objects.get(request__run=run).channel == "inbox"
