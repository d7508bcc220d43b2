"""What one sequential step costs the database, and that it does not grow with the journal
(issue 17): the statements of a step are counted, and a step of a 2,000-step run reads and
writes what a step of a 10-step run does, because each plan starts from the run's settled
prefix (plan.Prefix) instead of reading and walking the whole journal.

The steps run in this process through the worker's own code (``workers.execution.execute``),
one step per call, on committed transactions (a prefix is kept only once its transaction
commits).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from runs import services
from runs.engine import journal
from runs.engine.advance import run_advance
from runs.models import StepRun
from workers.execution import execute
from workflows.sdk import handler
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "step_cost.noop"
# What one step of a sequential run costs today: the claim; then, in one transaction, the
# run's lock with the record (one statement), the journal's new rows and the next attempt's
# insert (BEGIN and COMMIT are statements too). It must not grow. (A step a worker goes on
# with inline has no claim of its own: its attempt is inserted claimed.)
STATEMENTS_PER_STEP = 6


@handler(NOOP)
def noop(ctx: Any, input: Any, prior: Any) -> None:
    return None


SPEND = "step_cost.spend"


@handler(SPEND)
def spend(ctx: Any, input: Any, prior: Any) -> str:
    with ctx.span("model_call", kind="model_generation") as span:
        span.set_model("claude-sonnet-4", "anthropic")
        # 10,000 in + 2,000 out on claude-sonnet-4: $0.06, charged when the step is recorded.
        span.set_usage(input_tokens=10_000, output_tokens=2_000)
    return "spent"


def _sequence(steps: int) -> str:
    # A document, not a builder: builders stay registered in the process, and another test's
    # sync_modules would try to save this one (over the default document size) with its own.
    name = f"step_cost_{steps}"
    document = {
        "id": name,
        "limits": {"max_steps": 10_000, "run_timeout_ms": 3_600_000},
        "steps": [{"id": f"s{n}", "kind": "task", "handler": NOOP} for n in range(steps)],
    }
    definition_save(document=document)
    return name


@pytest.fixture
def one_step_at_a_time(settings):
    """Each execute() runs one step (no inline chaining), 2,000-step documents save, and no
    plan is checked against the whole journal (the check's read is not a step's)."""
    settings.DJFLOW = {
        **settings.DJFLOW,
        "INLINE_MAX_STEPS": 0,
        "MAX_DOCUMENT_STEPS": 2_500,
        "CHECK_PREFIX": False,
    }
    journal.forget_prefixes()
    yield
    journal.forget_prefixes()


@pytest.fixture
def rows_read(monkeypatch) -> list[int]:
    """How many journal rows each plan read (the real read, counted on the way out)."""
    counts: list[int] = []
    real = journal.journal_read

    # Every read of one run's journal ends here (journal_of's, and the one a worker sends
    # with the run's lock, advance.lock_run_recording_reading).
    def counting(cursor: Any) -> list[Any]:
        rows = real(cursor)
        counts.append(len(rows))
        return rows

    monkeypatch.setattr(journal, "journal_read", counting)
    return counts


def _scheduled(run_id: Any) -> int:
    return StepRun.objects.get(run_id=run_id, status="scheduled").id


def _shape(sql: str) -> str:
    """A statement without its values: quoted literals and numbers replaced."""
    return re.sub(r"\b\d+\b", "N", re.sub(r"'[^']*'", "'?'", sql))


def _step(run_id: Any) -> list[str]:
    """Run the run's scheduled step; the statements it issued."""
    attempt = _scheduled(run_id)
    with CaptureQueriesContext(connection) as captured:
        execute(attempt, worker="in-process")
    return [query["sql"] for query in captured.captured_queries]


def _journal_ahead(run_id: Any, steps: int) -> None:
    """Write the run's first ``steps`` steps as succeeded (its scheduled first attempt
    included), as if they had run, and plan the next: the journal a long run has."""
    now = timezone.now()
    first = StepRun.objects.get(run_id=run_id, step_id="s0")
    StepRun.objects.filter(id=first.id).update(status="succeeded", finished_at=now)
    StepRun.objects.bulk_create(
        StepRun(
            run_id=run_id,
            step_id=f"s{n}",
            kind="task",
            attempt=1,
            status="succeeded",
            started_at=now,
            finished_at=now,
        )
        for n in range(1, steps)
    )
    run_advance(run_id=run_id)


def _plan_cache_mode() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW plan_cache_mode")
        return str(cursor.fetchone()[0])


