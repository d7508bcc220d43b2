"""Two runs compared step by step (``runs.compare``, the page ``/runs/<a>/compare/<b>/``),
on runs the ``djflow`` fixture really ran: the same workflow at two versions (the second adds
a step), its recipe's model answering differently in each, a secret in the input, a step
retried from in one of them. Who may see the page (both runs, else 404), what it shows."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client, TestCase
from django.test.utils import CaptureQueriesContext

from runs import compare as compare_module
from runs.compare import (
    ADDED,
    CHANGED,
    REMOVED,
    SAME,
    compare,
    document_order,
    step_order,
    text_diff,
)
from runs.engine import calls
from runs.models import Run
from runs.services import run_retry
from tests.conftest import team_permissions
from workflows import access
from workflows.errors import NotFound
from workflows.secrets import TOKEN

SECRET = "sk-live-4f9a2c7e1b"
OTHER_SECRET = "sk-live-0000000000"

SCHEMA = {
    "type": "object",
    "required": ["question", "api_key"],
    "properties": {
        "question": {"type": "string"},
        "api_key": {"type": "string", "writeOnly": True},
    },
}


def document(*, polish: bool) -> dict[str, Any]:
    """The workflow ``cmp_flow``; with ``polish``, its next version, one step more."""
    steps: list[dict[str, Any]] = [
        {
            "id": "classify",
            "kind": "task",
            "input": {"question": "${input.question}", "key": "${input.api_key}"},
        },
        {
            "id": "draft",
            "kind": "recipe",
            # A recipe's ${input} is its step's input.
            "input": {"question": "${input.question}"},
            "prompt": "Answer ${input.question}",
            "model": "openai:gpt-4o-mini",
        },
    ]
    if polish:
        steps.append({"id": "polish", "kind": "task", "input": "${steps.draft.output}"})
    steps.append({"id": "close", "kind": "task"})
    return {
        "id": "cmp_flow",
        "input_schema": SCHEMA,
        "limits": {"run_timeout_ms": 600_000},
        "steps": steps,
        "output": {"draft": "${steps.draft.output}", "tier": "${steps.classify.output.tier}"},
    }


def classify(ctx: Any, given: Any) -> Any:
    # Echoes the secret: the engine stores it as the run's token, pages show ••••.
    return {"tier": "gold", "echo": given["key"]}


@pytest.fixture
def two_runs(djflow) -> tuple[Run, Run]:
    """Run a on version 1, the model answering "We will refund you."; run b on version 2
    (``polish`` added), another secret, the model answering otherwise."""
    djflow.stub("cmp_flow.classify", side_effect=classify)
    djflow.stub("cmp_flow.polish", returns="polished")
    djflow.stub("cmp_flow.close", returns={"closed": True})
    djflow.define(document(polish=False))
    djflow.define(document(polish=True))
    djflow.model(reply="We will refund you.")
    a = djflow.start("cmp_flow", version=1, input={"question": "refund?", "api_key": SECRET})
    djflow.model(reply="We cannot refund this order, sorry: it is past thirty days.")
    b = djflow.start("cmp_flow", version=2, input={"question": "refund?", "api_key": OTHER_SECRET})
    assert (a.status, b.status) == ("completed", "completed"), (a.error, b.error)
    return Run.objects.get(id=a.id), Run.objects.get(id=b.id)


def by_name(comparison: Any) -> dict[str, Any]:
    return {step.name: step for step in comparison.steps}


# --- runs.compare -----------------------------------------------------------------------------


def test_steps_are_paired_in_document_order_a_step_only_in_b_is_added(two_runs) -> None:
    a, b = two_runs
    comparison = compare(a, b, user=None)
    assert [(s.name, s.change) for s in comparison.steps] == [
        ("classify", SAME),
        ("draft", CHANGED),
        ("polish", ADDED),
        ("close", SAME),
    ]
    polish = by_name(comparison)["polish"]
    assert (polish.status_a, polish.status_b) == (None, "succeeded")
    assert polish.attempt_a is None and polish.cost_a is None
    assert polish.output_b.json == "polished"
    # The other way round the step is removed.
    backwards = by_name(compare(b, a, user=None))
    assert backwards["polish"].change == REMOVED
    assert backwards["draft"].change == CHANGED


def test_the_recipe_step_same_prompt_reply_changed_with_its_diff(two_runs) -> None:
    a, b = two_runs
    draft = by_name(compare(a, b, user=None))["draft"]
    assert (draft.status_a, draft.status_b) == ("succeeded", "succeeded")
    assert draft.output_changed is True
    assert draft.output_a.json == "We will refund you."
    assert '-"We will refund you."' in draft.output_diff.text
    assert '+"We cannot refund this order' in draft.output_diff.text
    [call] = draft.calls
    assert call.prompt_changed is False and call.reply_changed is True
    assert call.a is not None and call.b is not None
    assert "Answer refund?" in call.a.prompt.text and call.a.prompt == call.b.prompt
    assert call.a.reply.text == "We will refund you."
    assert call.prompt_diff.lines == ()
    assert "+We cannot refund this order" in call.reply_diff.text
    assert draft.prompts_changed is False and draft.replies_changed is True
    # A longer reply, more output tokens: it cost more, and the runs' totals say so.
    assert draft.cost_a is not None and draft.cost_b is not None
    assert Decimal(0) < draft.cost_a < draft.cost_b


def test_run_level_output_status_and_cost(two_runs) -> None:
    a, b = two_runs
    comparison = compare(a, b, user=None)
    assert (comparison.status_a, comparison.status_b) == ("completed", "completed")
    assert comparison.output_changed is True
    assert comparison.output_a.json == {"draft": "We will refund you.", "tier": "gold"}
    assert '-  "draft": "We will refund you.",' in comparison.output_diff.text
    assert comparison.cost_a == a.cost_usd and comparison.cost_b == b.cost_usd
    assert comparison.cost_delta == b.cost_usd - a.cost_usd > 0
    assert [s.name for s in comparison.changed_steps] == ["draft", "polish"]
    # A run against itself: nothing changed.
    same = compare(a, a, user=None)
    assert same.output_changed is False and same.output_diff.lines == ()
    assert {s.change for s in same.steps} == {SAME}


def test_secrets_are_compared_and_shown_masked(two_runs) -> None:
    a, b = two_runs
    classify_step = by_name(compare(a, b, user=None))["classify"]
    # Different secrets (and each run's own token) show as ••••, and so compare the same.
    assert classify_step.output_a.json == {"echo": "••••", "tier": "gold"}
    assert classify_step.output_changed is False
    dumped = json.dumps(compare(a, b, user=None).as_json())
    assert SECRET not in dumped and OTHER_SECRET not in dumped and "[secret:" not in dumped


def test_as_json_is_json_with_money_as_decimal_strings(two_runs) -> None:
    a, b = two_runs
    data = json.loads(json.dumps(compare(a, b, user=None).as_json()))
    assert data["a"] == {
        "id": str(a.id),
        "workflow": "cmp_flow",
        "version": 1,
        "status": "completed",
        "cost_usd": str(a.cost_usd),
    }
    assert data["cost_usd"]["delta"] == str(b.cost_usd - a.cost_usd)
    assert data["output"]["changed"] is True
    draft = next(step for step in data["steps"] if step["step_id"] == "draft")
    assert draft["change"] == "changed"
    assert Decimal(draft["cost_usd"]["b"]) > Decimal(draft["cost_usd"]["a"])
    assert draft["model_calls"][0]["prompt_changed"] is False
    assert draft["model_calls"][0]["reply_changed"] is True
    assert draft["model_calls"][0]["b"]["reply"].startswith("We cannot refund")
    polish = next(step for step in data["steps"] if step["step_id"] == "polish")
    assert polish["change"] == "added" and polish["cost_usd"]["a"] is None


def test_a_retry_from_a_step_compares_the_new_generation(djflow, two_runs) -> None:
    """Run b retried from ``draft`` with the model now answering as in run a: the attempts the
    retry superseded are left out, and draft is the same as a's again."""
    a, b = two_runs
    djflow.model(reply="We will refund you.")
    # The retry enqueues at commit, which a test's transaction never reaches.
    with TestCase.captureOnCommitCallbacks(execute=True):
        run_retry(run_id=b.id, user=None, from_step="draft")
    djflow.settle()
    b.refresh_from_db()
    assert (b.status, b.generation) == ("completed", 2)
    steps = by_name(compare(a, b, user=None))
    assert steps["draft"].change == SAME
    assert steps["draft"].attempts_b == 1  # the superseded attempt is not counted
    assert steps["classify"].change == SAME  # kept from generation 1
    assert steps["polish"].change == ADDED


