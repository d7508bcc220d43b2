"""The status tables are the law: the move helpers (runs/moves.py) refuse what the tables do
not list, and the test database's triggers (tests/moves.py) refuse it from any code path.

The whole suite runs with those triggers installed (tests/conftest.py): these tests pin that
the triggers are there and say what the tables say, move by move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product

import pytest
from django.db import DatabaseError, connection, transaction

from runs.engine import ending, store
from runs.models import Run, StepRun
from runs.moves import move_run, move_runs, move_steps
from runs.status import (
    RUN_INITIAL,
    RUN_MOVES,
    STEP_INITIAL,
    STEP_MOVES,
    IllegalTransition,
    RunStatus,
    StepStatus,
    run_sources,
    step_sources,
)
from tests.moves import unchecked, uncounted
from workers import claims

from .factories import RunFactory, StepRunFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _not_counted() -> Iterator[None]:
    """These tests make every move on purpose: the count is of the engine's (tests/moves.py)."""
    with uncounted():
        yield


STEP_PAIRS = list(product(StepStatus.values, repeat=2))
RUN_PAIRS = list(product(RunStatus.values, repeat=2))


def refused(write: Callable[[], object]) -> bool:
    """Whether the database refuses ``write`` (its savepoint is rolled back then)."""
    try:
        with transaction.atomic():
            write()
    except DatabaseError as error:
        assert "not in the" in str(error), error
        return True
    return False


def sql(statement: str, *params: object) -> Callable[[], None]:
    def write() -> None:
        with connection.cursor() as cursor:
            cursor.execute(statement, list(params))

    return write


def a_step_run(status: str) -> StepRun:
    return StepRunFactory(status=status, run=RunFactory(status=RunStatus.RUNNING))


# --- the triggers -----------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), [p for p in STEP_PAIRS if p[0] != p[1]])
def test_the_database_makes_a_step_runs_move_only_when_the_table_lists_it(
    source: str, target: str
) -> None:
    row = a_step_run(source)
    listed = target in STEP_MOVES[source]
    statement = "UPDATE runs_steprun SET status = %s WHERE id = %s"
    assert refused(sql(statement, target, row.id)) is not listed
    row.refresh_from_db()
    assert row.status == (target if listed else source)


@pytest.mark.parametrize(("source", "target"), [p for p in RUN_PAIRS if p[0] != p[1]])
def test_the_database_makes_a_runs_move_only_when_the_table_lists_it(
    source: str, target: str
) -> None:
    run = RunFactory(status=source)
    listed = target in RUN_MOVES[source]
    statement = "UPDATE runs_run SET status = %s WHERE id = %s"
    assert refused(sql(statement, target, run.id)) is not listed
    run.refresh_from_db()
    assert run.status == (target if listed else source)


def test_a_write_that_keeps_the_status_is_no_move() -> None:
    row = a_step_run(StepStatus.SUCCEEDED)
    statement = "UPDATE runs_steprun SET status = status, output = '1' WHERE id = %s"
    assert not refused(sql(statement, row.id))


@pytest.mark.parametrize("status", StepStatus.values)
def test_a_step_run_is_inserted_only_in_an_initial_status(status: str) -> None:
    run = RunFactory(status=RunStatus.RUNNING)

    def insert() -> None:
        StepRun.objects.create(run=run, step_id="a", kind="task", attempt=1, status=status)

    assert refused(insert) is (status not in STEP_INITIAL)


def test_a_run_is_created_pending_and_in_no_other_status() -> None:
    version = RunFactory().version
    for status in RunStatus.values:

        def create(status: str = status) -> None:
            Run.objects.create(workflow_id=version.workflow_id, version=version, status=status)

        assert refused(create) is (status not in RUN_INITIAL)


def test_a_test_may_build_rows_in_any_status_when_it_says_so() -> None:
    row = a_step_run(StepStatus.SUCCEEDED)
    back = sql("UPDATE runs_steprun SET status = 'running' WHERE id = %s", row.id)
    with unchecked():
        assert refused(back) is False
    # Only inside the block: the next write is checked again.
    row = a_step_run(StepStatus.SUCCEEDED)
    assert refused(sql("UPDATE runs_steprun SET status = 'running' WHERE id = %s", row.id))


