"""Concurrency keys on a real worker (CONTRACT section 13): a key holds at 2 while three
customers take turns, every end admitting the next run of its key in its own transaction
(no beat runs: nothing waits for the reconciler)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from runs import services
from runs.engine import slots
from runs.models import Run
from tests.processes import wait_for

from .flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one moment (an end at the same moment as a start frees
    first: the end's transaction admitted the start)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_key_holds_at_two_while_three_customers_take_turns(
    celery_worker, celery_processes, tmp_path
) -> None:
    # Six pool processes: the limit, not the worker, is what holds runs back.
    celery_worker(workflow_modules=["tests.runs.flows_concurrency"], concurrency=6)
    started: dict[str, Run] = {}
    release = tmp_path / "release"

    def start(name: str, priority: int = 5) -> None:
        customer = name[0]
        run = services.run_start(
            workflow="per_customer_e2e",
            input={"customer": customer, "n": name, "seconds": 0.5, "release": str(release)},
            priority=priority,
        ).run
        started[name] = run

    # Customer a's backlog arrives first; a5 is urgent. Then b's and c's runs.
    for name in ("a1", "a2", "a3", "a4"):
        start(name)
    start("a5", priority=9)
    for name in ("b1", "b2", "b3", "c1", "c2", "c3"):
        start(name)
    # Over the limit, a run waits pending with nothing planned and says why.
    a3 = Run.objects.get(id=started["a3"].id)
    assert a3.admitted_at is None and a3.status == "pending" and not a3.steps.exists()
    assert slots.waiting_reason(a3) == "waiting for a concurrency slot of key 'a' (2 of 2 running)"
    # Every run is started and the first of each key admitted: the bodies may end now.
    release.touch()

    def all_ended() -> list[Run] | None:
        runs = list(Run.objects.filter(id__in=[r.id for r in started.values()]))
        return runs if all(run.status in TERMINAL for run in runs) else None

    runs = {
        run.input["n"]: run
        for run in wait_for(all_ended, timeout=90, interval=0.25, message=celery_processes.logs)
    }
    assert {name: run.status for name, run in runs.items() if run.status != "completed"} == {}
    # Each body ran once.
    for name, run in runs.items():
        assert len(effects(run.id, "work")) == 1, name

    by_key: dict[str, list[str]] = {}
    for name in runs:
        by_key.setdefault(name[0], []).append(name)
    for key, names in by_key.items():
        # The limit: never more than 2 runs of a key holding slots (admission to end), nor
        # more than 2 bodies of a key running, at once; and the key did run 2 at once.
        held = [(runs[n].admitted_at, runs[n].finished_at) for n in names]
        assert most_at_once(held) == 2, (key, held)
        bodies = [effects(runs[n].id, "work")[0][3:5] for n in names]
        assert most_at_once(bodies) == 2, (key, bodies)

    # Runs admitted by one transaction share its instant (two slots freed at once: slots.admit
    # gives both in one go); among them, the order admit took them in.
    admitted = sorted(
        runs, key=lambda n: (runs[n].admitted_at, -runs[n].priority, runs[n].created_at)
    )
    order_of = {name: admitted.index(name) for name in runs}
    # Per key: higher priority first (a5), then arrival order. a5 and a3 are admitted by the
    # ends of a1 and a2, which take the key's gate in turn (slots.admit): the first to take
    # it admits a5. But each end stamps its run's finish and the admission with the instant
    # it took before waiting for the gate, so a3's may be the earlier (seen on RabbitMQ):
    # their instants do not order them. a4 does: it arrived before a5 and was admitted
    # after both a5 and a3, when one of them had ended (arrival order alone would have
    # admitted a3 and a4 first, and a5 last).
    order_a = [n for n in admitted if n[0] == "a"]
    assert order_a[:2] == ["a1", "a2"] and sorted(order_a[2:4]) == ["a3", "a5"], order_a
    assert order_a[4] == "a4", order_a
    assert [n for n in admitted if n[0] == "b"] == ["b1", "b2", "b3"]
    assert [n for n in admitted if n[0] == "c"] == ["c1", "c2", "c3"]
    # Keys take turns: a's backlog, which arrived first, did not keep b and c waiting; each
    # customer's first two started before any customer's third.
    firsts = [f"{key}{n}" for key in "abc" for n in (1, 2)]
    assert max(order_of[n] for n in firsts) < min(order_of[n] for n in ("a5", "a3", "b3", "c3"))
    # A waiting run started only when a run of its own key ended (in that end's transaction).
    ends: dict[str, list[Any]] = {
        key: sorted(runs[n].finished_at for n in names) for key, names in by_key.items()
    }
    for name in ("a5", "a3", "a4", "b3", "c3"):
        assert runs[name].admitted_at in ends[name[0]], name
    # The runs that waited started after they were created, and none runs any more.
    assert all(slots.holders("per_customer_e2e", key) == 0 for key in "abc")