def test_tool_calls_are_paired_by_position_their_secrets_masked(two_runs) -> None:
    """The MCP tool calls of the two runs' ``close`` attempts, recorded as a worker records
    them: the arguments hold each run's own token of its secret (the same once masked), the
    results differ, and b made a second call a did not."""
    a, b = two_runs
    uses = []
    for run, results in ((a, [{"closed": True}]), (b, [{"closed": False}, {"again": 1}])):
        step = run.steps.get(step_id="close")
        token = next(iter(secrets_of(run)))
        for result in results:
            uses.append(
                calls.ToolUse(step.id, run.id, "tickets", "close", {"auth": token}, result, "ok")
            )
    calls.tool_calls_record(uses)
    close = by_name(compare(a, b, user=None))["close"]
    first, second = close.tools
    assert first.arguments_changed is False and first.result_changed is True
    assert first.a is not None and first.a.arguments.json == {"auth": "••••"}
    assert '+  "closed": false' in first.result_diff.text
    assert second.a is None and second.b is not None and second.changed
    assert close.change == CHANGED


def secrets_of(run: Run) -> set[str]:
    """The tokens of a run's secrets, as its stored input holds them."""
    return set(TOKEN.findall(json.dumps(run.input)))


def test_the_reads_are_a_fixed_number_of_statements(two_runs) -> None:
    a, b = two_runs
    with CaptureQueriesContext(connection) as queries:
        compare(a, b, user=None)
    # The runs, each one's attempts as tuples, the values shown (per field), the calls, how
    # many each attempt made, the texts (12 here): none is made per step or per call.
    assert len(queries) <= 14, [q["sql"][:80] for q in queries]


