"""The run inspector (``/runs/<id>/``, runs/pages.py) through Django's test client: who may
see it (a stranger gets 404), who may act (a viewer sees no action and is refused 403 when
forging the POST; an operator acts and the audit says so), what it shows (graph, timeline,
attempts, prompts with their differences, secrets masked, tracebacks for operators only) and
that a run of many attempts gives a bounded page."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from runs.models import Run, RunAction, ToolCall
from runs.status import RunStatus
from tests.approvals.builders import start_approval
from tests.runs import inspector_scenes as scenes
from tests.runs.factories import RunFactory, StepRunFactory
from workflows import access

pytestmark = pytest.mark.django_db


def person(username: str, *perms: str) -> Any:
    user = get_user_model().objects.create_user(username=username, password="a-long-pw-1")
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def browser(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def url(run: Run, tail: str = "") -> str:
    return f"/runs/{run.id}/{tail}"


def test_signing_in_is_required() -> None:
    run = RunFactory()
    page = Client().get(url(run))
    assert page.status_code == 302 and page["Location"].startswith("/accounts/login/")
    assert Client().post(url(run, "cancel/")).status_code == 302


def test_a_stranger_gets_404_for_the_page_the_live_part_and_the_actions() -> None:
    run = RunFactory(status=RunStatus.RUNNING)
    eve = browser(person("eve"))
    for answer in (
        eve.get(url(run)),
        eve.get(url(run) + "?part=live"),
        eve.post(url(run, "cancel/")),
        eve.post(url(run, "pause/")),
    ):
        assert answer.status_code == 404
        assert str(run.workflow_id) not in answer.content.decode()
    assert Run.objects.get(id=run.id).status == RunStatus.RUNNING
    assert (
        browser(person("ann")).get("/runs/00000000-0000-0000-0000-000000000000/").status_code == 404
    )


def test_a_viewer_sees_the_run_but_no_actions_and_a_forged_post_is_403() -> None:
    run = scenes.failed_run()
    viewer = person("vic")
    access.grant(access.VIEWER, run.workflow_id, user=viewer)
    client = browser(viewer)
    page = client.get(url(run))
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="graph"' in body and 'id="timeline"' in body
    assert 'id="run-actions"' not in body and "/retry/" not in body
    for action in ("retry", "cancel", "pause", "resume"):
        forged = client.post(url(run, f"{action}/"))
        assert forged.status_code == 403, action
    assert Run.objects.get(id=run.id).status == RunStatus.FAILED
    assert not RunAction.objects.filter(run=run).exists()
    # Tracebacks are for operators (as in the API): the viewer sees the error, not the frames.
    assert "try 3 failed" in body and "FRAME-3" not in body


ACTION_FORM = r'method="post" action="/runs/[^/]+/(\w+)/"'


def test_an_operator_acts_and_the_audit_says_who_did_what() -> None:
    run = RunFactory(status=RunStatus.RUNNING)
    olga = person("olga", "change_run")
    client = browser(olga)
    body = client.get(url(run)).content.decode()
    # The actions are the POST forms (the "Compare with…" form is a GET, for every reader).
    actions = re.findall(ACTION_FORM, body)
    assert actions == ["cancel", "pause"]
    assert 'name="csrfmiddlewaretoken"' in body
    answer = client.post(url(run, "pause/"))
    assert answer.status_code == 302 and answer["Location"] == url(run)
    assert Run.objects.get(id=run.id).status == RunStatus.PAUSED
    body = client.get(url(run)).content.decode()
    assert re.findall(ACTION_FORM, body) == ["cancel", "resume"]
    assert "Run pause recorded." in body
    [row] = re.findall(r'<tr class="audit-row">(.*?)</tr>', body, re.S)
    assert "olga" in row and "pause" in row
    # A move the run's status does not allow is a 409 page, not a 500.
    refused = client.post(url(run, "retry/"))
    assert refused.status_code == 409
    assert "only a failed run can be retried" in refused.content.decode()
    assert client.post(url(run, "explode/")).status_code == 404
    assert client.get(url(run, "cancel/")).status_code == 405


def test_the_csrf_token_is_required() -> None:
    run = RunFactory(status=RunStatus.RUNNING)
    client = Client(enforce_csrf_checks=True)
    client.force_login(person("olga", "change_run"))
    assert client.post(url(run, "cancel/")).status_code == 403
    assert Run.objects.get(id=run.id).status == RunStatus.RUNNING


def test_an_operator_sees_tracebacks_and_what_changed_between_attempts() -> None:
    run = scenes.failed_run()
    body = browser(person("olga", "change_run")).get(url(run)).content.decode()
    assert "FRAME-3" in body
    # Three attempts of draft, each with its call; the third's prompt differs from the second's.
    assert body.count('class="model-call"') == 3
    diff = re.findall(r'<pre class="diff">(.*?)</pre>', body, re.S)
    assert len(diff) == 4  # prompt and reply of attempts 2 and 3
    assert '<span class="d-del">-Draft an answer to ticket 2. Be brief.</span>' in diff[0]
    assert (
        "+Draft an answer to ticket 3. Be brief. &lt;script&gt;alert(1)&lt;/script&gt;" in diff[0]
    )
    assert "<script>alert(1)" not in body
    # Messages are escaped; what a retrieval returned shows.
    assert "try 3 failed &lt;b&gt;badly&lt;/b&gt;" in body
    assert "T-9" in body and "answers" in body
    # Waiting time, run time and the back-off between tries are in the timeline.
    assert body.count('class="backoff"') == 2 and body.count('class="wait"') == 4
    assert 'data-step="draft" data-kind="task" data-status="failed"' in body


def test_secrets_show_masked() -> None:
    token = "[secret:0123456789abcdef0123]"
    run = scenes.finished_run(secrets="sealed")
    Run.objects.filter(id=run.id).update(input={"ticket": "T-1", "key": token})
    run.steps.filter(step_id="classify").update(input={"key": token}, output={"echo": f"k={token}"})
    body = browser(person("olga", "change_run")).get(url(run)).content.decode()
    assert "[secret:" not in body
    assert body.count("••••") >= 3


def test_the_graph_shows_branches_taken_and_statuses() -> None:
    run = scenes.finished_run()
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    nodes = dict(re.findall(r'data-step="(\w+)" data-kind="\w+" data-status="(\w*)"', body))
    assert nodes == {
        "classify": "succeeded",
        "route": "succeeded",
        "triage": "",
        "answer": "succeeded",
        "notify": "succeeded",
        "mail": "succeeded",
        "chat": "succeeded",
        "close": "succeeded",
    }
    assert "condition · took else" in body and "not reached" in body


def test_a_foreach_of_fifty_items_is_one_node_with_counts() -> None:
    run = scenes.foreach_run()
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    assert body.count('data-step="work" data-kind="task"') == 1
    assert 'data-summary="2 failed · 48 succeeded"' in body
    assert "50 items: 2 failed · 48 succeeded" in body


def test_the_live_part_polls_while_the_run_is_live_and_stops_when_it_ends() -> None:
    run = RunFactory(status=RunStatus.RUNNING)
    client = browser(person("root", "view_run"))
    page = client.get(url(run))
    assert page["Cache-Control"].startswith("max-age=0") and "no-store" in page["Cache-Control"]
    assert 'data-live="true"' in page.content.decode()
    assert 'data-refresh="2"' in page.content.decode()
    assert "/static/runs/inspect.js" in page.content.decode()
    part = client.get(url(run) + "?part=live").content.decode()
    assert part.lstrip().startswith('<div id="live" data-live="true"') and "<html" not in part
    Run.objects.filter(id=run.id).update(status=RunStatus.COMPLETED)
    ended = client.get(url(run) + "?part=live").content.decode()
    assert 'data-live="false"' in ended and 'id="live-note"' not in ended


def test_a_run_waiting_for_approval_links_to_its_request() -> None:
    ann = person("ann")
    ann.email = "ann@example.com"
    ann.save()
    run, request = start_approval(users=["ann"])
    assert run.status == RunStatus.PENDING_APPROVAL
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    assert f'href="/approvals/{request.id}/"' in body


def test_a_run_of_thousands_of_attempts_gives_a_bounded_page() -> None:
    run = scenes.many_attempts(3000, value_size=20_000)
    page = browser(person("root", "view_run")).get(url(run))
    assert page.status_code == 200
    body = page.content.decode()
    # 3000 outputs of 20 kB would be 60 MB: the page has 100 of them cut at 4,000 characters.
    assert len(page.content) < 2_500_000, len(page.content)
    assert "Showing the 200 most recent of 3000 attempts" in body
    assert "Showing the 100 most recent of 3000 attempts" in body
    assert body.count('class="attempt-detail') == 100
    assert f'href="/api/v1/runs/{run.id}"' in body
    assert body.count('data-step="work" data-kind="task"') == 1
    assert "3000 succeeded" in body
    # A run this busy is looked at every 10 s, not every 2.
    assert 'data-refresh="10"' in body


# --- retry from a step with an edited input, and its dry run --------------------------------


def rerun(client: Client, run: Run, **form: str) -> Any:
    return client.post(url(run, "retry-from-step/"), form)


def test_the_dry_run_shows_what_would_run_again_and_changes_nothing() -> None:
    run = scenes.failed_run(input={"ticket": "T-1", "lang": "en"})
    client = browser(person("olga", "change_run"))
    page = client.get(url(run)).content.decode()
    assert 'id="rerun-form"' in page
    assert re.findall(r'<option value="(\w*)"', page) == ["", "fetch", "draft", "publish"]
    edited = '{"ticket": "T-2", "lang": "en"}'
    answer = rerun(client, run, from_step="draft", input=edited, mode="preview")
    assert answer.status_code == 200
    body = answer.content.decode()
    assert "Dry run: nothing has changed yet" in body
    again = re.search(r'<dd id="rerun-again">(.*?)</dd>', body, re.S)
    kept = re.search(r'<dd id="rerun-kept">(.*?)</dd>', body, re.S)
    assert again and re.findall(r"<code>(\w+)</code>", again.group(1)) == ["draft", "publish"]
    assert kept and re.findall(r"<code>(\w+)</code>", kept.group(1)) == ["fetch"]
    changes = re.search(r'<table id="rerun-input-changes">(.*?)</table>', body, re.S)
    assert changes and "input.ticket" in changes.group(1)
    assert "&quot;T-1&quot;" in changes.group(1) and "&quot;T-2&quot;" in changes.group(1)
    # What was typed stays in the form.
    assert "T-2" in re.search(r"<textarea[^>]*>(.*?)</textarea>", body, re.S).group(1)
    fresh = Run.objects.get(id=run.id)
    assert (fresh.status, fresh.generation, fresh.input["ticket"]) == ("failed", 1, "T-1")
    assert not RunAction.objects.filter(run=run).exists()


def test_an_operator_retries_from_a_step_with_an_edited_input() -> None:
    run = scenes.failed_run(input={"ticket": "T-1"})
    client = browser(person("olga", "change_run"))
    answer = rerun(client, run, from_step="fetch", input='{"ticket": "T-9"}', mode="retry")
    assert answer.status_code == 302 and answer["Location"] == url(run)
    fresh = Run.objects.get(id=run.id)
    assert (fresh.status, fresh.generation, fresh.input) == ("running", 2, {"ticket": "T-9"})
    [action] = RunAction.objects.filter(run=run)
    assert (action.action, action.actor_name, action.detail["from_step"]) == (
        "retry",
        "olga",
        "fetch",
    )
    body = client.get(url(run)).content.decode()
    assert "Run retried from fetch (generation 2)." in body
    # Running again: no retry form until it ends, and the old attempts are still shown.
    assert 'id="rerun-form"' not in body and 'data-step="draft" data-attempt="3"' in body


def test_an_input_sent_back_unchanged_is_no_edit_and_secrets_stay_masked() -> None:
    token = "[secret:0123456789abcdef0123]"
    run = scenes.failed_run(input={"ticket": "T-1", "key": token}, secrets="sealed")
    client = browser(person("olga", "change_run"))
    page = client.get(url(run)).content.decode()
    shown = re.search(r"<textarea[^>]*>(.*?)</textarea>", page, re.S).group(1)
    assert "••••" in shown and "[secret:" not in page
    answer = rerun(client, run, from_step="draft", input=shown.replace("&quot;", '"'), mode="retry")
    assert answer.status_code == 302
    fresh = Run.objects.get(id=run.id)
    # The stored input (with its token) is untouched: the form's masked copy was no edit.
    assert fresh.input == {"ticket": "T-1", "key": token} and fresh.generation == 2


def test_a_bad_retry_form_is_a_400_naming_the_field() -> None:
    run = scenes.failed_run()
    client = browser(person("olga", "change_run"))
    answer = rerun(client, run, from_step="draft", input="{not json", mode="preview")
    assert answer.status_code == 400
    assert re.search(
        r'id="rerun-errors">.*<code>input</code>: is not JSON', answer.content.decode(), re.S
    )
    answer = rerun(client, run, from_step="nope", input="", mode="preview")
    assert answer.status_code == 400
    assert "<code>from_step</code>: &#x27;nope&#x27; is not a step" in answer.content.decode()
    answer = rerun(client, run, from_step="draft", input="[1, 2]", mode="retry")
    assert answer.status_code == 400 and "must be a JSON object" in answer.content.decode()
    assert Run.objects.get(id=run.id).generation == 1


def test_a_retry_of_a_live_run_is_a_409_and_of_a_run_one_may_not_operate_403_or_404() -> None:
    live = RunFactory(status=RunStatus.RUNNING)
    olga = browser(person("olga", "change_run"))
    answer = rerun(olga, live, from_step="classify", input="", mode="preview")
    assert answer.status_code == 409 and "an ended run can be retried" in answer.content.decode()
    run = scenes.failed_run()
    viewer = person("vic")
    access.grant(access.VIEWER, run.workflow_id, user=viewer)
    vic = browser(viewer)
    assert 'id="rerun-form"' not in vic.get(url(run)).content.decode()
    # Refused before the form is read: a malformed one is refused the same.
    assert rerun(vic, run, from_step="draft", input="{bad", mode="preview").status_code == 403
    assert rerun(vic, run, from_step="draft", input="", mode="retry").status_code == 403
    assert rerun(browser(person("eve")), run, mode="retry").status_code == 404
    assert Run.objects.get(id=run.id).generation == 1


def test_a_body_of_several_steps_is_counted_from_its_body_runs() -> None:
    run = scenes.body_runs(items=3)
    client = browser(person("root", "view_run"))
    body = client.get(url(run)).content.decode()
    summaries = dict(
        re.findall(
            r'data-step="(\w+)" data-kind="\w+" data-status="\w*" data-summary="([^"]*)"', body
        )
    )
    assert summaries["fetch_one"] == "3 succeeded"
    assert summaries["store_one"] == "1 running · 2 succeeded"
    assert summaries["each"] == "3 items: 1 waiting · 2 succeeded"
    # A body run's own page draws its body, not the whole workflow.
    child = Run.objects.filter(parent_run=run).order_by("created_at").first()
    page = client.get(url(child)).content.decode()
    nodes = re.findall(r'data-step="(\w+)" data-kind=', page)
    assert nodes == ["fetch_one", "store_one"]
    assert f'href="/runs/{run.id}/" id="parent-run"' in page


def test_the_page_reads_as_many_queries_for_300_attempts_as_for_3() -> None:
    client = browser(person("root", "view_run"))
    small, large = scenes.many_attempts(3), scenes.many_attempts(300)
    # A first page in this process reads the permissions' content type once more (Django's
    # ContentType cache, per process): warm it, or the count depends on the tests before.
    assert client.get(url(small)).status_code == 200
    counts = []
    for run in (small, large):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url(run)).status_code == 200
        # Read before the next request, which clears the log captured_queries reads lazily.
        counts.append(len(queries))
    # Not an empty capture (0 == 0 would prove nothing): the page read the run and its steps.
    assert counts[0] > 0, counts
    assert counts[0] == counts[1], counts
    assert counts[1] <= 25


def test_nodes_link_to_their_latest_attempt() -> None:
    run = scenes.failed_run()
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    third = run.steps.get(step_id="draft", attempt=3)
    assert re.search(
        rf'data-step="draft" data-kind="task"[^>]*>\s*<title>[^<]*</title>\s*'
        rf'<a href="#attempt-{third.id}"',
        body,
    )
    assert f'id="attempt-{third.id}"' in body
    # A step never reached links nowhere.
    assert not re.search(r'data-step="publish"[^>]*>\s*<title>[^<]*</title>\s*<a ', body)


def test_a_subworkflow_node_leads_to_its_child_run() -> None:
    child_version = scenes.saved({"id": "other", "steps": [{"id": "inner", "kind": "task"}]})
    version = scenes.saved(
        {"id": "parent_flow", "steps": [{"id": "call", "kind": "subworkflow", "workflow": "other"}]}
    )
    run = RunFactory(version=version, status=RunStatus.WAITING)
    step = StepRunFactory(run=run, step_id="call", kind="subworkflow", status="waiting")
    child = RunFactory(version=child_version, parent_run=run, parent_step_run=step, root_run=run)
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    assert re.search(
        rf'data-step="call"[^>]*>\s*<title>[^<]*</title>\s*<a href="/runs/{child.id}/"', body
    )
    assert f'<a href="/runs/{child.id}/">other</a>' in body


def test_tool_calls_show_their_arguments_and_result_masked() -> None:
    token = "[secret:0123456789abcdef0123]"
    run = scenes.finished_run(secrets="sealed")
    step = run.steps.get(step_id="close")
    ToolCall.objects.create(
        step_run=step,
        run_id=run.id,
        server="tickets",
        tool="close_ticket",
        arguments=scenes.content({"id": "T-1", "token": token}),
        result=scenes.content({"is_error": False, "structured": {"closed": True}}),
        status="ok",
        latency_ms=31,
    )
    body = browser(person("root", "view_run")).get(url(run)).content.decode()
    tool = re.search(r'<div class="tool-call">(.*?)</div>', body, re.S)
    assert tool and "tickets.close_ticket" in tool.group(1) and "31 ms" in tool.group(1)
    assert "&quot;token&quot;: &quot;••••&quot;" in tool.group(1)
    assert "&quot;closed&quot;: true" in tool.group(1)
    assert "[secret:" not in body