def _prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_steps_statements_are_prepared_on_the_server_and_still_logged():
    run = services.run_start(workflow=_sequence(10), input={}).run
    for _ in range(3):
        statements = _step(run.id)
    # Django's query log still has their text (psycopg leaves it unset for a prepared run).
    assert statements and all(statements), statements
    prepared = _prepared()
    for marker in ("lease_expires_at = LEAST(", "AND claim =", "FOR NO KEY UPDATE", "SELECT s.id"):
        assert any(marker in statement for statement in prepared), (marker, prepared)
    # Django's own queries are not prepared (they bind on the client).
    assert not any('"runs_steprun"."id"' in statement for statement in prepared), prepared
    # Planned once (a range's generic plan costs more on paper than a custom one, and was
    # otherwise planned again at every step).
    assert _plan_cache_mode() == "force_generic_plan"


@pytest.mark.usefixtures("one_step_at_a_time")
def test_without_prepared_statements_nothing_is_prepared(monkeypatch):
    options = {k: v for k, v in connection.settings_dict["OPTIONS"].items()}
    options.pop("prepare_threshold", None)
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()  # the next connection is made from the options without it
    run = services.run_start(workflow=_sequence(10), input={}).run
    for _ in range(3):
        _step(run.id)
    assert _prepared() == []
    assert StepRun.objects.filter(run_id=run.id, status="succeeded").count() == 3
    assert _plan_cache_mode() == "auto"
    connection.close()


@pytest.mark.usefixtures("one_step_at_a_time")
def test_one_sequential_step_issues_at_most_six_statements():
    run = services.run_start(workflow=_sequence(10), input={}).run
    _step(run.id)  # the first step plans from the whole journal
    statements = _step(run.id)
    listing = "\n".join(sql[:160] for sql in statements)
    assert len(statements) <= STATEMENTS_PER_STEP, listing
    # Every step's rows and nothing else: no read of the whole journal, no ORM round trips.
    assert sum("SELECT s.id, s.step_id" in sql for sql in statements) == 1, listing
    # The run's row gets its count of attempts, nothing indexed (updated_at is in the
    # reconciler's index): a heap-only update, no new entry in the run's indexes.
    # (The recording statement charges the run what the result stores: stored_bytes, not
    # indexed either, in the same statement.)
    (run_update,) = [sql for sql in statements if "UPDATE runs_run SET attempts" in sql]
    assert "updated_at" not in run_update, run_update
    assert all(
        "updated_at" not in sql[sql.index("UPDATE runs_run") :].split(" WHERE ")[0]
        for sql in statements
        if "UPDATE runs_run" in sql
    ), listing


@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_step_of_a_2000_step_run_costs_what_a_step_of_a_10_step_run_does(rows_read):
    short = services.run_start(workflow=_sequence(10), input={}).run
    for _ in range(3):
        _step(short.id)
    rows_read.clear()
    short_statements = _step(short.id)
    short_rows = list(rows_read)

    long = services.run_start(workflow=_sequence(2_000), input={}).run
    _journal_ahead(long.id, 1_990)
    assert rows_read[-1] == 1_990  # the first plan of this process read the whole journal
    _step(long.id)  # cuts the prefix its step's successor plans from
    rows_read.clear()
    long_statements = _step(long.id)
    long_rows = list(rows_read)

    assert [_shape(sql) for sql in long_statements] == [_shape(sql) for sql in short_statements]
    assert long_rows == short_rows and max(long_rows) <= 2, (long_rows, short_rows)
    # And the run goes on to its end from there, planning from its prefix.
    for _ in range(8):
        _step(long.id)
    long.refresh_from_db()
    assert long.status == "completed"
    assert StepRun.objects.filter(run=long, status="succeeded").count() == 2_000


@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_process_that_never_planned_the_run_reads_its_whole_journal_once(rows_read):
    run = services.run_start(workflow=_sequence(10), input={}).run
    for _ in range(4):
        _step(run.id)
    journal.forget_prefixes()  # as in another worker process
    rows_read.clear()
    _step(run.id)
    _step(run.id)
    assert rows_read == [5, 1]


@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_rolled_back_plan_keeps_no_prefix():
    from django.db import transaction

    from runs.engine.advance import advance_locked, lock_run

    run = services.run_start(workflow=_sequence(10), input={}).run
    _step(run.id)
    journal.forget_prefixes()
    first = StepRun.objects.get(run=run, step_id="s1")

    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        StepRun.objects.filter(id=first.id).update(status="succeeded", finished_at=timezone.now())
        advance_locked(lock_run(run.id))  # plans s2 from a journal where s1 succeeded
        raise Abort
    run.refresh_from_db()
    assert journal.prefix_for(run) is None
    # s1 is still the run's scheduled step, and runs as such.
    assert _scheduled(run.id) == first.id
    _step(run.id)
    assert StepRun.objects.get(run=run, step_id="s1").status == "succeeded"


