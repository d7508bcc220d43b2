"""What one run may store is bounded (DJFLOW_MAX_RUN_BYTES, issue 36): a request that
amplifies its input (a foreach, a parallel, a loop, a chain of subworkflows echoing or
growing it) fails its run with class ``limit`` once the next value would pass the cap, and
that value is not written. The count is a running total on the run's row, kept by the
statements that write the values: exact under concurrent completions of a fan-out."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.db.models import Q

from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from runs.status import RUN_TERMINAL
from tests.processes import wait_for
from workers.execution import execute
from workflows.services import definition_save

from . import flows_bounded as flows

FLOWS = ["tests.runs.flows_bounded"]
KIB = 1024


@pytest.fixture
def cap(settings) -> Any:
    def set_cap(size: int) -> int:
        settings.DJFLOW = {**settings.DJFLOW, "MAX_RUN_BYTES": size}
        return size

    return set_cap


def _save_all() -> None:
    for builder in flows.ALL:
        definition_save(document=builder.document())


def _tree(run: Run) -> Any:
    return Run.objects.filter(Q(id=run.id) | Q(root_run_id=run.id))


def _drive(run: Run, rounds: int = 400) -> Run:
    """Advance the run's tree and run its attempts in this process until the root ends."""
    for _ in range(rounds):
        run.refresh_from_db()
        if run.status in RUN_TERMINAL:
            return run
        for member in _tree(run).exclude(status__in=RUN_TERMINAL):
            run_advance(run_id=member.id)
        scheduled = StepRun.objects.filter(run__in=_tree(run), status="scheduled")
        for step_run_id in scheduled.values_list("id", flat=True):
            execute(step_run_id, worker="in-process")
    raise AssertionError(f"run {run.id} did not end: {run.status}")


def _journal_bytes(run: Run) -> int:
    """What the run's journal holds of values, as Postgres stores them (text of the JSON)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(coalesce(octet_length(input::text), 0)"
            " + coalesce(octet_length(output::text), 0)"
            " + coalesce(octet_length(error::text), 0)), 0)"
            " FROM runs_steprun WHERE run_id = %s",
            [run.id],
        )
        return int(cursor.fetchone()[0])


def _counted(run: Run) -> int:
    """What the cap counts of the run's journal and its children's inputs, computed from the
    rows (not the run's own output: at most 1 MiB, written once by its end)."""

    def size(value: Any) -> int:
        if not value:
            return 0
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())

    total = 0
    for child in Run.objects.filter(parent_run=run):
        total += size(child.input)
    for row in StepRun.objects.filter(run=run):
        total += size(row.input) + size(row.output) + size(row.error) + size(row.spans)
    return total


def _blob(size: int) -> str:
    return "y" * size


@pytest.mark.django_db
def test_a_foreach_echoing_its_input_fails_the_run_before_storing_the_copies(cap):
    limit = cap(2 * 1024 * KIB)
    _save_all()
    value = {"blob": _blob(100 * KIB), "items": list(range(200))}
    run = _drive(services.run_start(workflow="bounded_echo_input", input=value).run)
    assert (run.status, run.error["class"]) == ("failed", "limit")
    assert "DJFLOW_MAX_RUN_BYTES (2097152)" in run.error["message"]
    assert "the input of step 'item'" in run.error["message"]
    # 200 copies of 100 KiB were asked for; those stored fit the cap, and none ran.
    assert _journal_bytes(run) <= limit + 100 * KIB
    assert run.stored_bytes <= _counted(run) <= limit + 8 * KIB
    items = StepRun.objects.filter(run=run, step_id="item")
    assert items.count() <= limit // (100 * KIB)
    assert set(items.values_list("status", flat=True)) == {"cancelled"}


@pytest.mark.django_db
def test_a_foreach_whose_outputs_grow_the_journal_fails_at_the_cap(cap):
    limit = cap(1024 * KIB)
    _save_all()
    start = {"size": 60 * KIB, "items": list(range(40))}
    run = _drive(services.run_start(workflow="bounded_echo_output", input=start).run)
    assert (run.status, run.error["class"]) == ("failed", "limit")
    assert run.error["step"] == "item"
    assert "this attempt's result (61440 bytes)" in run.error["message"]
    refused = StepRun.objects.filter(run=run, step_id="item", error__class="limit")
    assert refused.exists() and all(row.output is None for row in refused)
    # The cap and at most one value more, not 40 x 60 KiB (what the journal holds beyond
    # the count: the engine's own error messages, the refusal's and the cancellations').
    assert _journal_bytes(run) <= limit + 60 * KIB
    assert run.stored_bytes <= _counted(run) <= limit + 8 * KIB


@pytest.mark.django_db
def test_the_cap_fails_the_run_whatever_on_error_says(cap):
    limit = cap(512 * KIB)
    _save_all()
    start = {"size": 60 * KIB, "items": list(range(20))}
    run = services.run_start(workflow="bounded_echo_output_continue", input=start).run
    run = _drive(run)
    assert (run.status, run.error["class"]) == ("failed", "limit")
    assert run.stored_bytes <= limit


