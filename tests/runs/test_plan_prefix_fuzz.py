"""random documents and random journals; every plan from a process's kept prefix
must equal the plan of the whole journal (the claim of plan.Prefix)."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runs.engine.plan import (
    AttemptView,
    Cancel,
    Close,
    Expire,
    Finish,
    Open,
    Prefix,
    RunView,
    Schedule,
    Skip,
    StartRun,
    Wake,
    plan,
    positions_of,
    prefix_applies,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Gen:
    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.ids = itertools.count(1)
        self.done: list[str] = []  # ids of top-level steps before (for templates/guards)

    def sid(self, prefix: str) -> str:
        return f"{prefix}{next(self.ids)}"

    def task(self, depth: int = 0) -> dict[str, Any]:
        r = self.rnd
        step: dict[str, Any] = {"id": self.sid("t"), "kind": "task", "handler": "h"}
        if r.random() < 0.3:
            step["retry"] = {
                "max_attempts": r.randint(1, 3),
                "backoff": r.choice(["none", "fixed"]),
                "initial_ms": 1000,
            }
        if r.random() < 0.3:
            step["on_error"] = "continue"
        if r.random() < 0.15:
            step["effect"] = "at_most_once"
        if self.done and r.random() < 0.3:
            step["input"] = {
                "a": f"${{steps.{r.choice(self.done)}.output}}",
                "s": f"${{steps.{r.choice(self.done)}.status}}",
            }
        if self.done and r.random() < 0.2:
            step["when"] = {
                "path": f"steps.{r.choice(self.done)}.status",
                "op": "eq",
                "value": "succeeded",
            }
        return step

    def body(self, depth: int) -> Any:
        r = self.rnd
        if r.random() < 0.3:
            return [self.task(depth + 1), self.task(depth + 1)]
        if depth < 1 and r.random() < 0.3:
            return self.step(depth + 1, inner=True)
        return self.task(depth + 1)

    def step(self, depth: int = 0, inner: bool = False) -> dict[str, Any]:
        r = self.rnd
        k = r.random()
        if k < 0.35:
            return self.task(depth)
        if k < 0.45:
            return {"id": self.sid("s"), "kind": "sleep", "ms": r.choice([0, 500, 3000])}
        if k < 0.6 and depth < 2:
            cond: dict[str, Any] = {
                "id": self.sid("c"),
                "kind": "condition",
                "if": {"path": "input.x", "op": "eq", "value": r.randint(0, 1)},
                "then": [self.task(depth + 1) for _ in range(r.randint(0, 2))],
                "else": [self.step(depth + 1, True) for _ in range(r.randint(1, 2))],
            }
            return cond
        if k < 0.72 and depth < 2:
            s: dict[str, Any] = {
                "id": self.sid("f"),
                "kind": "foreach",
                "items": list(range(r.randint(0, 3))),
                "do": self.body(depth),
            }
            if r.random() < 0.4:
                s["concurrency"] = r.randint(1, 2)
            if r.random() < 0.3:
                s["on_error"] = "continue"
            return s
        if k < 0.84 and depth < 2:
            s = {
                "id": self.sid("p"),
                "kind": "parallel",
                "branches": {f"b{i}": self.body(depth) for i in range(r.randint(1, 3))},
            }
            if r.random() < 0.3:
                s["on_error"] = "continue"
            return s
        if k < 0.92 and depth < 2:
            s = {
                "id": self.sid("l"),
                "kind": "loop",
                "max_iterations": r.randint(1, 3),
                "do": self.body(depth),
            }
            if r.random() < 0.5:
                s["until"] = {"path": "iter.index", "op": "eq", "value": r.randint(0, 2)}
            return s
        return {"id": self.sid("w"), "kind": "subworkflow", "workflow": "other"}

    def document(self) -> dict[str, Any]:
        r = self.rnd
        steps = []
        for _ in range(r.randint(2, 7)):
            s = self.step()
            if self.done and s["kind"] != "task" and r.random() < 0.2:
                s["when"] = {
                    "path": f"steps.{r.choice(self.done)}.status",
                    "op": "eq",
                    "value": r.choice(["succeeded", "failed", "skipped"]),
                }
            if s["kind"] == "foreach" and self.done and r.random() < 0.3:
                s["items"] = f"${{steps.{r.choice(self.done)}.output.list}}"
            steps.append(s)
            self.done.append(s["id"])
        doc: dict[str, Any] = {"id": "fuzz", "steps": steps, "limits": {"run_timeout_ms": 10**9}}
        if r.random() < 0.4:
            doc["limits"]["max_steps"] = r.randint(3, 25)
        if r.random() < 0.3:
            doc["output"] = {"o": f"${{steps.{r.choice(self.done)}.output}}"}
        return doc


class Sim:
    def __init__(self, rnd: random.Random, doc: dict[str, Any]) -> None:
        self.rnd = rnd
        self.doc = doc
        self.rows: list[AttemptView] = []
        self.ids = itertools.count(1)
        self.now = T0
        self.generation = 1
        self.status = "pending"
        self.started_at = None
        self.deadline_at = None
        self.tree_used = 0
        self.children = itertools.count(1)

    def view(self) -> RunView:
        return RunView(
            id="r1",
            status=self.status,
            input={"x": 1},
            correlation=None,
            generation=self.generation,
            started_at=self.started_at,
            deadline_at=self.deadline_at,
            tree_used=self.tree_used,
            tree_limit=None,
        )

    def set(self, row_id: int, **changes: Any) -> None:
        self.rows = [replace(r, **changes) if r.id == row_id else r for r in self.rows]

    def add(self, action: Any, **row: Any) -> None:
        """A row for a Schedule, Skip or Open action."""
        self.rows.append(
            AttemptView(
                id=next(self.ids),
                step_id=action.step_id,
                path=action.path,
                kind=action.kind,
                attempt=action.attempt,
                generation=action.generation,
                **row,
            )
        )

    def apply(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, StartRun):
                self.started_at, self.deadline_at = a.started_at, a.deadline_at
                self.status = "running"
            elif isinstance(a, Schedule):
                self.add(a, status="scheduled", effect=a.effect)
            elif isinstance(a, Skip):
                self.add(a, status="skipped", finished_at=self.now)
            elif isinstance(a, Open):
                ended = a.status in ("succeeded", "failed")
                child = None
                if a.start is not None:
                    child = {
                        "id": f"c{next(self.children)}",
                        "status": "running",
                        "output": None,
                        "error": None,
                    }
                self.add(
                    a,
                    status=a.status,
                    branch=a.branch,
                    output=a.output,
                    error=a.error,
                    not_before=a.not_before,
                    child=child,
                    finished_at=self.now if ended else None,
                )
            elif isinstance(a, Close):
                self.set(
                    a.attempt_id,
                    status=a.status,
                    output=a.output,
                    error=a.error,
                    finished_at=self.now,
                    child=None,
                )
            elif isinstance(a, Cancel):
                for i in a.attempt_ids:
                    row = next(r for r in self.rows if r.id == i)
                    if row.status in ("scheduled", "running", "waiting"):
                        self.set(i, status="cancelled", finished_at=self.now, child=None)
            elif isinstance(a, Expire):
                self.set(a.attempt_id, status=a.status, error=a.error, finished_at=self.now)
            elif isinstance(a, Finish):
                self.status = a.status
            elif isinstance(a, Wake):
                pass

    def work(self) -> None:
        """One random thing happens outside the planner."""
        r = self.rnd
        busy = [x for x in self.rows if x.status in ("scheduled", "running")]
        waiting_children = [
            x
            for x in self.rows
            if x.status == "waiting" and x.child is not None and x.child["status"] == "running"
        ]
        choice = r.random()
        if busy and choice < 0.6:
            row = r.choice(busy)
            outcome = r.random()
            if row.status == "scheduled" and outcome < 0.2:
                self.set(
                    row.id,
                    status="running",
                    lease_expires_at=self.now + timedelta(seconds=30),
                    deadline_at=self.now + timedelta(seconds=60),
                )
            elif outcome < 0.65:
                self.set(
                    row.id,
                    status="succeeded",
                    output={"v": r.randint(0, 3), "list": list(range(r.randint(0, 3)))},
                    finished_at=self.now,
                )
            elif outcome < 0.9:
                cls = r.choice(["retryable", "fatal", "timeout"])
                self.set(
                    row.id,
                    status="timed_out" if cls == "timeout" else "failed",
                    error={"class": cls, "message": "x"},
                    finished_at=self.now,
                )
            else:
                self.set(
                    row.id,
                    status="running",
                    lease_expires_at=self.now - timedelta(seconds=1),
                    deadline_at=self.now + timedelta(seconds=60),
                )
        elif waiting_children and choice < 0.8:
            row = r.choice(waiting_children)
            st = r.choice(["completed", "completed", "failed"])
            self.set(
                row.id,
                child={
                    **row.child,
                    "status": st,
                    "output": {"c": 1} if st == "completed" else None,
                    "error": {"class": "fatal", "message": "c"} if st != "completed" else None,
                },
            )
        else:
            self.now += timedelta(milliseconds=r.choice([100, 1000, 5000]))


def _keep(kept: Prefix | None, new: Prefix | None) -> Prefix | None:
    if new is None:
        return kept
    if kept is not None and kept.generation == new.generation and kept.steps > new.steps:
        return kept
    return new


def run_one(seed: int) -> tuple[int, int]:
    rnd = random.Random(seed)
    doc = Gen(rnd).document()
    positions = positions_of(doc["steps"])
    sim = Sim(rnd, doc)
    caches: list[Prefix | None] = [None, None, None]
    used = 0
    for _ in range(400):
        if sim.status in ("completed", "cancelled", "timed_out"):
            break
        if sim.status == "failed":
            if rnd.random() < 0.5 and sim.generation < 3:
                sim.generation += 1  # a whole retry: a new generation
                sim.status = "running"
                sim.started_at = sim.deadline_at = None
            else:
                break
        if rnd.random() < 0.5:
            sim.work()
            continue
        p = rnd.randrange(len(caches))
        budget = rnd.choice([None, 1, 2, 5])
        view = sim.view()
        whole = plan(doc, view, sim.rows, sim.now, max_actions=budget, positions=positions)
        prefix = caches[p]
        if prefix is not None and not prefix_applies(doc, view.generation, view.reruns, prefix):
            prefix = None
        if prefix is not None:
            used += 1
            partial = plan(
                doc,
                view,
                [r for r in sim.rows if r.id > prefix.through_id],
                sim.now,
                max_actions=budget,
                prefix=prefix,
                positions=positions,
            )
            mine = (partial.actions, partial.waiting, partial.approval, partial.more)
            theirs = (whole.actions, whole.waiting, whole.approval, whole.more)
            assert mine == theirs, (seed, doc, prefix, sim.rows)
            caches[p] = _keep(prefix, partial.prefix)
        else:
            caches[p] = _keep(caches[p], whole.prefix)
        sim.apply(whole.actions)
    return used, len(sim.rows)


@pytest.mark.parametrize("chunk", range(int(os.environ.get("FUZZ_CHUNKS", "4"))))
def test_random_plans_from_a_prefix(chunk):
    n = int(os.environ.get("FUZZ_SEEDS", "150"))
    used = 0
    for seed in range(chunk * n, (chunk + 1) * n):
        used += run_one(seed)[0]
    assert used > 0