def test_a_step_run_inline_after_another_commits_once(settings, rows_read):
    """A worker that goes on with the run's next step claims it in the transaction that
    recorded the previous one: one commit per step, the first step's claim aside."""
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_MAX_STEPS": 50, "CHECK_PREFIX": False}
    journal.forget_prefixes()
    run = services.run_start(workflow=_sequence(10), input={}).run
    first = _scheduled(run.id)
    with CaptureQueriesContext(connection) as captured:
        execute(first, worker="in-process")
    run.refresh_from_db()
    assert run.status == "completed"
    statements = [query["sql"] for query in captured.captured_queries]
    commits = sum(sql.strip() == "COMMIT" for sql in statements)
    claims = sum("lease_expires_at = LEAST(" in sql for sql in statements)
    inserts = sum("INSERT INTO runs_steprun" in sql for sql in statements)
    # Ten steps: ten recording transactions, nine of which also inserted the next step
    # claimed (no claim statement of its own), and the first step's own claim on its own
    # (autocommit, no COMMIT statement).
    listing = "\n".join(sql[:120] for sql in statements)
    assert (commits, claims, inserts) == (10, 1, 9), listing
    steps = StepRun.objects.filter(run=run)
    assert {(row.status, row.worker) for row in steps} == {("succeeded", "in-process")}
    assert all(row.started_at >= row.scheduled_at for row in steps)


@pytest.mark.skipif("connection.vendor != 'postgresql'")
@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_steps_journal_read_goes_with_the_runs_lock_in_one_round_trip(monkeypatch):
    """Recording a step locks the run and reads the journal after the kept prefix in one
    pipeline (sent together, the read run once the lock is taken), and the plan uses that
    read: one journal read a step, none of its own."""
    run = services.run_start(workflow=_sequence(10), input={}).run
    _step(run.id)  # the first step plans from the whole journal and keeps the prefix
    sent: list[tuple[int, bool]] = []
    real = journal.send_journal_read

    def noting(cursor: Any, run_id: Any, after: int) -> None:
        raw = connection.connection
        sent.append((after, raw is not None and raw._pipeline is not None))
        real(cursor, run_id, after)

    monkeypatch.setattr(journal, "send_journal_read", noting)
    statements = _step(run.id)
    through = journal.kept_through(run.id)
    assert len(sent) == 1, sent
    ((after, pipelined),) = sent
    assert pipelined and 0 < after < through
    assert sum("SELECT s.id, s.step_id" in sql for sql in statements) == 1


@pytest.mark.usefixtures("one_step_at_a_time")
def test_a_step_charged_at_its_record_is_counted_by_the_plan_after_it():
    """The journal read that goes with the run's lock must not be one taken before the
    attempt's charge: the plan after the second $0.06 step sees $0.12 against
    limits.max_cost_usd of $0.10 and fails the run; the third step never starts."""
    document = {
        "id": "step_cost_spend",
        "limits": {"max_cost_usd": 0.1, "run_timeout_ms": 3_600_000},
        "steps": [{"id": f"a{n}", "kind": "task", "handler": SPEND} for n in range(3)],
    }
    definition_save(document=document)
    run = services.run_start(workflow="step_cost_spend", input={}).run
    _step(run.id)
    _step(run.id)
    run.refresh_from_db()
    assert run.status == "failed" and "limits.max_cost_usd (0.1)" in run.error["message"]
    assert not StepRun.objects.filter(run=run, step_id="a2").exists()


def test_the_kept_prefixes_are_bounded_by_runs_and_by_bytes(monkeypatch):
    from runs.engine.plan import Prefix

    def prefix(steps: int, size: int) -> Prefix:
        return Prefix(steps, steps, 1, {}, None, True, steps, False, size)

    journal.forget_prefixes()
    monkeypatch.setattr(journal, "PREFIX_CACHE_RUNS", 3)
    monkeypatch.setattr(journal, "PREFIX_CACHE_BYTES", 100)
    for run in range(5):
        journal._keep(f"run-{run}", 1, "", prefix(run + 1, 10))
    assert list(journal._prefixes) == ["run-2", "run-3", "run-4"]  # the oldest went first
    monkeypatch.setattr(journal, "PREFIX_CACHE_RUNS", 10)
    journal._keep("run-5", 1, "", prefix(1, 25))
    journal._keep("run-6", 1, "", prefix(1, 25))
    journal._keep("run-7", 1, "", prefix(1, 25))  # 105 bytes: run-2 goes
    assert list(journal._prefixes) == ["run-3", "run-4", "run-5", "run-6", "run-7"]
    assert journal._prefix_bytes == 95
    journal._keep("huge", 1, "", prefix(1, 26))  # over a quarter of the bound: not kept
    assert "huge" not in journal._prefixes
    journal._keep("run-4", 1, "", prefix(2, 10))  # a shorter one never replaces a longer
    assert journal._prefixes["run-4"][2].steps == 5
    journal.forget_prefixes()


