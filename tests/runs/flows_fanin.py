"""Workflows of the fan-in tests (``tests/runs/test_fanin_e2e.py``).

Every body writes its start to the side table of ``tests.runs.flows`` (label, attempt, pid,
time), so a test counts real executions whatever the journal says. The worker also notes
each ``runs.advance`` it runs under a chord-body marker task id (see ``CHORD_BODY``): the
tests give the fan-out chords' bodies such ids, and so see when, and how often, a chord
body really fired.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery.signals import task_prerun
from django.db import connection

from workflows import registry
from workflows.sdk import RetryPolicy, StepFailure, parallel, subworkflow, task, workflow

from .flows import EFFECTS_TABLE, done

LIMITS = {"run_timeout_ms": 120_000}
# Task ids the tests give the chord bodies they send start with this.
CHORD_BODY = "chord-body-"
CHORD_BODY_STEP = "chord-body"
BACKOFF_MS = 2000


def note_label(run_id: str, label: str, attempt: int) -> int:
    """Record that ``label`` started in ``run_id``; returns the row id for ``done``."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS_TABLE} (run_id, step, attempt, pid, started)"
            " VALUES (%s, %s, %s, %s, %s) RETURNING id",
            [run_id, label, attempt, os.getpid(), time.time()],
        )
        return cursor.fetchone()[0]


@task_prerun.connect
def _note_chord_body(task_id: str = "", task: Any = None, args: Any = (), **_: Any) -> None:
    """In the worker: a chord body the test marked is about to run its advance."""
    if getattr(task, "name", "") == "runs.advance" and str(task_id).startswith(CHORD_BODY):
        note_label(str(args[0]), CHORD_BODY_STEP, 0)


# --- a foreach with a step after it -----------------------------------------------------------

chorded = workflow("chorded", limits=LIMITS)
chorded.foreach(
    "fan",
    items="${input.items}",
    do=task(
        "item",
        input={"item": "${item}", "index": "${index}"},
        retry=RetryPolicy(max_attempts=2, backoff="fixed", initial_ms=BACKOFF_MS, jitter=False),
    ),
)


@chorded.step("after", input="${steps.fan.output}")
def _after(ctx: Any, input: Any, prior: Any) -> Any:
    note_label(ctx.run_id, "after", ctx.attempt)
    return input


def _item(ctx: Any, input: Any, prior: Any) -> Any:
    item, index = input["item"], input["index"]
    row = note_label(ctx.run_id, f"item:{index}", ctx.attempt)
    # Later items finish first: the output must still be in item order.
    time.sleep(0.03 * (5 - index % 5))
    done(row)
    if item == "flaky" and ctx.attempt == 1:
        raise StepFailure("try me again", class_="retryable")
    return f"{item}@{ctx.attempt}"


registry.register("chorded", "item", _item)


# --- a parallel first (its branches are the first fan-out, planned by the start) -----------

branched = workflow("branched", limits=LIMITS)
branched.add(
    parallel(
        "both",
        branches={
            name: task(f"branch_{name}", input={"name": name})
            for name in ("north", "south", "east")
        },
    )
)


@branched.step("joined", input="${steps.both.output}")
def _joined(ctx: Any, input: Any, prior: Any) -> Any:
    note_label(ctx.run_id, "joined", ctx.attempt)
    return input


def _branch(ctx: Any, input: Any, prior: Any) -> Any:
    note_label(ctx.run_id, f"branch:{input['name']}", ctx.attempt)
    return input["name"]


for _name in ("north", "south", "east"):
    registry.register("branched", f"branch_{_name}", _branch)


# --- a wide fan-out ------------------------------------------------------------------------

wide = workflow("wide", limits=LIMITS)
wide.foreach(
    "fan",
    items="${input.items}",
    do=task("piece", input={"item": "${item}", "index": "${index}", "pause": "${input.pause}"}),
)


@wide.step("after", input="${steps.fan.output}")
def _wide_after(ctx: Any, input: Any, prior: Any) -> Any:
    note_label(ctx.run_id, "after", ctx.attempt)
    return input


def _piece(ctx: Any, input: Any, prior: Any) -> Any:
    row = note_label(ctx.run_id, f"piece:{input['index']}", ctx.attempt)
    time.sleep(input["pause"])
    done(row)
    return {"item": input["item"], "attempt": ctx.attempt}


registry.register("wide", "piece", _piece)


# --- one slow item among fast ones (sent several to a message: workers.batches) -----------

lopsided = workflow("lopsided", limits=LIMITS)
lopsided.foreach(
    "fan",
    items="${input.items}",
    do=task("slice", input={"index": "${index}", "slow": "${input.slow}"}),
)


def _slice(ctx: Any, input: Any, prior: Any) -> Any:
    row = note_label(ctx.run_id, f"slice:{input['index']}", ctx.attempt)
    time.sleep(input["slow"] if input["index"] == 0 else 0.01)
    done(row)
    return input["index"]


registry.register("lopsided", "slice", _slice)


# --- three generations: a foreach of children, each with a child of its own ---------------------

family = workflow("family", limits=LIMITS)
family.foreach(
    "kids",
    items="${input.kids}",
    do=subworkflow(
        "kid", workflow="family_mid", input={"kid": "${item}", "seconds": "${input.seconds}"}
    ),
)
family.step("family_after")(lambda ctx, input, prior: note_label(ctx.run_id, "family_after", 1))

family_mid = workflow("family_mid", limits=LIMITS)
family_mid.add(
    parallel(
        "both",
        branches={
            "grand": subworkflow("grand", workflow="family_leaf", input="${input}"),
            "own": task("mid_work", input="${input}"),
        },
    )
)
family_mid.step("mid_after")(lambda ctx, input, prior: note_label(ctx.run_id, "mid_after", 1))

family_leaf = workflow("family_leaf", limits=LIMITS)


def _sleeper(label: str) -> Any:
    def body(ctx: Any, input: Any, prior: Any) -> Any:
        row = note_label(ctx.run_id, label, ctx.attempt)
        time.sleep(input["seconds"])
        done(row)
        return {label: input["kid"]}

    return body


family_leaf.step("leaf_work")(_sleeper("leaf_work"))
family_leaf.step("leaf_after")(lambda ctx, input, prior: note_label(ctx.run_id, "leaf_after", 1))
registry.register("family_mid", "mid_work", _sleeper("mid_work"))
