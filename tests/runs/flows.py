"""Workflows the end-to-end tests run on real workers (loaded with WORKFLOW_MODULES).

Handlers write each execution to a side table, so tests can prove how many times a body
really ran, whatever the journal says.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection

from workflows.sdk import RetryPolicy, StepFailure, when, workflow

EFFECTS_TABLE = "djflow_test_effects"


def ensure_effects_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} ("
            " id bigserial PRIMARY KEY, run_id text NOT NULL, step text NOT NULL,"
            " attempt int NOT NULL, pid int NOT NULL,"
            " started double precision NOT NULL, finished double precision)"
        )


def note(ctx: Any) -> int:
    """Record that this body started; returns the row id to mark it finished."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS_TABLE} (run_id, step, attempt, pid, started)"
            " VALUES (%s, %s, %s, %s, %s) RETURNING id",
            [ctx.run_id, ctx.step_id, ctx.attempt, os.getpid(), time.time()],
        )
        return cursor.fetchone()[0]


def done(row_id: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {EFFECTS_TABLE} SET finished = %s WHERE id = %s", [time.time(), row_id]
        )


def effects(run_id: str, step: str | None = None) -> list[tuple]:
    sql = f"SELECT step, attempt, pid, started, finished FROM {EFFECTS_TABLE} WHERE run_id = %s"
    params: list[Any] = [str(run_id)]
    if step is not None:
        sql += " AND step = %s"
        params.append(step)
    with connection.cursor() as cursor:
        cursor.execute(sql + " ORDER BY id", params)
        return cursor.fetchall()


# --- retries ------------------------------------------------------------------------------

flaky = workflow("flaky", limits={"run_timeout_ms": 60_000})


@flaky.step("first")
def first(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"fail_times": input["fail_times"]}


@flaky.step(
    "wobbly",
    retry=RetryPolicy(max_attempts=3, backoff="exponential", initial_ms=300, jitter=False),
)
def wobbly(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    if ctx.attempt <= input["fail_times"]:
        raise StepFailure(f"busy on attempt {ctx.attempt}", class_="retryable")
    return {"attempt": ctx.attempt, "key": ctx.idempotency_key, "first": prior["first"]}


recovering = workflow("recovering", limits={"run_timeout_ms": 60_000})


@recovering.step("breaks", on_error="continue")
def breaks(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    raise ValueError("the body broke")


@recovering.step(
    "after",
    input={"status": "${steps.breaks.status}", "class": "${steps.breaks.error.class}"},
    when=when("steps.breaks.status", "eq", "failed"),
)
def after(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return {"saw": input}


# --- effects under a lost worker ---------------------------------------------------------

for _effect in ("at_least_once", "at_most_once"):
    _slow = workflow(f"slow_{_effect}", limits={"run_timeout_ms": 120_000})

    def _body(ctx: Any, input: Any, prior: Any) -> Any:
        row = note(ctx)
        time.sleep(input.get("seconds", 4))
        done(row)
        return {"slept": True}

    _slow.step("slow", effect=_effect, timeout_ms=60_000)(_body)

    def _tail(ctx: Any, input: Any, prior: Any) -> Any:
        note(ctx)
        return "tail"

    _slow.step("tail")(_tail)


# --- limits -------------------------------------------------------------------------------

runaway = workflow("runaway", limits={"max_steps": 5, "run_timeout_ms": 60_000})


@runaway.step("spin", retry=RetryPolicy(max_attempts=100, backoff="none"))
def spin(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    raise StepFailure("again", class_="retryable")


costly = workflow("costly", limits={"max_cost_usd": 0.05, "run_timeout_ms": 60_000})


def _spend(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    with ctx.span("model_call", kind="model_generation") as span:
        span.set_model("claude-sonnet-4", "anthropic")
        # 10,000 in + 2,000 out on claude-sonnet-4 = $0.03 + $0.03 = $0.06 > $0.05
        span.set_usage(input_tokens=10_000, output_tokens=2_000)
    return "spent"


costly.agent("think")(_spend)
costly.agent("think_again")(_spend)


# --- operator actions ---------------------------------------------------------------------

steady = workflow("steady", limits={"run_timeout_ms": 120_000})

for _n in range(1, 7):

    def _tick(ctx: Any, input: Any, prior: Any, n: int = _n) -> Any:
        note(ctx)
        time.sleep(0.4)
        return n

    steady.step(f"tick_{_n}")(_tick)


fragile = workflow("fragile", limits={"run_timeout_ms": 60_000})


@fragile.step("one")
def one(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return 1


@fragile.step("two")
def two(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {EFFECTS_TABLE} WHERE run_id = %s AND step = 'two'",
            [ctx.run_id],
        )
        runs_so_far = cursor.fetchone()[0]
    if runs_so_far == 1:
        raise StepFailure("broken the first time", class_="fatal")
    return 2


@fragile.step("three")
def three(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return prior["one"] + prior["two"]


# --- a step whose handler no worker has -------------------------------------------------

orphan = workflow("orphan", limits={"run_timeout_ms": 60_000})
orphan.task("nobody_home", handler="not.registered.anywhere")


# --- time limits ---------------------------------------------------------------------------

sluggish = workflow("sluggish", limits={"run_timeout_ms": 60_000})


@sluggish.step("slow", timeout_ms=1000, retry=RetryPolicy(max_attempts=2, backoff="none"))
def slow(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    if ctx.attempt == 1:
        time.sleep(3)  # Celery's soft time limit interrupts this at 1 s
    return {"attempt": ctx.attempt}


stubborn = workflow("stubborn", limits={"run_timeout_ms": 60_000})


@stubborn.step("deaf", timeout_ms=1000, retry=RetryPolicy(max_attempts=2, backoff="none"))
def deaf(ctx: Any, input: Any, prior: Any) -> Any:
    row = note(ctx)
    if ctx.attempt == 1:
        # A body that swallows the soft time limit: only the engine can time it out.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(SoftTimeLimitExceeded):
                time.sleep(deadline - time.monotonic())
    done(row)
    return {"attempt": ctx.attempt}


overdue = workflow("overdue", limits={"run_timeout_ms": 2000})


@overdue.step("long", timeout_ms=10_000)
def long(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    time.sleep(5)
    return "too late"


inline = workflow("inline", limits={"run_timeout_ms": 60_000})


@inline.step("quick")
def quick(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return os.getpid()


@inline.step("capped", timeout_ms=1000)
def capped(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    time.sleep(3)  # run inline, after "quick": only the worker's own alarm stops it at 1 s
    return "never"