def test_a_user_who_may_not_read_a_run_gets_not_found(two_runs) -> None:
    a, b = two_runs
    eve = get_user_model().objects.create_user(username="eve", password="a-long-password-1")
    with pytest.raises(NotFound):
        compare(a, b, user=eve)


def test_document_order_puts_a_new_step_between_its_neighbours() -> None:
    order = document_order(document(polish=False), document(polish=True))
    assert sorted(order, key=order.__getitem__) == ["classify", "draft", "polish", "close"]


def test_foreach_items_and_branches_are_listed_inside_their_step_in_order() -> None:
    doc = {
        "steps": [
            {"id": "load", "kind": "task"},
            {
                "id": "each",
                "kind": "foreach",
                "items": "${input}",
                "do": [
                    {"id": "work", "kind": "task"},
                    {"id": "check", "kind": "task"},
                ],
            },
            {
                "id": "fan",
                "kind": "parallel",
                "branches": {
                    "x": {"id": "fx", "kind": "task"},
                    "y": {"id": "fy", "kind": "task"},
                },
            },
            {"id": "report", "kind": "task"},
        ]
    }
    written = [
        ("", "report"),
        ("each[10]/", "work"),
        ("fan[y]/", "fy"),
        ("each[2]/", "check"),
        ("", "load"),
        ("each[2]/", "work"),
        ("fan[x]/", "fx"),
        ("", "each"),
        ("", "fan"),
        ("_on_failure[1]/", "alert"),
    ]
    assert step_order(written, doc) == [
        ("", "load"),
        ("", "each"),
        ("each[2]/", "work"),
        ("each[2]/", "check"),
        ("each[10]/", "work"),
        ("", "fan"),
        ("fan[x]/", "fx"),
        ("fan[y]/", "fy"),
        ("", "report"),
        ("_on_failure[1]/", "alert"),
    ]


def test_a_diff_is_cut_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(compare_module, "DIFF_CHARS", 200)
    before = "\n".join(f"line {i}" for i in range(200))
    after = "\n".join(f"line {i} changed" for i in range(200))
    diff = text_diff(before, after)
    assert sum(len(line) + 1 for _, line in diff.lines[:-1]) <= 200
    assert diff.cut > 0 and diff.lines[-1][0] == "more"
    assert f"{diff.cut} more characters" in diff.lines[-1][1]
    assert text_diff("same", "same").lines == ()
    monkeypatch.setattr(compare_module, "DIFF_INPUT_CHARS", 100)
    assert text_diff(before, after).skipped


