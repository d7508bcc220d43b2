"""Workflows with parallel, foreach and loop steps, run by the composition e2e tests."""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from workflows import registry
from workflows.sdk import RetryPolicy, StepFailure, foreach, task, workflow

from .flows import EFFECTS_TABLE, done

LIMITS = {"run_timeout_ms": 120_000}


def note_item(ctx: Any, label: str) -> int:
    """Record that the body for ``label`` (an item, a branch) started; returns the row id."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS_TABLE} (run_id, step, attempt, pid, started)"
            " VALUES (%s, %s, %s, %s, %s) RETURNING id",
            [ctx.run_id, label, ctx.attempt, os.getpid(), time.time()],
        )
        return cursor.fetchone()[0]


# --- foreach with mixed outcomes --------------------------------------------------------------

fanout = workflow("fanout", limits=LIMITS)
fanout.foreach(
    "fan",
    items="${input.items}",
    do=task(
        "work",
        input={"item": "${item}", "index": "${index}"},
        on_error="continue",
        retry=RetryPolicy(max_attempts=2, backoff="fixed", initial_ms=200, jitter=False),
    ),
)
fanout.output("${steps.fan.output}")


def _work(ctx: Any, input: Any, prior: Any) -> Any:
    item = input["item"]
    note_item(ctx, f"work:{item}")
    # Later items finish first: the output must still be in item order.
    time.sleep(0.05 * (5 - input["index"] % 5))
    if item == "broken":
        raise StepFailure("this item cannot be done", class_="fatal")
    if item == "flaky" and ctx.attempt == 1:
        raise StepFailure("try me again", class_="retryable")
    return f"{item}!"


registry.register("fanout", "work", _work)


# --- foreach with a concurrency cap ------------------------------------------------------------

capped = workflow("capped", limits=LIMITS)
capped.foreach("fan", items="${input.items}", concurrency=3, do=task("slow"))


def _slow(ctx: Any, input: Any, prior: Any) -> Any:
    row = note_item(ctx, f"slow:{input}")
    time.sleep(0.15)
    done(row)
    return input


registry.register("capped", "slow", _slow)


# --- loops ---------------------------------------------------------------------------------

counting = workflow("counting", limits=LIMITS)
counting.loop(
    "lp",
    max_iterations=10,
    until={"path": "iter.previous.n", "op": "gte", "value": 2},
    do=task("tick", input={"n": "${iter.index}", "prev": "${iter.previous}"}),
)


def _tick(ctx: Any, input: Any, prior: Any) -> Any:
    note_item(ctx, f"tick:{input['n']}")
    return {"n": input["n"], "had": input["prev"]}


registry.register("counting", "tick", _tick)


# --- parallel, with a nested foreach in one branch ------------------------------------------

fork = workflow("fork", limits=LIMITS)
fork.parallel(
    "par",
    branches={
        "left": task("left", input={"x": "${input.x}"}),
        "right": foreach("many", items=[1, 2, 3], do=task("double", input="${item}")),
        "failing": task("failing", on_error="continue"),
    },
)


@fork.step("after", input="${steps.par.output}")
def _after(ctx: Any, input: Any, prior: Any) -> Any:
    return input


registry.register("fork", "left", lambda ctx, input, prior: input["x"] * 10)
registry.register("fork", "double", lambda ctx, input, prior: input * 2)


def _failing(ctx: Any, input: Any, prior: Any) -> Any:
    raise StepFailure("this branch fails", class_="fatal")


registry.register("fork", "failing", _failing)


# A loop whose until never holds: it ends by max_iterations.
endless = workflow("endless", limits=LIMITS)
endless.loop(
    "lp",
    max_iterations=3,
    until={"path": "iter.previous.n", "op": "lt", "value": 0},
    do=task("spin", input={"n": "${iter.index}"}),
)
registry.register("endless", "spin", lambda ctx, input, prior: {"n": input["n"] * 10})