# --- the helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), STEP_PAIRS)
def test_move_steps_makes_the_listed_moves_and_refuses_the_rest(source: str, target: str) -> None:
    row = a_step_run(source)
    rows = StepRun.objects.filter(id=row.id)
    if target in STEP_MOVES[source]:
        assert move_steps(rows, target, sources=[source]) == 1
        assert move_steps(rows, target, sources=[source]) == 0  # no longer there: not counted
    else:
        with pytest.raises(IllegalTransition) as caught:
            move_steps(rows, target, sources=[source])
        assert caught.value.errors[0].message == f"a {source} step run cannot become {target}"
    row.refresh_from_db()
    assert row.status == (target if target in STEP_MOVES[source] else source)


def test_without_sources_a_move_is_conditional_on_every_source_the_table_allows() -> None:
    # Rows in every status; cancelling moves exactly those the table lets become cancelled.
    rows = {status: a_step_run(status) for status in StepStatus.values}
    run_ids = [row.run_id for row in rows.values()]
    moved = move_steps(StepRun.objects.filter(run_id__in=run_ids), StepStatus.CANCELLED)
    assert moved == len(step_sources(StepStatus.CANCELLED))
    after = dict(StepRun.objects.filter(run_id__in=run_ids).values_list("id", "status"))
    for status, row in rows.items():
        cancellable = StepStatus.CANCELLED in STEP_MOVES[status]
        assert after[row.id] == (StepStatus.CANCELLED if cancellable else status)


def test_a_target_no_status_may_reach_is_refused() -> None:
    with pytest.raises(IllegalTransition, match="no run can become pending"):
        move_runs(Run.objects.all(), RunStatus.PENDING)
    assert run_sources(RunStatus.COMPLETED) == [
        s for s, targets in RUN_MOVES.items() if RunStatus.COMPLETED in targets
    ]


@pytest.mark.parametrize(("source", "target"), [p for p in RUN_PAIRS if p[0] != p[1]])
def test_move_run_checks_the_locked_runs_own_status(source: str, target: str) -> None:
    run = RunFactory(status=source)
    before = run.output
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(id=run.id)
        if target in RUN_MOVES[source]:
            move_run(locked, target, output={"n": 1})
            assert (locked.status, locked.output) == (target, {"n": 1})
        else:
            with pytest.raises(IllegalTransition):
                move_run(locked, target, output={"n": 1})
    run.refresh_from_db()
    listed = target in RUN_MOVES[source]
    assert (run.status, run.output) == ((target, {"n": 1}) if listed else (source, before))


def test_the_workers_claim_is_the_tables_move() -> None:
    assert (claims.CLAIMED_FROM, claims.CLAIMED_TO) == (StepStatus.SCHEDULED, StepStatus.RUNNING)
    assert claims.CLAIMED_TO in STEP_MOVES[claims.CLAIMED_FROM]


def test_a_handed_back_attempt_is_the_one_move_back_to_scheduled() -> None:
    assert step_sources(StepStatus.SCHEDULED) == [StepStatus.RUNNING]


# --- ending a run -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "condition"),
    [
        (RunStatus.FAILED, StepStatus.FAILED),
        (RunStatus.TIMED_OUT, StepStatus.FAILED),
        (RunStatus.CANCELLED, StepStatus.CANCELLED),
        (RunStatus.COMPLETED, StepStatus.CANCELLED),
    ],
)
def test_an_ended_run_closes_what_is_in_flight(status: str, condition: str) -> None:
    from django.utils import timezone

    run = RunFactory(status=RunStatus.RUNNING)
    branch = StepRunFactory(run=run, step_id="if", kind="condition", status=StepStatus.RUNNING)
    inside = StepRunFactory(run=run, step_id="a", status=StepStatus.SCHEDULED)
    done = StepRunFactory(run=run, step_id="b", status=StepStatus.SUCCEEDED)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(id=run.id)
        ending.end_run(locked, status, now=timezone.now())
    statuses = dict(StepRun.objects.filter(run=run).values_list("id", "status"))
    assert statuses == {branch.id: condition, inside.id: "cancelled", done.id: "succeeded"}
    run.refresh_from_db()
    assert (run.status, run.finished_at is not None) == (status, True)


