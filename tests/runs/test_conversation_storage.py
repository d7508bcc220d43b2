"""A conversation that grows stores each message once (CONTRACT section 17;
runs.engine.contents): a thread of 50 model calls, each resending the messages before it and
one more turn, stores its bytes linearly, and every reader still answers each prompt whole.

The thread is recorded through ``runs.engine.calls`` (as the worker records an attempt's
calls), not through a workflow: a ``recipe`` step sends one user message rendered from its
template, so no workflow document makes a prompt of many messages today.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from django.contrib import admin
from django.db import connection
from rest_framework.test import APIClient

from runs import compare, export
from runs.admin import ModelCallInline
from runs.engine import calls, contents, costs
from runs.models import Content, ModelCall, Run, StepRun
from runs.status import RunStatus, StepStatus
from tests.runs.factories import RunFactory, StepRunFactory
from tests.runs.test_retention import _age, _purge

pytestmark = pytest.mark.django_db

SYSTEM = "You are a patient tutor. Answer in two or three sentences, then ask one question."
TURNS = 50


def _turn(n: int, role: str) -> dict[str, str]:
    # A few hundred characters a turn, different every turn (as a real exchange is).
    words = " ".join(f"{role}-{n}-word-{i}" for i in range(20))
    return {"role": role, "content": f"Turn {n}: {words}."}


def _thread(run: Run, turns: int = TURNS, first: int = 0) -> list[ModelCall]:
    """``turns`` calls on one thread, each in an attempt of its own (a loop's iterations):
    call n's prompt is every earlier message, the replies as assistant turns, and one more
    user turn."""
    messages: list[dict[str, str]] = []
    made: list[ModelCall] = []
    for n in range(first, first + turns):
        attempt = StepRunFactory(
            run=run, step_id="ask", kind="recipe", status=StepStatus.RUNNING, path=f"/loop/{n}"
        )
        messages.append(_turn(n, "user"))
        prompt = {"system": SYSTEM, "messages": list(messages)}
        reply = {"text": _turn(n, "assistant")["content"]}
        held = costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.001"))
        made.append(
            calls.call_record(
                reservation=held,
                call=calls.Call(
                    provider="openai",
                    model="gpt-4o-mini",
                    prompt=prompt,
                    reply=reply,
                    status="ok",
                    cost_usd=Decimal("0.0001"),
                ),
            )
        )
        messages.append(_turn(n, "assistant"))
    return made


def _prompts(turns: int = TURNS) -> list[dict[str, Any]]:
    """The prompts ``_thread`` sends, as the worker saw them."""
    messages: list[dict[str, str]] = []
    prompts = []
    for n in range(turns):
        messages.append(_turn(n, "user"))
        prompts.append({"system": SYSTEM, "messages": list(messages)})
        messages.append(_turn(n, "assistant"))
    return prompts


def _stored_bytes() -> int:
    """What the content rows hold: each body's canonical JSON, and a digest for each part a
    row refers to (the digest column of every row is left out: one per row, either way)."""
    total = 0
    for body, head, rest in Content.objects.values_list("body", "head_id", "rest_id"):
        total += len(contents.canonical(body)) + 64 * ((head is not None) + (rest is not None))
    return total


def test_a_thread_of_50_calls_stores_each_message_once() -> None:
    run = RunFactory()
    made = _thread(run)
    prompts = _prompts()
    distinct = {contents.digest(m): m for p in prompts for m in p["messages"]}
    replies = [{"text": _turn(n, "assistant")["content"]} for n in range(TURNS)]
    once = (
        sum(len(contents.canonical(m)) for m in distinct.values())
        + len(contents.canonical(SYSTEM))
        + sum(len(contents.canonical(r)) for r in replies)
    )
    # Every prompt whole, as before: every earlier message again with every call.
    whole = sum(len(contents.canonical(p)) for p in prompts) + sum(
        len(contents.canonical(r)) for r in replies
    )
    stored = _stored_bytes()
    print(f"\nstored {stored} B; each value once {once} B; every prompt whole {whole} B")
    assert len(distinct) == 2 * TURNS - 1
    assert stored < 2 * once
    assert whole > 15 * once  # what the old scheme stored: quadratic
    # One row per message, per prompt, per reply, and the system text once.
    assert Content.objects.count() == len(distinct) + TURNS + TURNS + 1
    assert Content.objects.filter(body=SYSTEM).count() == 1
    # Linear: the second half of the thread added about what the first stored (as many
    # messages), not the three times more that storing every prompt whole did.
    half = _stored_bytes_after(made[: TURNS // 2])
    assert stored - half < 1.5 * half
    # Digests and sizes are the whole prompt's, as when prompts were stored whole.
    for call, prompt in zip(made, prompts, strict=True):
        call.prompt.refresh_from_db()
        assert call.prompt_id == contents.digest(prompt)
        assert call.prompt.size == len(contents.canonical(prompt))


def _stored_bytes_after(made: list[ModelCall]) -> int:
    """The bytes the rows of these calls' contents (with their parts) hold."""
    rows = contents.closure(d for c in made for d in (c.prompt_id, c.reply_id) if d)
    total = 0
    for body, head, rest in Content.objects.filter(digest__in=rows).values_list(
        "body", "head_id", "rest_id"
    ):
        total += len(contents.canonical(body)) + 64 * ((head is not None) + (rest is not None))
    return total


def test_pg_rows_grow_linearly_too() -> None:
    """What Postgres holds for the rows (``pg_column_size``: headers, digests, TOAST
    compression), for the figures in the notes."""
    _thread(RunFactory())
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT sum(pg_column_size(c.*)) FROM {Content._meta.db_table} c")
        [(size,)] = cursor.fetchall()
    whole = sum(len(contents.canonical(p)) for p in _prompts())
    print(f"\npg_column_size of the content rows: {size} B; every prompt whole: {whole} B")
    assert size < whole / 5


def test_every_reader_answers_the_whole_prompt(api: APIClient) -> None:
    run = RunFactory()
    made = _thread(run, turns=6)
    prompts = _prompts(turns=6)
    last, prompt = made[-1], prompts[-1]
    # The bodies, as the inspector and the compare page read them.
    assert contents.bodies([last.prompt_id])[last.prompt_id] == prompt
    assert compare._bodies([last.prompt_id, last.reply_id])[last.prompt_id] == prompt
    # The API's call, with its size and digest.
    found = api.get(f"/api/v1/runs/{run.id}/calls/{last.id}").json()
    assert found["prompt"] == {
        "digest": contents.digest(prompt),
        "size": len(contents.canonical(prompt)),
        **prompt,
    }
    assert found["prompt_size"] == len(contents.canonical(prompt))
    # The export: every prompt whole, its digest the whole prompt's.
    whole = json.loads("".join(export.run_export(run_id=run.id).chunks()))
    exported = [c for step in whole["run"]["steps"] for c in step["model_calls"]]
    assert [c["prompt"] for c in exported] == prompts
    assert [c["prompt_digest"] for c in exported] == [contents.digest(p) for p in prompts]
    # The admin's page of the attempt.
    shown = ModelCallInline(StepRun, admin.site).pretty_prompt(ModelCall.objects.get(id=last.id))
    assert prompt["messages"][-1]["content"] in shown


def test_a_prompt_stored_whole_before_reads_as_it_did() -> None:
    prompt = {"system": None, "messages": [{"role": "user", "content": "hi"}]}
    row = Content.objects.create(
        digest=contents.digest(prompt), body=prompt, size=len(contents.canonical(prompt))
    )
    assert contents.bodies([row.digest]) == {row.digest: prompt}
    assert contents.body(row) == prompt
    # Stored again, in parts: the row already stored stands (it is the same value).
    assert calls.digest(prompt) == row.digest
    contents.store([prompt])
    assert contents.body(Content.objects.get(digest=row.digest)) == prompt


def test_a_prompt_of_no_system_and_no_messages_round_trips() -> None:
    for prompt in (
        {"system": None, "messages": []},
        {"system": "s", "messages": []},
        {"system": "é ☃", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    ):
        digests = contents.store([prompt])
        assert contents.bodies(digests.values()) == {contents.digest(prompt): prompt}


def test_only_the_prompt_shape_is_stored_in_parts() -> None:
    for body in ({"text": "x"}, {"system": 3, "messages": []}, {"messages": [], "x": 1}, "t"):
        [row] = contents.rows_of(body)
        assert row.shape == Content.Shape.WHOLE and row.body == body


def test_purging_a_run_keeps_the_messages_another_run_shares() -> None:
    """Two runs on one thread (the second a fork of the first, repeating its first ten
    turns, then going on): purging the first keeps every message the second's prompts
    refer to; purging the second too leaves no content."""
    first, second = RunFactory(status=RunStatus.COMPLETED), RunFactory(status=RunStatus.COMPLETED)
    _thread(first, turns=10)
    kept = _thread(second, turns=15)
    before = Content.objects.count()
    _age([first.id], days=40)
    report = _purge()
    assert Run.objects.filter(id=first.id).count() == 0
    # Only what the first alone had: nothing, its thread is the second's first ten turns.
    assert Content.objects.count() == before
    assert report.deleted.get("runs.Content", 0) == 0
    wanted = _prompts(turns=15)
    found = contents.bodies(c.prompt_id for c in kept)
    assert [found[c.prompt_id] for c in kept] == wanted

    _age([second.id], days=40)
    _purge()
    assert Content.objects.count() == 0


def test_purging_one_of_two_threads_deletes_only_its_own_messages() -> None:
    shared, own = RunFactory(status=RunStatus.COMPLETED), RunFactory(status=RunStatus.COMPLETED)
    kept = _thread(shared, turns=5)
    _thread(own, turns=5, first=100)
    _age([own.id], days=40)
    _purge()
    # The other thread's rows, every one: five prompts, nine messages, five replies, the
    # system text.
    assert Content.objects.count() == 5 + 9 + 5 + 1
    assert [contents.body(c.prompt) for c in kept] == _prompts(turns=5)