# --- the page ---------------------------------------------------------------------------------


def signed_in(username: str, *, team: bool) -> Client:
    person = get_user_model().objects.create_user(username=username, password="a-long-pw-1")
    if team:
        person.user_permissions.add(*team_permissions())
    client = Client()
    client.force_login(person)
    return client


def page_url(a: Run, b: Run) -> str:
    return f"/runs/{a.id}/compare/{b.id}/"


def test_the_page_shows_each_step_the_diffs_the_prompts_and_the_costs(two_runs) -> None:
    a, b = two_runs
    answer = signed_in("ada", team=True).get(page_url(a, b))
    assert answer.status_code == 200
    assert "no-store" in answer["Cache-Control"] or "no-cache" in answer["Cache-Control"]
    html = answer.content.decode()
    assert f'href="/runs/{a.id}/"' in html and f'href="/runs/{b.id}/"' in html
    assert 'data-step="draft" data-change="changed"' in html
    assert 'data-step="polish" data-change="added"' in html
    assert 'data-step="classify" data-change="same"' in html
    assert '<details class="call changed"' in html
    assert "Answer refund?" in html  # the prompt, folded
    assert "We cannot refund this order" in html
    assert f"${a.cost_usd:.6f}" in html and f"${b.cost_usd:.6f}" in html
    assert 'id="output-change">changed<' in html


def test_the_page_masks_secrets(two_runs) -> None:
    a, b = two_runs
    html = signed_in("ada", team=True).get(page_url(a, b)).content.decode()
    assert "••••" in html
    assert SECRET not in html and OTHER_SECRET not in html and "[secret:" not in html


def test_a_stranger_gets_404_for_either_run(two_runs, djflow) -> None:
    a, b = two_runs
    eve = signed_in("eve", team=False)
    for url in (page_url(a, b), page_url(b, a)):
        answer = eve.get(url)
        assert answer.status_code == 404, url
        assert "No such run" in answer.content.decode()
        assert "cmp_flow" not in answer.content.decode()
    # A run she may read (a viewer of its workflow) beside one she may not: 404 either way.
    djflow.stub("cmp_mine.only", returns=1)
    mine = djflow.start({"id": "cmp_mine", "steps": [{"id": "only", "kind": "task"}]})
    access.grant(access.VIEWER, "cmp_mine", user=get_user_model().objects.get(username="eve"))
    assert eve.get(f"/runs/{mine.id}/").status_code == 200
    for url in (page_url(mine, a), page_url(a, mine)):
        assert eve.get(url).status_code == 404, url
    assert eve.get(page_url(mine, mine)).status_code == 200


def test_signing_in_is_required(two_runs) -> None:
    a, b = two_runs
    answer = Client().get(page_url(a, b))
    assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/")


def test_the_inspectors_compare_form_leads_to_the_page(two_runs) -> None:
    a, b = two_runs
    ada = signed_in("ada", team=True)
    inspector = ada.get(f"/runs/{a.id}/").content.decode()
    assert f'action="/runs/{a.id}/compare/"' in inspector and 'name="with"' in inspector
    answer = ada.get(f"/runs/{a.id}/compare/", {"with": f" {b.id} "})
    assert answer.status_code == 302 and answer["Location"] == page_url(a, b)
    assert ada.get(f"/runs/{a.id}/compare/", {"with": "not-a-run"}).status_code == 404


def test_a_forks_inspector_links_its_source_and_their_comparison(two_runs, djflow) -> None:
    from runs import forks

    a, _ = two_runs
    with djflow._settling():
        fork = forks.run_fork(run_id=a.id, from_step="draft")
    ada = signed_in("ada", team=True)
    inspector = ada.get(f"/runs/{fork.id}/").content.decode()
    assert f'href="/runs/{a.id}/" id="forked-from"' in inspector
    assert "at step <code>draft</code>" in inspector
    assert f'href="{page_url(a, fork)}" id="compare-source"' in inspector
    assert ada.get(page_url(a, fork)).status_code == 200
    # A run that is no fork says nothing of the kind.
    assert 'id="forked-from"' not in ada.get(f"/runs/{a.id}/").content.decode()
