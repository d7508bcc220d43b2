"""Workflows of the recovery tests (``tests/runs/test_recovery_e2e.py``).

Their handlers write each execution to the side table of ``tests.runs.flows``, like the other
end-to-end flows, but through a connection that may be killed under them (the tests terminate
every backend of the database mid-run): a note survives that by reconnecting, and its retry is
idempotent, so the side table still counts each execution of a body exactly once.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import InterfaceError, OperationalError, connection

from workflows.sdk import workflow

from .flows import EFFECTS_TABLE

# One execution of a body: (run id, step id, attempt, pid, start time).
Execution = tuple[str, str, int, int, float]


def _resilient(sql: str, params: list[Any]) -> None:
    """Run one idempotent statement, reconnecting through killed connections (the body runs
    outside any transaction, so closing the connection loses nothing of the engine's)."""
    for pause in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2):
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
            return
        except (OperationalError, InterfaceError):
            connection.close()
            time.sleep(pause)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def note(ctx: Any) -> Execution:
    """Record that this body started; returns the execution's identity for ``done``.

    Only inserted when not already there: a retry after a lost reply (the insert committed,
    the connection died before the answer) must not count the execution twice.
    """
    execution = (ctx.run_id, ctx.step_id, ctx.attempt, os.getpid(), time.time())
    _resilient(
        f"INSERT INTO {EFFECTS_TABLE} (run_id, step, attempt, pid, started)"
        " SELECT %s, %s, %s, %s, %s WHERE NOT EXISTS (SELECT 1 FROM "
        f"{EFFECTS_TABLE} WHERE run_id = %s AND step = %s AND attempt = %s AND pid = %s"
        " AND started = %s)",
        [*execution, *execution],
    )
    return execution


def done(execution: Execution) -> None:
    _resilient(
        f"UPDATE {EFFECTS_TABLE} SET finished = %s WHERE run_id = %s AND step = %s"
        " AND attempt = %s AND pid = %s AND started = %s",
        [time.time(), *execution],
    )


def _work(ctx: Any, input: Any, prior: Any) -> Any:
    execution = note(ctx)
    time.sleep(input.get("pause", 0.2))
    done(execution)
    return {"step": ctx.step_id, "n": input["n"]}


# --- many short runs: at_least_once and at_most_once steps, and a timer between them ------

RELAY_EFFECTS = {
    "s1": "at_least_once",
    "s2": "at_most_once",
    "s3": "at_least_once",
    "s4": "at_most_once",
}

relay = workflow("relay", limits={"run_timeout_ms": 120_000})
relay.step("s1", input="${input}", effect="at_least_once")(_work)
relay.step("s2", input="${input}", effect="at_most_once")(_work)
# A timer between steps: the run resumes only if beat's tick still reaches a worker.
relay.sleep("nap", ms=300)
relay.step("s3", input="${input}", effect="at_least_once")(_work)
relay.step("s4", input="${input}", effect="at_most_once")(_work)
relay.output({"n": "${input.n}", "last": "${steps.s4.output}"})


# --- one slow step whose worker is killed under it -----------------------------------------


def _slow(ctx: Any, input: Any, prior: Any) -> Any:
    execution = note(ctx)
    time.sleep(input["seconds"])
    done(execution)
    return {"slept": input["seconds"]}


def _tail(ctx: Any, input: Any, prior: Any) -> Any:
    note(ctx)
    return "tail"


for _name, _effect, _on_error in (
    ("doomed_at_least_once", "at_least_once", "fail_run"),
    ("doomed_at_most_once", "at_most_once", "fail_run"),
    ("doomed_at_most_once_continue", "at_most_once", "continue"),
):
    _doomed = workflow(_name, limits={"run_timeout_ms": 120_000})
    _doomed.step("slow", input="${input}", effect=_effect, on_error=_on_error, timeout_ms=60_000)(
        _slow
    )
    _doomed.step("tail")(_tail)


# --- a long step on a queue of its own, running while the broker restarts -----------------

lingering = workflow("lingering", limits={"run_timeout_ms": 120_000})
lingering.step("long", input="${input}", effect="at_most_once", queue="long", timeout_ms=60_000)(
    _work
)
lingering.step("after", input={"n": "${input.n}"})(_work)