@pytest.mark.django_db
def test_under_the_cap_the_count_is_exact_and_the_run_completes(cap):
    cap(64 * 1024 * KIB)
    _save_all()
    start = {"size": 2 * KIB, "items": list(range(30))}
    run = _drive(services.run_start(workflow="bounded_echo_output", input=start).run)
    assert run.status == "completed", run.error
    assert run.stored_bytes == _counted(run) > 30 * 2 * KIB


@pytest.mark.django_db
def test_a_parallel_echoing_its_input_fails_at_the_cap(cap):
    limit = cap(512 * KIB)
    _save_all()
    run = _drive(services.run_start(workflow="bounded_echo_parallel", input=_blob(100 * KIB)).run)
    assert (run.status, run.error["class"]) == ("failed", "limit")
    assert _journal_bytes(run) <= limit + 100 * KIB
    assert run.stored_bytes <= limit


@pytest.mark.django_db
def test_a_loop_growing_a_value_fails_at_the_cap(cap):
    limit = cap(1024 * KIB)
    _save_all()
    run = _drive(services.run_start(workflow="bounded_grow", input={"seed": "ab"}).run)
    assert (run.status, run.error["class"]) == ("failed", "limit"), run.error
    assert _journal_bytes(run) <= limit + 1024 * KIB
    assert run.stored_bytes <= _counted(run) <= limit + 8 * KIB


@pytest.mark.django_db
def test_each_run_of_a_subworkflow_chain_counts_against_its_own_cap(cap):
    """Each run of a tree counts its own journal (the tree's size is the tree cap's and
    max_steps' business): three runs each storing up to 500 KiB complete under a 1 MiB cap,
    though the tree stores more than the cap."""
    limit = cap(1024 * KIB)
    _save_all()
    root = services.run_start(workflow="bounded_chain_root", input=_blob(100 * KIB)).run
    root = _drive(root)
    assert root.status == "completed", root.error
    tree = list(_tree(root))
    assert len(tree) == 3
    for member in tree:
        assert member.stored_bytes == _counted(member) <= limit
    assert sum(member.stored_bytes for member in tree) > limit


@pytest.mark.django_db
def test_a_subworkflow_whose_input_passes_the_cap_is_never_started(cap):
    """The child's input is the parent's to store: a parent whose echo and the child's
    input pass its cap fails (class limit) before the child run exists."""
    limit = cap(350 * KIB)
    _save_all()
    root = services.run_start(workflow="bounded_chain_root", input=_blob(100 * KIB)).run
    root = _drive(root)
    assert (root.status, root.error["class"]) == ("failed", "limit"), root.error
    assert "input of step 'down'" in root.error["message"]
    assert not Run.objects.filter(parent_run=root).exists()
    assert root.stored_bytes <= limit


def test_concurrent_completions_keep_the_count_exact_and_the_cap(celery_worker):
    """Four worker processes complete a fan-out's items at once: the total on the run's
    row is the sum of what the journal holds, and never passes the cap."""
    limit = 1024 * KIB
    _save_all()
    celery_worker(
        workflow_modules=FLOWS,
        concurrency=4,
        env={"DJFLOW_MAX_RUN_BYTES": str(limit)},
    )
    start = {"size": 20 * KIB, "items": list(range(120))}
    run = services.run_start(workflow="bounded_echo_output", input=start).run

    def ended() -> Run | None:
        run.refresh_from_db()
        return run if run.status in RUN_TERMINAL else None

    wait_for(ended, timeout=60)
    assert (run.status, run.error["class"]) == ("failed", "limit")
    assert run.stored_bytes <= _counted(run) <= limit + 8 * KIB
    assert _journal_bytes(run) <= limit + 20 * KIB


@pytest.mark.django_db
@pytest.mark.parametrize(("payload_kib", "status"), [(50, "completed"), (300, "failed")])
def test_an_events_payload_counts_and_one_past_the_cap_fails_the_run(cap, payload_kib, status):
    limit = cap(200 * KIB)
    definition_save(
        document={
            "id": "bounded_wait",
            "steps": [
                {"id": "hold", "kind": "wait_event", "event": "big", "key": "k"},
                {"id": "again", "kind": "wait_event", "event": "small", "key": "k"},
            ],
        }
    )
    run = services.run_start(workflow="bounded_wait", input={}).run
    services.event_send(name="big", key="k", payload=_blob(payload_kib * KIB))
    services.event_send(name="small", key="k", payload="s")
    run.refresh_from_db()
    assert run.status == status, run.error
    hold = StepRun.objects.get(run=run, step_id="hold")
    assert hold.event_id is not None  # taken either way: not offered again
    if status == "failed":
        assert run.error["class"] == "limit" and "event's payload" in run.error["message"]
        assert hold.output is None and run.stored_bytes <= limit
    else:
        assert run.stored_bytes == _counted(run) > payload_kib * KIB
