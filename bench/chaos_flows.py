"""The workflows of the chaos suite (``bench/chaos.py``), loaded by its workers through
``WORKFLOW_MODULES``.

Five shapes, each with ``at_most_once`` steps among ``at_least_once`` ones: a sequence with a
sleep, a ``foreach``, a ``parallel``, a ``wait_event`` the script answers, and an
``approval`` the script decides through the API. :func:`expected` computes what each run must
end with from its input alone, so the script checks every run's output without trusting the
engine's journal.

Every body appends one line to the effects file (``DJFLOW_CHAOS_EFFECTS``) *before* it does
anything else, with ``O_APPEND`` and a single ``write``: the line is the body's effect. It is
written outside every database transaction (nothing the engine rolls back, and no Postgres
restart, can take it back), lands in the kernel's page cache before the call returns (a
SIGKILL an instant later loses nothing), and a line under ``PIPE_BUF`` bytes is never
interleaved with another process's. So two lines with one ``at_most_once`` idempotency key
prove a body ran twice; a side table written through the engine's own connection could not,
since a restart between the body and its commit would lose the row with the evidence.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from workflows.sdk import task, workflow

EVENT = "chaos_go"
APPROVER = "chaos"
# Long enough that no run times out while Postgres or Redis is down, or while it waits for
# the script's event or decision: a timeout would be the engine keeping its word, not a loss.
LIMITS = {"run_timeout_ms": 3_600_000}
WAIT_MS = 1_800_000


def _effect(ctx: Any, effect: str) -> None:
    path = os.environ.get("DJFLOW_CHAOS_EFFECTS")
    if not path:
        return
    line = json.dumps(
        {
            "run": str(ctx.run_id),
            "step": ctx.step_id,
            "key": ctx.idempotency_key,
            "attempt": ctx.attempt,
            "effect": effect,
            "pid": os.getpid(),
            "at": time.time(),
        }
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _busy(effect: str) -> None:
    # Long enough that a SIGKILL often lands mid-body, short enough for a thousand runs. An
    # at_most_once body is quicker: a kill in one gives its run up (see bench/chaos.py), and
    # the mix should mostly complete.
    time.sleep(random.uniform(0.1, 0.6) if effect == "at_least_once" else random.uniform(0, 0.05))


# --- a sequence: at_least_once, at_most_once, a sleep (a timer), at_most_once --------------

seq = workflow("chaos_seq", limits=LIMITS)


@seq.step("plus_one", effect="at_least_once")
def _plus_one(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_least_once")
    _busy("at_least_once")
    return input["n"] + 1


@seq.step("double", input="${steps.plus_one.output}", effect="at_most_once")
def _double(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_most_once")
    _busy("at_most_once")
    return input * 2


seq.sleep("nap", ms=1_000)


@seq.step("plus_three", input="${steps.double.output}", effect="at_most_once")
def _plus_three(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_most_once")
    _busy("at_most_once")
    return input + 3


seq.output({"result": "${steps.plus_three.output}"})


# --- a foreach of at_least_once items, then an at_most_once total --------------------------

fan = workflow("chaos_foreach", limits=LIMITS)
fan.foreach("squares", items="${input.items}", do=task("square", input="${item}"))


@fan.handler("square")
def _square(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_least_once")
    _busy("at_least_once")
    return input * input


@fan.step("total", input="${steps.squares.output}", effect="at_most_once")
def _total(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_most_once")
    _busy("at_most_once")
    return sum(input)


fan.output({"squares": "${steps.squares.output}", "total": "${steps.total.output}"})


# --- a parallel of an at_least_once and an at_most_once branch, then a sleep ---------------

par = workflow("chaos_parallel", limits=LIMITS)
par.parallel(
    "both",
    branches={
        "twice": task("twice", input="${input.n}"),
        "negated": task("negated", input="${input.n}", effect="at_most_once"),
    },
)


@par.handler("twice")
def _twice(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_least_once")
    _busy("at_least_once")
    return input * 2


@par.handler("negated")
def _negated(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_most_once")
    _busy("at_most_once")
    return -input


par.sleep("settle", ms=500)
par.output({"both": "${steps.both.output}"})


# --- a wait for the script's event ----------------------------------------------------------

wait = workflow("chaos_event", limits=LIMITS)


@wait.step("prepare", effect="at_least_once")
def _prepare(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_least_once")
    _busy("at_least_once")
    return input["n"]


wait.wait_for("go", event=EVENT, key="${input.key}", timeout_ms=WAIT_MS)


@wait.step("use", input={"n": "${steps.prepare.output}", "event": "${steps.go.output}"})
def _use(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_least_once")
    return input["n"] + input["event"]["value"]


wait.output({"got": "${steps.use.output}"})


# --- an approval the script decides through the API -----------------------------------------

gate = workflow("chaos_approval", limits=LIMITS)
gate.approval(
    "gate", approvers={"users": [APPROVER]}, message="Chaos run ${input.n}", timeout_ms=WAIT_MS
)


@gate.step(
    "ship",
    input={"n": "${input.n}", "decision": "${steps.gate.output.decision}"},
    effect="at_most_once",
)
def _ship(ctx: Any, input: Any, prior: Any) -> Any:
    _effect(ctx, "at_most_once")
    _busy("at_most_once")
    return {"shipped": input["n"], "decision": input["decision"]}


gate.output({"ship": "${steps.ship.output}"})


WORKFLOWS = ("chaos_seq", "chaos_foreach", "chaos_parallel", "chaos_event", "chaos_approval")


def make_input(workflow_id: str, n: int) -> dict[str, Any]:
    """The input of the ``n``-th run of ``workflow_id`` (deterministic: the check recomputes
    it)."""
    if workflow_id == "chaos_foreach":
        return {"items": list(range(n % 5 + 2))}
    if workflow_id == "chaos_event":
        return {"n": n, "key": f"chaos-{n}"}
    return {"n": n}


def rejected(n: int) -> bool:
    """The script rejects every fourth approval: that run must fail, class ``rejected``."""
    return n % 4 == 0


def event_value(n: int) -> int:
    return 1_000 + n


def expected(workflow_id: str, n: int) -> tuple[str, Any]:
    """(status, output) the ``n``-th run of ``workflow_id`` must end with; for a run that must
    fail, the output is its error's class."""
    if workflow_id == "chaos_seq":
        return "completed", {"result": (n + 1) * 2 + 3}
    if workflow_id == "chaos_foreach":
        squares = [i * i for i in range(n % 5 + 2)]
        return "completed", {"squares": squares, "total": sum(squares)}
    if workflow_id == "chaos_parallel":
        return "completed", {"both": {"twice": 2 * n, "negated": -n}}
    if workflow_id == "chaos_event":
        return "completed", {"got": n + event_value(n)}
    if workflow_id == "chaos_approval":
        if rejected(n):
            return "failed", "rejected"
        return "completed", {"ship": {"shipped": n, "decision": "approved"}}
    raise ValueError(workflow_id)
