"""The ``djflow`` pytest fixture for workflow authors (contract section 16, issue 38): runs
workflows in this process on the test database, with no broker, no beat and no network, on
a virtual clock; every call returns with the engine idle.

The plugin is loaded as an author's session loads it, under its entry point's name ``djflow``
(tests/conftest.py registers it when the install predates the entry point; a test below reads
the entry point)."""

from __future__ import annotations

import os
import socket
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from workflows.sdk import RetryPolicy, StepFailure, workflow

DAY = 86_400
BASE = Path(__file__).resolve().parents[2]


# --- the workflows -------------------------------------------------------------------------

support = workflow("tp_support", limits={"run_timeout_ms": 60 * DAY * 1000})
support.task("classify")
support.sleep("cool_off", ms=30 * DAY * 1000)
support.recipe("draft", prompt="Answer ${input.question}", model="openai:gpt-4o-mini")
support.approval("review", approvers={"emails": ["lead@example.com"]})
support.output({"draft": "${steps.draft.output}", "tier": "${steps.classify.output.tier}"})


@support.handler("classify")
def classify(ctx: Any, input: Any, prior: Any) -> Any:
    raise AssertionError("stubbed in every test")


def test_a_month_long_support_workflow_completes_on_the_virtual_clock(djflow) -> None:
    djflow.define(support)
    djflow.stub("tp_support.classify", returns={"tier": "gold"})
    djflow.model(reply="We will refund you.")
    run = djflow.start("tp_support", input={"question": "refund?"})
    assert run.status == "waiting"
    assert run.step("cool_off")["status"] == "waiting"
    djflow.advance(30 * DAY)
    assert run.step("review")["status"] == "waiting"
    djflow.approve(run, "review", by="lead@example.com", comment="fine")
    assert run.status == "completed", run.error
    assert run.output == {"draft": "We will refund you.", "tier": "gold"}
    assert run.cost_usd > 0


def test_a_rejection_fails_the_run_naming_who_rejected(djflow) -> None:
    djflow.stub("tp_support.classify", returns={"tier": "gold"})
    djflow.model(reply="draft")
    run = djflow.start(support, input={"question": "q"})
    djflow.advance(30 * DAY)
    djflow.reject(run, "review", by="lead@example.com", comment="too curt")
    assert run.status == "failed"
    assert run.error["class"] == "rejected"
    assert "lead@example.com" in run.step("review")["error"]["message"]


# --- time -------------------------------------------------------------------------------------

timed = workflow("tp_timed", limits={"run_timeout_ms": 400 * DAY * 1000})
timed.sleep_until("until", until="${input.until}")
timed.task("after")


def test_sleep_until_an_instant_falls_due_when_the_clock_reaches_it(djflow) -> None:
    from django.utils import timezone

    djflow.stub("tp_timed.after", returns="rang")
    instant = timezone.now() + timezone.timedelta(days=365)
    run = djflow.start(timed, input={"until": instant.isoformat()})
    djflow.advance(364 * DAY)
    assert (run.status, run.step("until")["status"]) == ("waiting", "waiting")
    djflow.advance(DAY)
    assert run.status == "completed", run.error
    assert run.step("after")["output"] == "rang"


def test_a_thirty_day_sleep_takes_no_real_time(djflow) -> None:
    nap = workflow("tp_nap", limits={"run_timeout_ms": 31 * DAY * 1000})
    nap.sleep("nap", ms=30 * DAY * 1000)
    run = djflow.start(nap)
    began = time.monotonic()
    djflow.advance(30 * DAY)
    assert run.status == "completed", run.error
    assert time.monotonic() - began < 5


waiter = workflow("tp_waiter", limits={"run_timeout_ms": 10 * DAY * 1000})
waiter.wait_for("paid", event="payment", key="${input.order}", timeout_ms=3 * DAY * 1000)
waiter.output("${steps.paid.output}")


def test_wait_event_resumes_on_the_event_sent(djflow) -> None:
    run = djflow.start(waiter, input={"order": "A-1"})
    assert run.step("paid")["status"] == "waiting"
    assert djflow.send_event("payment", "A-2", {"amount": 1}) == 0
    assert djflow.send_event("payment", "A-1", {"amount": 5}) == 1
    assert run.status == "completed", run.error
    assert run.output == {"amount": 5}


def test_wait_event_times_out_when_the_clock_passes_its_timeout(djflow) -> None:
    run = djflow.start(waiter, input={"order": "A-1"})
    djflow.advance(3 * DAY + 1)
    assert run.status == "failed"
    assert run.step("paid")["error"]["class"] == "timeout"


quorum = workflow("tp_quorum", limits={"run_timeout_ms": 10 * DAY * 1000})
quorum.approval(
    "sign_off",
    approvers={"emails": ["a@example.com", "b@example.com", "c@example.com"]},
    quorum=2,
    remind_after_ms=DAY * 1000,
)


