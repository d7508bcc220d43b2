"""Security review of the compare page ``/runs/<a>/compare/<b>/`` (CONTRACT section 16):
who sees what, and bounded work (finding C1, fixed: a page of crafted values took minutes)."""

from __future__ import annotations

import random
import time
from typing import Any

from django.contrib.auth import get_user_model
from django.test import Client

from workflows import access
from workflows.sdk import workflow

STEPS = 3

echo = workflow("atk_echo")
for index in range(STEPS):
    echo.task(f"s{index}", input={"items": "${input.items}"}, handler="atk_echo.echo")


@echo.handler("echo")
def echo_items(ctx: Any, input: Any, prior: Any) -> Any:
    return input["items"]


def _items(seed: int) -> list[int]:
    # ~100 KB as JSON (within a step's 1 MiB and the page's 256 KiB per value), ~198,000
    # characters pretty-printed (under DIFF_INPUT_CHARS, so it is diffed), one short line per
    # item, 110 values each repeated just under difflib's "popular" 1% (no autojunk).
    chosen = random.Random(seed)
    return [chosen.randrange(110) for _ in range(33_000)]


def test_the_compare_page_of_crafted_runs_answers_within_10_seconds(djflow, admin_user) -> None:
    a = djflow.start(echo, input={"items": _items(1)})
    b = djflow.start(echo, input={"items": _items(2)})
    assert a.status == b.status == "completed", (a.error, b.error)
    client = Client()
    client.force_login(admin_user)
    began = time.monotonic()
    answer = client.get(f"/runs/{a.id}/compare/{b.id}/")
    took = time.monotonic() - began
    assert answer.status_code == 200
    assert took < 10, f"the page took {took:.1f} s for {STEPS} steps"


# --- checked and sound -------------------------------------------------------------------------

from workflows.sdk import StepFailure  # noqa: E402

XSS = '</pre><script>alert("x")</script><img src=x onerror=alert(1)>'
SECRET = "sk-compare-secret-0042"

shown = workflow(
    "atk_shown",
    input_schema={
        "type": "object",
        "properties": {"text": {"type": "string"}, "key": {"type": "string", "writeOnly": True}},
    },
)
shown.task("say", input={"text": "${input.text}", "key": "${input.key}"})
shown.task("boom", on_error="continue")
other = workflow("atk_other")
other.task("say")


@shown.handler("say")
def say(ctx: Any, input: Any, prior: Any) -> Any:
    return {"text": input["text"], "echo": f"key {input['key']}"}


@shown.handler("boom")
def boom(ctx: Any, input: Any, prior: Any) -> Any:
    raise StepFailure(f"boom {XSS}", "fatal")


@other.handler("say")
def other_say(ctx: Any, input: Any, prior: Any) -> Any:
    return "other"


def test_compare_shows_both_runs_only_to_who_reads_both_masked_and_escaped(
    djflow, admin_user
) -> None:
    a = djflow.start(shown, input={"text": "hi", "key": SECRET}, user=admin_user)
    b = djflow.start(shown, input={"text": XSS, "key": SECRET + "x"}, user=admin_user)
    c = djflow.start(other, user=admin_user)
    vera = get_user_model().objects.create_user(username="vera", password="a-long-password-1")
    access.grant("viewer", "atk_shown", user=vera)
    client = Client()
    client.force_login(vera)
    page = client.get(f"/runs/{a.id}/compare/{b.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert SECRET not in html
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "Traceback" not in html
    # A run of a workflow she may not read, on either side, is a 404 naming nothing of it.
    for path in (f"/runs/{a.id}/compare/{c.id}/", f"/runs/{c.id}/compare/{a.id}/"):
        answer = client.get(path)
        assert answer.status_code == 404, path
        assert "atk_other" not in answer.content.decode()
    # The pick form sends any id on; the compare page decides.
    assert client.get(f"/runs/{a.id}/compare/?with={c.id}").status_code in (302, 404)


def test_a_comparison_diffs_at_most_its_budget_of_lines_then_only_compares() -> None:
    from runs import compare

    budget = compare._lines_left.set(5)
    try:
        first = compare.text_diff("a\nb", "a\nc")
        second = compare.text_diff("x\ny", "x\nz")
    finally:
        compare._lines_left.reset(budget)
    assert first.lines and not first.skipped
    assert second.skipped and not second.lines
    many = "\n".join(map(str, range(compare.DIFF_INPUT_LINES + 1)))
    assert compare.text_diff(many, many + "\nmore").skipped
