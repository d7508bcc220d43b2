"""Parallel and foreach map onto Celery chords (the design card; CONTRACT section 14), seen
on the wire and in Flower, with a real worker on the test broker and result backend.

The first fan-out of a run is planned by ``run_start`` in this process: its chord's header
messages are published here, where ``before_task_publish`` sees them (their group, and the
body each carries). The body is sent by the worker whose header task completed the chord;
Flower's view of the event stream (``tests.test_flower_events.FlowerView``) shows it as a
task of its own, a child of that header task, after every header task succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from celery.signals import before_task_publish
from django.conf import settings

from runs import services
from runs.models import Run, StepRun
from tests import test_flower_events
from tests.processes import wait_for

from .flows import ensure_effects_table

pytestmark = [pytest.mark.slow]

# Flower's view of the event stream (an event receiver feeding Flower's own state).
flower = test_flower_events.flower

FLOWS = ["tests.runs.flows_fanin"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """Every task message this process publishes: its task, id, group and chord body."""
    seen: list[dict[str, Any]] = []

    def on_publish(sender: str = "", headers: Any = None, body: Any = None, **_: Any) -> None:
        args, kwargs, embed = body
        seen.append(
            {
                "task": sender,
                "id": headers["id"],
                "args": list(args),
                "kwargs": kwargs,
                "group": headers.get("group"),
                "group_index": headers.get("group_index"),
                "chord": embed.get("chord"),
            }
        )

    before_task_publish.connect(on_publish, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(on_publish)


def finished(run_id: Any, logs: Any) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=30, interval=0.1, message=logs)


def chord_of(published: list[dict[str, Any]], run: Run) -> tuple[list[dict[str, Any]], Any]:
    """The header messages of the run's chord (its attempts' ``execute_step`` messages) and
    the body they carry; asserts they are one chord."""
    attempts = {
        s.id
        for s in StepRun.objects.filter(run=run, kind="task")
        if s.celery_task_id  # every attempt the fan-out sent
    }
    header = [
        m for m in published if m["task"] == "workers.execute_step" and m["args"][0] in attempts
    ]
    assert header, published
    groups = {m["group"] for m in header}
    assert len(groups) == 1 and None not in groups, groups
    assert sorted(m["group_index"] for m in header) == list(range(len(header)))
    bodies = [m["chord"] for m in header]
    assert all(body == bodies[0] for body in bodies)
    return header, bodies[0]


def test_a_parallel_and_a_foreach_go_as_chords_whose_body_advances_the_run(
    published, flower, celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=2, extra_args=["-E"])
    # Fewer than a start plans inline (REQUEST_ACTIONS): one chord, sent from here.
    items = [f"i{n}" for n in range(15)]
    fanned = services.run_start(workflow="chorded", input={"items": items}).run
    branched = services.run_start(workflow="branched", input={}).run

    fanned = finished(fanned.id, celery_processes.logs)
    branched = finished(branched.id, celery_processes.logs)
    assert fanned.status == "completed", fanned.error
    assert fanned.output == [f"{item}@1" for item in items]
    assert branched.status == "completed", branched.error
    assert branched.output == {"north": "north", "south": "south", "east": "east"}

    per_message = settings.DJFLOW["FAN_OUT_PER_MESSAGE"]
    for run, count in ((fanned, len(items)), (branched, 3)):
        header, body = chord_of(published, run)
        # FAN_OUT_PER_MESSAGE attempts to a header message, each attempt in one of them.
        assert len(header) == math.ceil(count / per_message)
        carried = [m["args"][0] for m in header] + [
            i for m in header for i in m["kwargs"].get("more", [])
        ]
        assert len(carried) == len(set(carried)) == count
        assert (body["task"], list(body["args"]), body["kwargs"]) == (
            "runs.advance",
            [str(run.id)],
            {"fan_in": True},
        )
        assert body["immutable"] is True
        # The body is not sent with the header: the worker sends it once the chord is done.
        assert not [
            m for m in published if m["task"] == "runs.advance" and m["args"] == [str(run.id)]
        ]

        # Flower: every header task, then the body, a child of the header task that
        # completed the chord.
        header_ids = {m["id"] for m in header}

        def callback(run: Run = run) -> Any:
            with flower.lock:
                found = [
                    t
                    for t in flower.state.tasks.values()
                    if t.name == "runs.advance"
                    and str(run.id) in (t.args or "")
                    and "'fan_in': True" in (t.kwargs or "")
                ]
            return found[0] if found and found[0].state == states.SUCCESS else None

        shown = wait_for(callback, timeout=15, message=lambda: str(flower.state.tasks))
        assert shown.parent_id in header_ids
        carriers = [flower.task(task_id) for task_id in header_ids]
        assert all(c is not None and c.state == states.SUCCESS for c in carriers), carriers
        assert shown.received >= max(c.succeeded for c in carriers) - 1.0