def test_an_approval_with_a_quorum_reminds_on_the_virtual_clock(djflow, mailoutbox) -> None:
    run = djflow.start(quorum)
    asked = len(mailoutbox)
    assert asked == 3
    djflow.advance(DAY + 1)
    reminded = mailoutbox[asked:]
    assert {to for mail in reminded for to in mail.to} == {
        "a@example.com",
        "b@example.com",
        "c@example.com",
    }
    djflow.approve(run, "sign_off", by="a@example.com")
    assert run.status == "pending_approval"
    djflow.approve(run, "sign_off", by="c@example.com", comment="ok")
    assert run.status == "completed", run.error
    assert run.step("sign_off")["output"]["by"] == "c@example.com"


def test_an_approver_not_asked_is_named_with_those_who_were(djflow) -> None:
    run = djflow.start(quorum)
    with pytest.raises(AssertionError, match=r"'z@example\.com' is not among the approvers"):
        djflow.approve(run, "sign_off", by="z@example.com")


flaky = workflow("tp_flaky", limits={"run_timeout_ms": DAY * 1000})
flaky.task(
    "call",
    retry=RetryPolicy(
        max_attempts=3, backoff="fixed", initial_ms=600_000, max_ms=600_000, jitter=False
    ),
)


def test_retries_wait_their_back_off_on_the_virtual_clock(djflow) -> None:
    tries: list[int] = []

    def once_down(ctx: Any, input: Any) -> Any:
        tries.append(ctx.attempt)
        if len(tries) < 3:
            raise StepFailure("down", "retryable")
        return "up"

    djflow.stub("tp_flaky.call", side_effect=once_down)
    run = djflow.start(flaky)
    assert tries == [1]
    djflow.advance(599)
    assert tries == [1]
    djflow.advance(1)
    assert tries == [1, 2]
    djflow.advance(600)
    assert run.status == "completed", run.error
    assert tries == [1, 2, 3]
    assert [a["attempt"] for a in run.steps if a["step_id"] == "call"] == [1, 2, 3]


hourly = workflow("tp_hourly")
hourly.task("tick")


def test_a_schedule_falls_due_as_the_clock_moves(djflow, admin_user) -> None:
    from runs.models import Run as RunRow
    from schedules.services import schedule_create

    djflow.define(hourly)
    djflow.stub("tp_hourly.tick", returns="ticked")
    schedule_create(workflow="tp_hourly", every_ms=3_600_000, user=admin_user)
    djflow.advance(3 * 3600 + 1)
    runs = RunRow.objects.filter(workflow_id="tp_hourly")
    assert runs.count() == 3
    assert set(runs.values_list("status", flat=True)) == {"completed"}


# --- shapes -----------------------------------------------------------------------------------

shapes = workflow("tp_shapes", limits={"run_timeout_ms": 2 * DAY * 1000})
shapes.parallel(
    "both", branches={"left": {"id": "l", "kind": "task"}, "right": {"id": "r", "kind": "task"}}
)
shapes.foreach("each", items="${input.items}", do={"id": "item", "kind": "task"})
shapes.loop(
    "again",
    do={"id": "turn", "kind": "task"},
    max_iterations=5,
    until={"path": "steps.turn.output", "op": "eq", "value": 3},
)
shapes.subworkflow("child", workflow="tp_nap_child")
shapes.output(
    {
        "both": "${steps.both.output}",
        "each": "${steps.each.output}",
        "child": "${steps.child.output}",
    }
)

child = workflow("tp_nap_child", limits={"run_timeout_ms": 2 * DAY * 1000})
child.sleep("nap", ms=DAY * 1000)
child.output("rested")


def test_parallel_foreach_loop_and_subworkflow_run_in_process(djflow) -> None:
    turns: list[int] = []

    def turn(ctx: Any, input: Any) -> int:
        turns.append(1)
        return len(turns)

    djflow.stub("tp_shapes.l", returns="L")
    djflow.stub("tp_shapes.r", returns="R")
    djflow.stub("tp_shapes.item", side_effect=lambda ctx, item: item * 10)
    djflow.stub("tp_shapes.turn", side_effect=turn)
    djflow.define(child)
    run = djflow.start(shapes, input={"items": [1, 2, 3]})
    assert run.status == "waiting"
    assert turns == [1, 1, 1]
    djflow.advance(DAY)
    assert run.status == "completed", run.error
    assert run.output == {
        "both": {"left": "L", "right": "R"},
        "each": [10, 20, 30],
        "child": "rested",
    }


failing = workflow("tp_failing")
failing.task("charge")
failing.on_failure({"id": "apologise", "kind": "task"})


