"""Review of the run inspector (issue 16): what a viewer of a run must not learn from its page
(the ids of runs below it that they may not see), and bounds."""

from __future__ import annotations

import pytest

from runs.models import Run
from runs.status import RunStatus
from tests.approvals.builders import start_approval
from tests.runs import inspector_scenes as scenes
from tests.runs.factories import RunFactory, StepRunFactory
from tests.runs.test_inspector import browser, person, url
from workflows import access

pytestmark = pytest.mark.django_db


def test_a_subworkflow_node_does_not_link_to_a_child_run_the_viewer_may_not_see() -> None:
    child_version = scenes.saved({"id": "hidden", "steps": [{"id": "inner", "kind": "task"}]})
    version = scenes.saved(
        {"id": "seen", "steps": [{"id": "call", "kind": "subworkflow", "workflow": "hidden"}]}
    )
    run = RunFactory(version=version, status=RunStatus.WAITING)
    step = StepRunFactory(run=run, step_id="call", kind="subworkflow", status="waiting")
    child = RunFactory(version=child_version, parent_run=run, parent_step_run=step, root_run=run)
    vera = person("vera")
    access.grant("viewer", "seen", user=vera)
    client = browser(vera)
    assert client.get(url(child)).status_code == 404
    body = client.get(url(run)).content.decode()
    assert str(child.id) not in body


def test_a_pending_approval_of_a_child_run_the_viewer_may_not_see_is_not_linked() -> None:
    ann = person("ann")
    ann.email = "ann@example.com"
    ann.save()
    child, request = start_approval(users=["ann"])
    parent_version = scenes.saved(
        {"id": "outer", "steps": [{"id": "call", "kind": "subworkflow", "workflow": "expense"}]}
    )
    parent = RunFactory(version=parent_version, status=RunStatus.WAITING)
    step = StepRunFactory(run=parent, step_id="call", kind="subworkflow", status="waiting")
    type(child).objects.filter(id=child.id).update(
        parent_run=parent, parent_step_run=step, root_run=parent
    )
    vera = person("vera")
    access.grant("viewer", "outer", user=vera)
    client = browser(vera)
    assert client.get(url(child)).status_code == 404
    body = client.get(url(parent)).content.decode()
    assert str(request.id) not in body and 'id="waiting-links"' not in body


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"ticket": "\\ud800"}', "input.ticket"),
        ('{"ticket": "a\\u0000b"}', "input.ticket"),
        ('{"ticket": NaN}', "input"),
        ('{"ticket": Infinity}', "input"),
        ('{"ticket": -1e999}', "input"),
        ('{"ticket": ' + "[" * 5_000 + "]" * 5_000 + "}", "input"),
        ("[" * 100_000, "input"),
    ],
    ids=["lone-surrogate", "nul", "nan", "infinity", "overflow", "deep", "deep-unclosed"],
)
@pytest.mark.parametrize("mode", ["preview", "retry"])
def test_retry_form_input_the_api_refuses_is_a_400_naming_it_not_a_500(
    text: str, named: str, mode: str
) -> None:
    # The API's parser (config.parsers) refuses these; the form parses the same JSON itself.
    run = scenes.failed_run(input={"ticket": "T-1"})
    client = browser(person("olga", "change_run"))
    answer = client.post(
        url(run, "retry-from-step/"), {"from_step": "draft", "input": text, "mode": mode}
    )
    assert answer.status_code == 400
    assert f"<code>{named}</code>: " in answer.content.decode()
    assert Run.objects.get(id=run.id).generation == 1


# --- the runs list ---------------------------------------------------------------------------


def test_a_date_with_any_offset_python_reads_is_a_filter_or_a_400_not_a_500() -> None:
    # Python reads offsets up to ±23:59, Postgres' timestamptz up to ±15:59.
    client = browser(person("vic", "view_run"))
    run = RunFactory()
    answer = client.get("/runs/", {"created_after": "2000-01-01T00:00:00+23:59"})
    assert answer.status_code == 200 and str(run.id) in answer.content.decode()
    answer = client.get("/runs/", {"created_before": "2000-01-01T00:00:00-23:59"})
    assert answer.status_code == 200 and str(run.id) not in answer.content.decode()
    # The same instants past the calendar's ends: named, not listed.
    for name, value in (
        ("created_before", "9999-12-31T23:59:59-23:59"),
        ("created_after", "0001-01-01T00:00:00+23:59"),
    ):
        answer = client.get("/runs/", {name: value})
        assert answer.status_code == 400
        assert "Enter a date and time" in answer.content.decode()


@pytest.mark.parametrize("mode", [None, "", "go", "Retry"])
def test_a_retry_form_without_its_mode_retries_nothing(mode: str | None) -> None:
    # A script's POST that leaves the button out is a 400, never a retry.
    run = scenes.failed_run(input={"ticket": "T-1"})
    client = browser(person("olga", "change_run"))
    form = {"from_step": "draft", "input": ""}
    if mode is not None:
        form["mode"] = mode
    answer = client.post(url(run, "retry-from-step/"), form)
    assert answer.status_code == 400
    assert "<code>mode</code>: must be &#x27;preview&#x27; or &#x27;retry&#x27;" in (
        answer.content.decode()
    )
    assert Run.objects.get(id=run.id).generation == 1