@pytest.mark.parametrize(
    ("status", "condition"),
    [(RunStatus.FAILED, StepStatus.FAILED), (RunStatus.COMPLETED, StepStatus.CANCELLED)],
)
def test_runs_ended_together_end_as_each_would_alone(status: str, condition: str) -> None:
    """``ending.Ends``: three runs' ends in one statement (a batch's results recorded
    together), each closing what it leaves in flight and its child runs, its unfired timers
    gone, its end counted; the instance shows its end before the flush, the rows after."""
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from runs.models import Timer

    now = timezone.now()
    runs = [RunFactory(status=RunStatus.RUNNING) for _ in range(3)]
    branch = StepRunFactory(run=runs[0], step_id="if", kind="condition", status="running")
    inside = StepRunFactory(run=runs[0], step_id="a", status=StepStatus.SCHEDULED)
    done = StepRunFactory(run=runs[1], step_id="b", status=StepStatus.SUCCEEDED)
    child = RunFactory(status=RunStatus.RUNNING, parent_run=runs[2], root_run=runs[2])
    for run in runs:
        Timer.objects.create(run=run, purpose="sleep", key="k", fire_at=now)
    together = ending.Ends()
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        locked = list(Run.objects.select_for_update().filter(id__in=[r.id for r in runs]))
        for run in locked:
            ending.end_run(run, status, now=now, output={"n": 1}, together=together)
        # Nothing written yet: the instances show their ends.
        assert {run.status for run in locked} == {status}
        assert set(
            Run.objects.filter(id__in=[r.id for r in runs]).values_list("status", flat=True)
        ) == {RunStatus.RUNNING}
        together.flush()
    ends = [q["sql"] for q in queries.captured_queries if "UPDATE runs_run" in q["sql"]]
    # One statement moved the three (the child's cancel is its own, under its own lock).
    assert sum("moved_2 AS" in sql for sql in ends) == 1, ends
    assert {r.status for r in Run.objects.filter(id__in=[r.id for r in runs])} == {status}
    for run in Run.objects.filter(id__in=[r.id for r in runs]):
        assert (run.finished_at, run.updated_at, run.output) == (now, now, {"n": 1})
    statuses = dict(StepRun.objects.filter(run__in=runs).values_list("id", "status"))
    assert statuses == {branch.id: condition, inside.id: "cancelled", done.id: "succeeded"}
    child.refresh_from_db()
    assert child.status == RunStatus.CANCELLED
    assert child.error["message"] == f"parent run {runs[2].id} {ending._PARENT_ENDED[status]}"
    assert not Timer.objects.filter(run__in=runs, fired_at__isnull=True).exists()


def test_runs_ended_together_with_one_stale_raise_and_write_nothing() -> None:
    """One of the batch's rows ended meanwhile: the statement's count is short, the flush
    raises (the batch's caller records its runs one by one), and nothing of it stays."""
    from django.utils import timezone

    from runs.models import Timer

    now = timezone.now()
    runs = [RunFactory(status=RunStatus.RUNNING) for _ in range(2)]
    for run in runs:
        Timer.objects.create(run=run, purpose="sleep", key="k", fire_at=now)
    stale = [Run.objects.get(id=run.id) for run in runs]
    with unchecked():
        Run.objects.filter(id=runs[1].id).update(status=RunStatus.CANCELLED)
    together = ending.Ends()
    with pytest.raises(RuntimeError, match="1 of 2 runs cannot end"), transaction.atomic():
        for run in stale:
            ending.end_run(run, RunStatus.COMPLETED, now=now, together=together)
        together.flush()
    assert Run.objects.get(id=runs[0].id).status == RunStatus.RUNNING
    assert Timer.objects.filter(run__in=runs).count() == 2