def test_on_failure_steps_run_with_the_error(djflow) -> None:
    djflow.stub("tp_failing.charge", raises=StepFailure("card declined", "fatal"))
    djflow.stub("tp_failing.apologise", side_effect=lambda ctx, given: "sorry")
    run = djflow.start(failing)
    assert run.step("charge")["error"] == {"class": "fatal", "message": "card declined"} or (
        run.step("charge")["error"]["message"] == "card declined"
    )
    assert run.step("apologise")["status"] == "succeeded"
    assert run.status == "completed", run.error


# --- the model, tools and http ----------------------------------------------------------------

drafts = workflow("tp_drafts")
drafts.recipe("first", prompt="one", model="openai:gpt-4o-mini")
drafts.recipe("second", prompt="two", model="anthropic:claude-sonnet-4-0", output="json")
drafts.output({"first": "${steps.first.output}", "second": "${steps.second.output}"})


def test_model_replies_in_turn_priced_as_real_calls(djflow) -> None:
    djflow.model(replies=["hello", {"ok": True}])
    run = djflow.start(drafts)
    assert run.status == "completed", run.error
    assert run.output == {"first": "hello", "second": {"ok": True}}
    [call] = run.step("first")["model_calls"]
    assert call["model"] == "gpt-4o-mini"
    assert run.cost_usd > 0


def test_model_replies_by_step(djflow) -> None:
    djflow.model(by_step={"second": {"n": 2}, "first": "one"})
    run = djflow.start(drafts)
    assert run.output == {"first": "one", "second": {"n": 2}}


def test_an_unstubbed_model_call_fails_its_step_with_class_unstubbed(djflow) -> None:
    run = djflow.start(drafts)
    assert run.status == "failed"
    error = run.step("first")["error"]
    assert error["class"] == "unstubbed"
    assert "model 'openai:gpt-4o-mini'" in error["message"]


def test_a_handler_neither_registered_nor_stubbed_fails_with_class_unstubbed(djflow) -> None:
    lonely = {"id": "tp_lonely", "steps": [{"id": "orphan", "kind": "task", "handler": "nowhere"}]}
    run = djflow.start(lonely)
    error = run.step("orphan")["error"]
    assert (run.status, error["class"]) == ("failed", "unstubbed")
    assert "handler 'nowhere'" in error["message"]


tooled = workflow("tp_tooled")
tooled.mcp_tool("lookup", server="crm", tool="find_customer", arguments={"email": "${input.email}"})
tooled.http("fetch", method="GET", url="https://api.example.com/orders/${input.order}")
tooled.output({"customer": "${steps.lookup.output}", "order": "${steps.fetch.output.body}"})


def test_tool_and_http_stubs_answer_their_steps(djflow) -> None:
    asked: list[Any] = []
    djflow.tool(reply=lambda call: asked.append(call) or {"name": "Ann"})
    djflow.http(reply={"status": 200, "headers": {}, "body": {"total": 12}})
    run = djflow.start(tooled, input={"email": "ann@example.com", "order": "7"})
    assert run.status == "completed", run.error
    assert run.output == {"customer": {"name": "Ann"}, "order": {"total": 12}}
    assert asked[0]["arguments"] == {"email": "ann@example.com"}


def test_a_stubbed_http_error_fails_the_step_as_the_servers_would(djflow) -> None:
    djflow.tool(reply={"name": "Ann"})
    djflow.http(reply={"status": 404, "headers": {}, "body": "gone"})
    run = djflow.start(tooled, input={"email": "ann@example.com", "order": "7"})
    error = run.step("fetch")["error"]
    assert (run.status, error["class"]) == ("failed", "fatal")
    assert error["message"] == "http: GET https://api.example.com/orders/7 answered 404 Not Found"


def test_unstubbed_tool_and_http_calls_fail_with_class_unstubbed(djflow) -> None:
    run = djflow.start(tooled, input={"email": "ann@example.com", "order": "7"})
    error = run.step("lookup")["error"]
    assert (run.status, error["class"]) == ("failed", "unstubbed")
    assert "mcp_tool 'crm.find_customer'" in error["message"]
    djflow.tool(reply={"name": "Ann"})
    run = djflow.start(tooled, input={"email": "ann@example.com", "order": "7"})
    error = run.step("fetch")["error"]
    assert (run.status, error["class"]) == ("failed", "unstubbed")
    assert "https://api.example.com/orders/7" in error["message"]


