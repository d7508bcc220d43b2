"""``manage.py run_replay`` (contract section 16, issue 38): an exported run run again offline,
in another process and a private database, its model, tool and http calls answered from the
recording. Exit 0 same output, 1 different, 2 a call with no recording, 3 no replay made.

The runs are made by the ``djflow`` fixture (tests/runs/flows_replay.py), exported as
``GET /runs/{id}/export`` exports them, and replayed by the command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runs import export
from workflows.services import recipe_save

from .flows_replay import DAY, eventful, graded, standin, support

BASE = Path(__file__).resolve().parents[2]
MODULES = "tests.runs.flows_replay"


@pytest.fixture
def reply_recipe(db: Any) -> None:
    recipe_save(
        document={
            "name": "rp_reply",
            "prompt": "Answer: ${input.question}",
            "model": "openai:gpt-4o-mini",
        }
    )


def exported(run_id: Any, folder: Path) -> Path:
    path = folder / "run.json"
    path.write_text("".join(export.run_export(run_id=run_id).chunks()), encoding="utf-8")
    return path


def replay(*args: Any, live_modules: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WORKFLOW_MODULES": MODULES if live_modules else ""}
    return subprocess.run(
        [sys.executable, "manage.py", "run_replay", *map(str, args)],
        cwd=BASE,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def finished_support(djflow: Any, question: str = "refund please") -> Any:
    djflow.model(reply="We will refund you.")
    djflow.tool(reply={"id": 7, "name": "Ann"})
    djflow.http(reply={"status": 200, "headers": {}, "body": {"total": 12}})
    run = djflow.start(support, input={"q": question})
    djflow.advance(DAY)
    djflow.approve(run, "review", by="lead@example.com")
    assert run.status == "completed", run.error
    return run


def test_a_recorded_run_replays_to_the_same_output(djflow, reply_recipe, tmp_path) -> None:
    run = finished_support(djflow)
    path = exported(run.id, tmp_path)
    done = replay(path, "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads(done.stdout)
    assert result["status"] == "completed"
    assert result["unrecorded"] == []
    comparison = result["comparison"]
    assert comparison["output"]["changed"] is False
    # Each step (a recipe, an mcp_tool, an http, a task, a sleep, an approval) as it was,
    # at the cost it had.
    steps = {step["step_id"]: step for step in comparison["steps"]}
    assert set(steps) >= {"classify", "cool", "draft", "lookup", "fetch", "review"}
    changed = {
        k: (
            v["status"],
            v["error"],
            v["output"]["diff"],
            [c["prompt_diff"] for c in v["model_calls"]],
            [c["reply_diff"] for c in v["model_calls"]],
        )
        for k, v in steps.items()
        if v["change"] != "same"
    }
    assert not changed, changed
    assert comparison["cost_usd"]["a"] == comparison["cost_usd"]["b"] != "0.000000"
    text = replay(path)
    assert text.returncode == 0
    assert "output: the same" in text.stdout


def test_an_edited_recipe_needs_a_live_call_exit_2(djflow, reply_recipe, tmp_path) -> None:
    run = finished_support(djflow)
    path = exported(run.id, tmp_path)
    edited = tmp_path / "recipe.json"
    edited.write_text(
        json.dumps({"prompt": "Answer curtly: ${input.question}", "model": "openai:gpt-4o-mini"})
    )
    done = replay(path, "--recipe", f"rp_reply={edited}")
    assert done.returncode == 2, done.stderr + done.stdout
    assert "no recording: step rp_support.draft, model call to openai:gpt-4o-mini" in done.stdout
    assert '+        "content": "Answer curtly: refund please",' in done.stdout
    assert '-        "content": "Answer: refund please",' in done.stdout


def test_an_edited_input_run_live_changes_the_output_exit_1(djflow, tmp_path) -> None:
    """classify gets another input: offline that is exit 2 naming it; with --live its handler
    runs here (imported from WORKFLOW_MODULES) and says silver, while the model call, whose
    prompt did not change, is still answered from the recording."""
    djflow.model(reply="Hello!")
    run = djflow.start(graded, input={"q": "refund please"})
    assert run.output == {"tier": "gold", "greeting": "Hello!"}
    path = exported(run.id, tmp_path)
    offline = replay(path, "--input", '{"q": "where is it"}', "--json")
    assert offline.returncode == 2, offline.stderr + offline.stdout
    missed = json.loads(offline.stdout)["unrecorded"]
    assert [miss["step"] for miss in missed] == ["rp_graded.classify"]
    assert '+  "text": "where is it"' in missed[0]["difference"]
    live = replay(path, "--input", '{"q": "where is it"}', "--live", "--json", live_modules=True)
    assert live.returncode == 1, live.stderr + live.stdout
    result = json.loads(live.stdout)
    assert result["live_calls"] == ["rp_graded.classify: handler of step classify"]
    assert result["comparison"]["output"]["b"]["value"] == {"tier": "silver", "greeting": "Hello!"}


def test_from_step_keeps_the_recorded_outputs_before_it(djflow, reply_recipe, tmp_path) -> None:
    run = finished_support(djflow)
    path = exported(run.id, tmp_path)
    # Another input, but every step that reads it comes before "review": kept as recorded.
    done = replay(path, "--input", '{"q": "other"}', "--from-step", "review", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads(done.stdout)
    assert result["reused"] == ["classify", "cool", "draft", "lookup", "fetch"]


def test_an_edited_document_changes_the_output_exit_1(djflow, reply_recipe, tmp_path) -> None:
    run = finished_support(djflow)
    path = exported(run.id, tmp_path)
    document = support.document()
    document["output"] = {**document["output"], "note": "v2"}
    edited = tmp_path / "doc.json"
    edited.write_text(json.dumps(document))
    done = replay(path, "--document", edited)
    assert done.returncode == 1, done.stderr + done.stdout
    assert "output: changed" in done.stdout
    assert '+  "note": "v2",' in done.stdout


def test_what_cannot_be_replayed_is_exit_3_saying_why(djflow, reply_recipe, tmp_path) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text('{"format": "something else"}')
    done = replay(junk)
    assert done.returncode == 3
    assert "not a run export" in done.stderr
    djflow.model(reply="x")
    djflow.tool(reply={"id": 7})
    djflow.http(reply={"status": 200, "headers": {}, "body": {}})
    waiting = djflow.start(support, input={"q": "refund"})
    assert waiting.status == "waiting"
    done = replay(exported(waiting.id, tmp_path))
    assert done.returncode == 3
    assert "had not ended" in done.stderr
    finished = finished_support(djflow)
    path = exported(finished.id, tmp_path)
    for args, said in (
        (("--input", "[1"), "--input: not JSON"),
        (("--from-step", "nope"), "from_step"),
        (("--recipe", "rp_reply=9"), "holds no version 9"),
        (("--document", tmp_path / "missing.json"), "--document"),
    ):
        done = replay(path, *args)
        assert done.returncode == 3, (args, done.stdout, done.stderr)
        assert said in done.stderr, (args, done.stderr)


def test_a_retry_an_event_a_foreach_and_a_user_approver_replay_as_they_ran(
    djflow, django_user_model, tmp_path
) -> None:
    from workflows.sdk import StepFailure

    boss = django_user_model.objects.create_user(username="rp_boss", email="boss@example.com")
    tries: list[int] = []

    def flaky(ctx: Any, input: Any) -> Any:
        tries.append(ctx.attempt)
        if len(tries) == 1:
            raise StepFailure("down", "retryable")
        return "up"

    djflow.stub("rp_eventful.flaky", side_effect=flaky)
    djflow.stub("rp_eventful.double", side_effect=lambda ctx, given: {"got": given})
    run = djflow.start(eventful, input={"order": "o1", "items": [1, 2]})
    djflow.advance(60)
    assert tries == [1, 2]
    djflow.send_event("paid", "o1", {"amount": 5})
    djflow.approve(run, "boss", by=boss)
    assert run.status == "completed", run.error
    done = replay(exported(run.id, tmp_path), "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads(done.stdout)
    steps = {step["step_id"]: step for step in result["comparison"]["steps"]}
    assert steps["flaky"]["attempts"] == {"a": 2, "b": 2}
    assert steps["signal"]["output"]["b"]["value"] == {"amount": 5}
    assert steps["boss"]["status"]["b"] == "succeeded"
    assert result["comparison"]["output"]["changed"] is False


def test_a_live_model_call_is_made_once_and_answers(djflow, tmp_path) -> None:
    """With --live, a model call whose prompt changed goes to the provider itself (the
    offline stand-in here), once: not to the recording again."""
    djflow.model(reply="recorded")
    run = djflow.start(standin, input={"q": "hi"})
    assert run.output == {"said": "recorded"}
    path = exported(run.id, tmp_path)
    done = replay(path, "--input", '{"q": "hello"}', "--live", "--json")
    assert done.returncode == 1, done.stderr + done.stdout
    result = json.loads(done.stdout)
    assert result["live_calls"] == ["rp_standin.say: model call to standin:echo"]
    said = result["comparison"]["output"]["b"]["value"]["said"]
    assert said.startswith("[stand-in model]"), said
    text = replay(path, "--input", '{"q": "hello"}', "--live")
    assert "model call 1: its prompt changed" in text.stdout, text.stdout
    assert "-Say hi\n" in text.stdout and "+Say hello\n" in text.stdout