def test_only_a_top_level_run_without_a_slot_is_ended_with_others() -> None:
    """A run inside a tree, or holding a concurrency slot, is ended on the spot: its
    parent, its children or its key's next runs may be read before a flush."""
    from django.utils import timezone

    top = RunFactory(status=RunStatus.RUNNING)
    inner = RunFactory(status=RunStatus.RUNNING, parent_run=top, root_run=top)
    together = ending.Ends()
    with transaction.atomic():
        ending.end_run(inner, RunStatus.COMPLETED, now=timezone.now(), together=together)
        ending.end_run(top, RunStatus.COMPLETED, now=timezone.now(), together=together)
        assert [run.id for run, *_ in together.pending] == [top.id]
        assert Run.objects.get(id=inner.id).status == RunStatus.COMPLETED
        together.flush()
    assert Run.objects.get(id=top.id).status == RunStatus.COMPLETED
    assert not ending.Ends.takes(RunFactory(status=RunStatus.RUNNING, concurrency_key="k"))


def test_a_batch_takes_the_end_of_a_plan_that_opens_nothing_beside_it() -> None:
    """apply._ends_alone: a plan whose end a batch may write later ends with it and only
    closes, cancels, expires or skips rows before it (written before the end either way);
    one that schedules or opens something beside its end is ended on the spot."""
    from runs.engine import apply
    from runs.engine import plan as p

    finish = p.Finish("completed")
    close = p.Close(attempt_id=1, status="succeeded")
    schedule = p.Schedule("a", "", "task", 1, 0, {}, "at_least_once", "default", 1000)
    opened = p.Open(step_id="w", path="", kind="wait_event", attempt=1, generation=0)
    assert apply._ends_alone(p.Plan(actions=[finish]))
    assert apply._ends_alone(p.Plan(actions=[close, p.Cancel((2,)), finish]))
    assert not apply._ends_alone(p.Plan(actions=[schedule, finish]))
    assert not apply._ends_alone(p.Plan(actions=[opened, finish]))
    assert not apply._ends_alone(p.Plan(actions=[finish, close]))
    assert not apply._ends_alone(p.Plan(actions=[]))


def test_an_end_on_a_stale_instance_raises_and_writes_nothing() -> None:
    """The end's one statement (move, timers dropped, what is left read) on a run whose row
    ended meanwhile: the move matches nothing, the caller hears of it, and its transaction
    rolls the timers' deletion back with it."""
    from django.utils import timezone

    from runs.models import Timer

    run = RunFactory(status=RunStatus.RUNNING)
    Timer.objects.create(run=run, purpose="sleep", key="k", fire_at=timezone.now())
    inside = StepRunFactory(run=run, step_id="a", status=StepStatus.SCHEDULED)
    stale = Run.objects.get(id=run.id)
    with unchecked():
        Run.objects.filter(id=run.id).update(status=RunStatus.CANCELLED)
    with pytest.raises(RuntimeError, match="cannot become completed"), transaction.atomic():
        ending.end_run(stale, RunStatus.COMPLETED, now=timezone.now())
    assert Run.objects.get(id=run.id).status == RunStatus.CANCELLED
    assert Timer.objects.filter(run=run).count() == 1
    assert StepRun.objects.get(id=inside.id).status == StepStatus.SCHEDULED


def test_the_applier_s_run_write_leaves_a_row_the_table_does_not_let_move() -> None:
    """``store.update_run`` (the applier's and ``move_run``'s write) is conditional on the
    table itself, with the triggers out of the way: a run whose row has ended meanwhile
    (a stale instance) is left as it is, and the caller hears of it."""
    run = RunFactory(status=RunStatus.COMPLETED)
    # (An ended run may become running again: an operator's retry from a step. Waiting, not.)
    with unchecked(), pytest.raises(RuntimeError, match="cannot become waiting"):
        store.update_run(run.id, {"status": RunStatus.WAITING, "attempts": 7})
    assert Run.objects.filter(id=run.id).values_list("status", "attempts").get() == (
        RunStatus.COMPLETED,
        run.attempts,
    )
    # The same status written again is no move, and other fields go with it.
    with unchecked():
        store.update_run(run.id, {"status": RunStatus.COMPLETED, "attempts": 7})
    assert Run.objects.get(id=run.id).attempts == 7