def _plan_of(marker: str) -> str:
    """The plan this connection's prepared statement holding ``marker`` runs with."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, cardinality(parameter_types) FROM pg_prepared_statements"
            " WHERE statement LIKE %s",
            [f"%{marker}%"],
        )
        [(name, parameters)] = cursor.fetchall()
        cursor.execute(f"EXPLAIN EXECUTE {name}({', '.join(['NULL'] * parameters)})")
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.usefixtures("one_step_at_a_time")
@pytest.mark.parametrize("looks", [True, False])
def test_plans_made_while_the_tables_were_small_are_made_again_once_they_have_grown(
    monkeypatch, looks
) -> None:
    """A statement prepared while ``runs_steprun`` was small keeps the plan made for that
    size (plans are made once, generically): the claim and the record of every attempt then
    scanned the whole table as a fan-out filled it. The connection looks at the tables' size
    (every REPLAN_CHECK_SECONDS) and has them prepared again once they have grown."""
    from runs.engine import sql

    monkeypatch.setattr(sql, "REPLAN_CHECK_SECONDS", 0.0 if looks else 1e9)
    connection.close()  # a connection whose statements are prepared from here on
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_steprun, runs_run")  # statistics of empty tables
    run = services.run_start(workflow=_sequence(10), input={}).run
    for _ in range(2):
        _step(run.id)  # the claim prepared on its second use, planned for these tables
    claim = "FROM runs_run AS r"
    assert "Seq Scan on runs_steprun" in _plan_of(claim)

    ballast = services.run_start(workflow=_sequence(10), input={}).run

    def grow(rows: int, first: int = 0) -> None:
        StepRun.objects.bulk_create(
            StepRun(run_id=ballast.id, step_id=f"b{n}", kind="task", attempt=1, status="succeeded")
            for n in range(first, first + rows)
        )

    grow(3000)
    for _ in range(2):
        _step(run.id)  # the look; the claim used once unprepared, then prepared again
    if not looks:
        assert "Seq Scan on runs_steprun" in _plan_of(claim)
        connection.close()
        return
    assert "Index Scan using runs_steprun_pkey on runs_steprun" in _plan_of(claim)
    # Again: psycopg noticed only the first DEALLOCATE ALL of one text, and ran statements
    # the server had dropped after the second ("prepared statement ... does not exist").
    grow(6000, first=3000)
    for _ in range(3):
        _step(run.id)
    assert "Index Scan using runs_steprun_pkey on runs_steprun" in _plan_of(claim)
    assert StepRun.objects.filter(run_id=run.id, status="succeeded").count() == 2 + 2 + 3
    connection.close()


def test_plans_dropped_twice_on_a_connection_that_had_none_prepared_the_first_time(
    monkeypatch,
) -> None:
    """psycopg forgets its prepared statements when it reads a DEALLOCATE ALL's status, and
    reads the status of a text it has not run before only. A first DEALLOCATE ALL sent while
    nothing was prepared left its text known: the second went unnoticed, and the next claim
    ran a statement the server had dropped ("prepared statement ... does not exist")."""
    from runs.engine import sql
    from workers.claims import claim_attempt

    monkeypatch.setattr(sql, "REPLAN_CHECK_SECONDS", 0.0)
    ballast = services.run_start(workflow=_sequence(10), input={}).run

    def grow(rows: int, first: int) -> None:
        StepRun.objects.bulk_create(
            StepRun(run_id=ballast.id, step_id=f"b{n}", kind="task", attempt=1, status="succeeded")
            for n in range(first, first + rows)
        )
        sql.cursor().close()  # the look, which drops the plans

    def claim_nothing() -> None:
        assert claim_attempt(0, worker="in-process", now=timezone.now()) is None

    connection.close()
    sql.cursor().close()  # a new connection's first look: the size its plans start from
    grow(3000, 0)  # nothing is prepared on this connection yet
    claim_nothing()
    claim_nothing()  # prepared on its second use
    grow(9000, 3000)
    claim_nothing()
    claim_nothing()
    assert connection._djflow_plans.replans == 2
    connection.close()


def test_a_look_that_fails_is_logged_and_leaves_the_connection_usable(monkeypatch, caplog) -> None:
    """The look at the tables' size runs between transactions, and its failure (here a
    malformed table name) is logged: the statement the caller was about to send goes on."""
    from runs.engine import sql
    from workers.claims import claim_attempt

    monkeypatch.setattr(sql, "REPLAN_CHECK_SECONDS", 0.0)
    monkeypatch.setattr(sql, "GROWING_TABLES", ("runs_steprun", "not..a table"))
    connection.close()
    with caplog.at_level("WARNING", logger="runs.engine.sql"):
        assert claim_attempt(0, worker="in-process", now=timezone.now()) is None
        assert claim_attempt(0, worker="in-process", now=timezone.now()) is None
    assert "could not compare the tables' size" in caplog.text
    connection.close()