# --- no network, and the plugin itself --------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch) -> list[Any]:
    """Any connection this process opens is refused and noted."""
    tried: list[Any] = []

    def refuse(self: Any, address: Any, *args: Any) -> Any:
        tried.append(address)
        raise OSError(f"the test reached the network: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return tried


def test_no_network_is_touched(djflow, no_network, mailoutbox) -> None:
    djflow.stub("tp_support.classify", returns={"tier": "gold"})
    djflow.model(reply="draft")
    djflow.tool(reply={"name": "Ann"})
    djflow.http(reply={"status": 200, "headers": {}, "body": {}})
    run = djflow.start(support, input={"question": "q"})
    djflow.advance(30 * DAY)
    djflow.approve(run, "review", by="lead@example.com")
    other = djflow.start(tooled, input={"email": "a@example.com", "order": "1"})
    assert (run.status, other.status) == ("completed", "completed")
    assert no_network == []


def test_the_plugin_is_registered_through_the_pytest11_entry_point() -> None:
    project = tomllib.loads((BASE / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"djflow": "workflows.testing"}
    extras = project["optional-dependencies"]
    assert {req.split("==")[0] for req in extras["testing"]} == {"pytest", "pytest-django"}
    # Pinned as the project's own tests pin them: one version of each to keep working.
    assert set(extras["testing"]) <= set(extras["test"])
    # The virtual clock is djflow's own dependency: manage.py run_replay needs it too.
    assert any(req.startswith("time-machine==") for req in project["dependencies"])


def test_loading_the_plugin_imports_no_app_above_workflows() -> None:
    import subprocess
    import sys

    code = (
        "import sys, workflows.testing; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('runs', 'workers', 'approvals', 'config', 'django')))"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]"


def _database_url(*, suffix: str) -> str:
    from django.conf import settings

    db = settings.DATABASES["default"]
    name = db["NAME"].removeprefix("test_")
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{db['HOST']}:{db['PORT']}/{name}{suffix}"


def test_the_docs_example_passes_with_the_plugin_its_entry_point_loads(tmp_path, db) -> None:
    """docs/how-to/testing.md's example, as an author's test module, in a pytest session of
    its own that names no plugin (tests/test_readme.py only runs the block's definitions):
    the ``pytest11`` entry point, in the metadata setuptools makes of this checkout, loads
    the fixture."""
    import re
    import subprocess
    import sys

    page = (BASE / "docs" / "how-to" / "testing.md").read_text()
    [example] = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    module = tmp_path / "test_support_doc.py"
    module.write_text(example)
    meta = tmp_path / "meta"
    meta.mkdir()
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(meta)],
        cwd=BASE,
        capture_output=True,
        check=True,
    )
    assert "djflow = workflows.testing" in next(meta.glob("*/entry_points.txt")).read_text()
    session = ["--rootdir", str(BASE), "-n", "0", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(BASE / "pyproject.toml"), *session, str(module)],
        cwd=BASE,
        # A test database of its own: this session's is in use.
        env={
            **os.environ,
            "DATABASE_URL": _database_url(suffix="_docs"),
            "PYTHONPATH": os.pathsep.join([str(BASE), str(meta)]),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_approvers_named_as_users_decide_as_themselves(djflow, django_user_model) -> None:
    ann = django_user_model.objects.create_user(username="ann", email="ann@example.com")
    bob = django_user_model.objects.create_user(username="bob", email="bob@example.com")
    board = workflow("tp_board")
    board.approval("vote", approvers={"users": ["ann", "bob"]}, quorum=2)
    run = djflow.start(board)
    djflow.approve(run, "vote", by=ann)
    assert run.status == "pending_approval"
    djflow.reject(run, "vote", by="bob@example.com", comment="no")
    assert (run.status, run.step("vote")["error"]["class"]) == ("failed", "rejected")
    assert bob.username in run.step("vote")["error"]["message"]


@pytest.fixture
def embeddings_configured(settings) -> None:
    """The author's settings name an embeddings model (one asked over the network), set
    before the fixture is: as a project's settings module would."""
    settings.DJFLOW = {**settings.DJFLOW, "EMBEDDINGS_MODEL": "openai:text-embedding-3-small"}


def test_knowledge_bases_are_searched_full_text_and_never_embedded(
    embeddings_configured, djflow, no_network
) -> None:
    """A deployment with an embeddings model still sends nothing under the fixture: a
    write_kb's document is not embedded and a recipe's context is found full-text."""
    djflow.define(
        {
            "id": "tp_kb",
            "steps": [
                {
                    "id": "keep",
                    "kind": "write_kb",
                    "kb": "tp-answers",
                    "key": "T-1",
                    "title": "Export crashes",
                    "content": "Clear the export cache, then export again.",
                },
                {
                    "id": "answer",
                    "kind": "recipe",
                    "prompt": "Answer with ${context}",
                    "model": "openai:gpt-4o-mini",
                    "context": {"kb": "tp-answers", "query": "export cache"},
                },
            ],
        }
    )
    djflow.model(reply=lambda call: "seen" if "export cache" in str(call) else "blind")
    run = djflow.start("tp_kb", input={})
    assert run.status == "completed", run.error
    assert run.output == "seen"
    assert no_network == []
