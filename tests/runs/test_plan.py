"""plan() without a database: document + journal + clock in, actions out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runs.engine.plan import (
    AttemptView,
    Close,
    Expire,
    Finish,
    Open,
    RunView,
    Schedule,
    Skip,
    StartRun,
    Wake,
    backoff_ms,
    key_text,
    parse_until,
    plan,
    wait_key,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
NOW = T0 + timedelta(seconds=10)


def doc(*steps: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"id": "wf", "steps": list(steps), **top}


def task(step_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "task", **fields}


def run(**changes: Any) -> RunView:
    values = {
        "id": "r1",
        "status": "running",
        "input": {"ticket": "Q: hello"},
        "correlation": "c-1",
        "generation": 1,
        "started_at": T0,
        "deadline_at": T0 + timedelta(minutes=5),
    }
    values.update(changes)
    return RunView(**values)


_ids = iter(range(1, 10**6))


def ok(step_id: str, output: Any = None, **fields: Any) -> AttemptView:
    return AttemptView(
        id=next(_ids),
        step_id=step_id,
        attempt=fields.pop("attempt", 1),
        status="succeeded",
        output=output,
        finished_at=T0,
        **fields,
    )


def failed(
    step_id: str, cls: str = "fatal", attempt: int = 1, at: datetime = NOW, **fields: Any
) -> AttemptView:
    error = {"class": cls, "message": f"{cls} failure", **fields.pop("error_extra", {})}
    return AttemptView(
        id=next(_ids),
        step_id=step_id,
        attempt=attempt,
        status=fields.pop("status", "failed"),
        error=error,
        finished_at=at,
        **fields,
    )


def in_flight(step_id: str, status: str = "running", **fields: Any) -> AttemptView:
    return AttemptView(
        id=next(_ids), step_id=step_id, attempt=fields.pop("attempt", 1), status=status, **fields
    )


def only(actions: list, kind: type) -> Any:
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, actions
    return found[0]


# --- starting and ordering ---------------------------------------------------------------


def test_a_pending_run_starts_its_clock_and_schedules_the_first_step_with_the_run_input() -> None:
    out = plan(
        doc(task("a"), task("b")), run(status="pending", started_at=None, deadline_at=None), [], NOW
    )
    start = only(out.actions, StartRun)
    assert start.started_at == NOW
    assert start.deadline_at == NOW + timedelta(milliseconds=300_000)
    first = only(out.actions, Schedule)
    assert (first.step_id, first.attempt, first.input) == ("a", 1, {"ticket": "Q: hello"})
    assert (first.effect, first.queue, first.timeout_ms) == ("at_least_once", "default", 60_000)


def test_run_timeout_from_limits() -> None:
    out = plan(
        doc(task("a"), limits={"run_timeout_ms": 1000}),
        run(started_at=None, deadline_at=None),
        [],
        NOW,
    )
    assert only(out.actions, StartRun).deadline_at == NOW + timedelta(seconds=1)


def test_steps_run_in_order_one_at_a_time() -> None:
    out = plan(doc(task("a"), task("b"), task("c")), run(), [ok("a", 1)], NOW)
    assert [a.step_id for a in out.of(Schedule)] == ["b"]


def test_the_default_input_is_the_previous_steps_output() -> None:
    out = plan(doc(task("a"), task("b")), run(), [ok("a", {"x": 1})], NOW)
    assert only(out.actions, Schedule).input == {"x": 1}


def test_in_flight_step_blocks_the_plan() -> None:
    for status in ("scheduled", "running", "waiting"):
        out = plan(doc(task("a"), task("b")), run(), [in_flight("a", status)], NOW)
        assert out.actions == []


def test_planning_is_idempotent_once_applied() -> None:
    document = doc(task("a"), task("b"))
    first = plan(document, run(), [ok("a", 1)], NOW)
    assert len(first.of(Schedule)) == 1
    again = plan(document, run(), [ok("a", 1), in_flight("b", "scheduled")], NOW)
    assert again.actions == []


def test_all_done_completes_with_the_last_output_or_the_output_template() -> None:
    out = plan(doc(task("a"), task("b")), run(), [ok("a", 1), ok("b", {"sent": True})], NOW)
    assert only(out.actions, Finish) == Finish("completed", output={"sent": True})
    out = plan(
        doc(
            task("a"),
            task("b"),
            output={"sent": "${steps.b.output.sent}", "a": "${steps.a.output}"},
        ),
        run(),
        [ok("a", 1), ok("b", {"sent": True})],
        NOW,
    )
    assert only(out.actions, Finish).output == {"sent": True, "a": 1}


# --- templates and guards ----------------------------------------------------------------


def test_input_template_is_resolved_with_every_root() -> None:
    step = task(
        "b",
        input={
            "kind": "${steps.a.output.kind}",
            "whole": "${steps.a.output}",
            "t": "${input.ticket}",
            "run": "${run.id}/${run.correlation}",
            "status": "${steps.a.status}",
            "missing": "${steps.a.output.nope}",
            "first": "${steps.a.output.list.0}",
        },
    )
    out = plan(doc(task("a"), step), run(), [ok("a", {"kind": "bug", "list": [7, 8]})], NOW)
    assert only(out.actions, Schedule).input == {
        "kind": "bug",
        "whole": {"kind": "bug", "list": [7, 8]},
        "t": "Q: hello",
        "run": "r1/c-1",
        "status": "succeeded",
        "missing": None,
        "first": 7,
    }


def test_a_false_guard_writes_skipped_and_goes_on() -> None:
    guarded = task("b", when={"path": "steps.a.output.kind", "op": "eq", "value": "bug"})
    out = plan(doc(task("a"), guarded, task("c")), run(), [ok("a", {"kind": "question"})], NOW)
    assert only(out.actions, Skip).step_id == "b"
    # c's default input is the output of the last step that ran (a), not the skipped b.
    assert only(out.actions, Schedule).step_id == "c"
    assert only(out.actions, Schedule).input == {"kind": "question"}


def test_a_true_guard_schedules() -> None:
    guarded = task("b", when={"path": "steps.a.output.kind", "op": "eq", "value": "bug"})
    out = plan(doc(task("a"), guarded), run(), [ok("a", {"kind": "bug"})], NOW)
    assert only(out.actions, Schedule).step_id == "b"


def test_several_skips_then_completion_in_one_plan() -> None:
    never = {"path": "input.nope", "op": "exists"}
    out = plan(
        doc(task("a"), task("b", when=never), task("c", when=never)), run(), [ok("a", 5)], NOW
    )
    assert [s.step_id for s in out.of(Skip)] == ["b", "c"]
    assert only(out.actions, Finish) == Finish("completed", output=5)


def test_a_skipped_step_reads_as_skipped_with_null_output() -> None:
    step = task("c", input={"b": "${steps.b.status}", "out": "${steps.b.output}"})
    out = plan(
        doc(task("a"), task("b"), step),
        run(),
        [ok("a", 1), AttemptView(id=99, step_id="b", attempt=1, status="skipped")],
        NOW,
    )
    assert only(out.actions, Schedule).input == {"b": "skipped", "out": None}


# --- retries -----------------------------------------------------------------------------

RETRY3 = {"max_attempts": 3, "backoff": "exponential", "initial_ms": 500, "jitter": False}


@pytest.mark.parametrize(
    ("error_class", "retried"),
    [
        ("retryable", True),
        ("timeout", True),
        ("fatal", False),
        ("invalid_input", False),
        ("rejected", False),
    ],
)
def test_which_error_classes_are_retried(error_class: str, retried: bool) -> None:
    finished = NOW - timedelta(seconds=60)
    out = plan(doc(task("a", retry=RETRY3)), run(), [failed("a", error_class, at=finished)], NOW)
    if retried:
        assert only(out.actions, Schedule).attempt == 2
    else:
        assert only(out.actions, Finish).error == {
            "class": error_class,
            "message": f"{error_class} failure",
            "step": "a",
        }


def test_retry_waits_for_its_backoff() -> None:
    finished = NOW - timedelta(milliseconds=100)
    out = plan(doc(task("a", retry=RETRY3)), run(), [failed("a", "retryable", at=finished)], NOW)
    assert out.of(Schedule) == []
    assert only(out.actions, Wake).at == finished + timedelta(milliseconds=500)


def test_retry_after_ms_sets_the_earliest_retry() -> None:
    finished = NOW - timedelta(milliseconds=100)
    attempt = failed("a", "retryable", at=finished, error_extra={"retry_after_ms": 2000})
    out = plan(doc(task("a", retry=RETRY3)), run(), [attempt], NOW)
    assert only(out.actions, Wake).at == finished + timedelta(milliseconds=2000)


def test_exponential_backoff_doubles_per_failure() -> None:
    attempts = [
        failed("a", "retryable", attempt=1, at=T0),
        failed("a", "retryable", attempt=2, at=NOW),
    ]
    out = plan(doc(task("a", retry=RETRY3)), run(), attempts, NOW)
    assert only(out.actions, Wake).at == NOW + timedelta(milliseconds=1000)


def test_budget_exhaustion_fails_the_run_naming_the_step() -> None:
    attempts = [failed("a", "retryable", attempt=n, at=T0) for n in (1, 2, 3)]
    out = plan(doc(task("a", retry=RETRY3)), run(), attempts, NOW)
    assert only(out.actions, Finish).status == "failed"
    assert only(out.actions, Finish).error["step"] == "a"


def test_default_budget_is_one_attempt_for_tasks() -> None:
    out = plan(doc(task("a")), run(), [failed("a", "retryable", at=T0)], NOW)
    assert only(out.actions, Finish).status == "failed"


def test_on_error_continue_marks_failed_and_goes_on() -> None:
    later = task(
        "b",
        input={"a": "${steps.a.status}", "e": "${steps.a.error.class}"},
        when={"path": "steps.a.status", "op": "eq", "value": "failed"},
    )
    out = plan(
        doc(task("a", on_error="continue"), later), run(), [failed("a", "fatal", at=T0)], NOW
    )
    assert only(out.actions, Schedule).input == {"a": "failed", "e": "fatal"}


@pytest.mark.parametrize("error_class", ["limit", "invalid_output"])
def test_a_kinds_own_failure_classes_are_never_retried(error_class: str) -> None:
    out = plan(doc(task("a", retry=RETRY3)), run(), [failed("a", error_class, at=T0)], NOW)
    assert only(out.actions, Finish).error["class"] == error_class


def test_a_limit_the_step_ran_into_fails_the_run_whatever_on_error_says() -> None:
    """A model call that would exceed max_cost_usd was never made: the run fails naming the
    limit, even where the step's own failures would let it go on."""
    later = task("b")
    out = plan(
        doc(task("a", on_error="continue", retry=RETRY3), later),
        run(),
        [failed("a", "limit", at=T0)],
        NOW,
    )
    assert out.of(Schedule) == []
    assert only(out.actions, Finish).error == {
        "class": "limit",
        "message": "limit failure",
        "step": "a",
    }


def test_timed_out_attempt_is_retried_per_policy() -> None:
    attempt = failed("a", "timeout", at=T0, status="timed_out")
    out = plan(doc(task("a", retry=RETRY3)), run(), [attempt], NOW)
    assert only(out.actions, Schedule).attempt == 2


@pytest.mark.parametrize("cls", ["timeout", "lost"])
def test_at_most_once_never_reruns_after_a_timeout_or_a_lost_worker(cls: str) -> None:
    attempt = failed("a", cls, at=T0)
    out = plan(doc(task("a", effect="at_most_once", retry=RETRY3)), run(), [attempt], NOW)
    assert only(out.actions, Finish).error["class"] == cls


def test_at_most_once_is_retried_on_an_explicit_retryable_failure() -> None:
    out = plan(
        doc(task("a", effect="at_most_once", retry=RETRY3)),
        run(),
        [failed("a", "retryable", at=T0)],
        NOW,
    )
    assert only(out.actions, Schedule).attempt == 2


def test_lost_at_least_once_attempt_is_offered_again_without_using_the_budget() -> None:
    attempts = [failed("a", "lost", attempt=n, at=T0) for n in (1, 2, 3, 4)]
    out = plan(doc(task("a")), run(), attempts, NOW)
    assert only(out.actions, Schedule).attempt == 5


def test_backoff_formula() -> None:
    policy = {"initial_ms": 2000, "max_ms": 30000, "jitter": False}
    assert [backoff_ms(policy, n, seed="s") for n in (1, 2, 3, 4, 5, 6)] == [
        2000,
        4000,
        8000,
        16000,
        30000,
        30000,
    ]
    assert backoff_ms({"backoff": "fixed", "initial_ms": 700, "jitter": False}, 4, seed="s") == 700
    assert backoff_ms({"backoff": "none"}, 4, seed="s") == 0
    jittered = {backoff_ms({"initial_ms": 1000}, 1, seed=str(n)) for n in range(50)}
    assert min(jittered) >= 1000 and max(jittered) <= 1200 and len(jittered) > 10
    assert backoff_ms({"initial_ms": 1000}, 1, seed="x") == backoff_ms(
        {"initial_ms": 1000}, 1, seed="x"
    )


# --- deadlines, leases, limits ---------------------------------------------------------


def test_running_attempt_past_its_deadline_is_timed_out_and_retried() -> None:
    attempt = in_flight(
        "a", deadline_at=NOW - timedelta(seconds=6), lease_expires_at=NOW + timedelta(seconds=10)
    )
    out = plan(doc(task("a", retry=RETRY3)), run(), [attempt], NOW)
    expired = only(out.actions, Expire)
    assert (expired.attempt_id, expired.status, expired.error["class"]) == (
        attempt.id,
        "timed_out",
        "timeout",
    )
    assert only(out.actions, Wake)  # the retry waits for its back-off from now


def test_deadline_has_a_grace_for_the_workers_own_report() -> None:
    attempt = in_flight(
        "a", deadline_at=NOW - timedelta(seconds=1), lease_expires_at=NOW + timedelta(seconds=10)
    )
    assert plan(doc(task("a")), run(), [attempt], NOW).actions == []


def test_a_lapsed_lease_is_a_lost_worker() -> None:
    attempt = in_flight(
        "a", deadline_at=NOW + timedelta(minutes=1), lease_expires_at=NOW - timedelta(seconds=1)
    )
    out = plan(doc(task("a")), run(), [attempt], NOW)
    assert only(out.actions, Expire).error["class"] == "lost"
    assert only(out.actions, Schedule).attempt == 2


def test_run_deadline_times_the_run_out() -> None:
    out = plan(
        doc(task("a"), limits={"run_timeout_ms": 1000}), run(deadline_at=NOW), [in_flight("a")], NOW
    )
    finish = only(out.actions, Finish)
    assert finish.status == "timed_out"
    assert "limits.run_timeout_ms (1000 ms)" in finish.error["message"]


def test_max_steps_counts_every_attempt() -> None:
    attempts = [failed("a", "retryable", attempt=n, at=T0) for n in (1, 2)]
    out = plan(
        doc(task("a", retry={"max_attempts": 10, "backoff": "none"}), limits={"max_steps": 2}),
        run(),
        attempts,
        NOW,
    )
    finish = only(out.actions, Finish)
    assert finish.error["class"] == "limit" and "limits.max_steps (2)" in finish.error["message"]


def test_max_cost_usd_stops_the_run() -> None:
    attempts = [ok("a", 1, cost_usd=1.5), ok("b", 2, cost_usd=0.75)]
    out = plan(
        doc(task("a"), task("b"), task("c"), limits={"max_cost_usd": 2.0}), run(), attempts, NOW
    )
    finish = only(out.actions, Finish)
    assert finish.status == "failed" and "limits.max_cost_usd (2.0)" in finish.error["message"]
    assert finish.error["step"] == "b"
    assert plan(
        doc(task("a"), task("b"), task("c"), limits={"max_cost_usd": 2.5}), run(), attempts, NOW
    ).of(Schedule)


def test_a_paused_run_schedules_nothing_its_deadline_timer_is_already_set() -> None:
    out = plan(doc(task("a"), task("b")), run(status="paused"), [ok("a", 1)], NOW)
    assert out.actions == []


def test_terminal_runs_plan_nothing() -> None:
    for status in ("completed", "failed", "cancelled", "timed_out"):
        assert plan(doc(task("a")), run(status=status), [], NOW).actions == []


def test_unsupported_kinds_fail_the_run_clearly() -> None:
    # A kind no module registered (http, which this test used, now has one).
    out = plan(doc({"id": "call", "kind": "teleport"}), run(), [], NOW)
    finish = only(out.actions, Finish)
    assert finish.error["class"] == "unsupported"
    assert "'teleport'" in finish.error["message"] and finish.error["step"] == "call"


# --- retry from the failed step (a new generation) -------------------------------------


def test_retry_generation_keeps_what_succeeded_and_gives_a_fresh_budget() -> None:
    attempts = [ok("a", 1), failed("b", "fatal", at=T0)]
    out = plan(doc(task("a"), task("b"), task("c")), run(generation=2), attempts, NOW)
    assert only(out.actions, Schedule) == Schedule(
        "b", "", "task", 2, 2, 1, "at_least_once", "default", 60000
    )


def test_retry_generation_counts_limits_afresh() -> None:
    attempts = [
        ok("a", 1),
        failed("b", "retryable", attempt=1, at=T0),
        failed("b", "retryable", attempt=2, at=T0),
    ]
    document = doc(
        task("a"), task("b", retry={"max_attempts": 5, "backoff": "none"}), limits={"max_steps": 3}
    )
    assert only(plan(document, run(), attempts, NOW).actions, Finish).error["class"] == "limit"
    assert only(plan(document, run(generation=2), attempts, NOW).actions, Schedule).attempt == 3


# --- conditions ------------------------------------------------------------------------


def cond(step_id: str = "branch", **fields: Any) -> dict[str, Any]:
    return {
        "id": step_id,
        "kind": "condition",
        "if": {"path": "steps.a.output.kind", "op": "eq", "value": "bug"},
        "then": [task("t1"), task("t2")],
        "else": [task("e1")],
        **fields,
    }


def test_condition_opens_its_row_and_schedules_the_branch_taken() -> None:
    out = plan(doc(task("a"), cond()), run(), [ok("a", {"kind": "bug"})], NOW)
    opened = only(out.actions, Open)
    assert (opened.step_id, opened.branch, opened.status) == ("branch", "then", "running")
    assert only(out.actions, Schedule).step_id == "t1"
    assert out.actions.index(opened) < out.actions.index(only(out.actions, Schedule))
    out = plan(doc(task("a"), cond()), run(), [ok("a", {"kind": "q"})], NOW)
    assert only(out.actions, Open).branch == "else"
    assert only(out.actions, Schedule).step_id == "e1"


def test_condition_closes_with_the_last_branch_output_and_the_run_goes_on() -> None:
    opened = AttemptView(
        id=50, step_id="branch", attempt=1, status="running", kind="condition", branch="then"
    )
    journal = [ok("a", {"kind": "bug"}), opened, ok("t1", 1), ok("t2", {"done": 2})]
    out = plan(
        doc(task("a"), cond(), task("after", input="${steps.branch.output}")), run(), journal, NOW
    )
    assert only(out.actions, Close) == Close(50, "succeeded", output={"done": 2})
    assert only(out.actions, Schedule).input == {"done": 2}


def test_an_empty_branch_opens_and_closes_at_once() -> None:
    step = cond(**{"else": []})
    step.pop("else")
    out = plan(doc(task("a"), step, task("z")), run(), [ok("a", {"kind": "q"})], NOW)
    opened = only(out.actions, Open)
    assert (opened.branch, opened.status, opened.output) == ("else", "succeeded", None)
    assert only(out.actions, Schedule).step_id == "z"


def test_nested_conditions() -> None:
    inner = {
        "id": "inner",
        "kind": "condition",
        "if": {"path": "input.ticket", "op": "matches", "value": "^Q"},
        "then": [task("deep")],
    }
    outer = {
        "id": "outer",
        "kind": "condition",
        "if": {"path": "steps.a.output", "op": "eq", "value": 1},
        "then": [inner],
    }
    out = plan(doc(task("a"), outer), run(), [ok("a", 1)], NOW)
    assert [(o.step_id, o.branch) for o in out.of(Open)] == [("outer", "then"), ("inner", "then")]
    assert only(out.actions, Schedule).step_id == "deep"


def test_a_failure_inside_a_branch_fails_the_run_naming_the_inner_step() -> None:
    opened = AttemptView(
        id=50, step_id="branch", attempt=1, status="running", kind="condition", branch="else"
    )
    out = plan(
        doc(task("a"), cond()), run(), [ok("a", {"kind": "q"}), opened, failed("e1", at=T0)], NOW
    )
    assert only(out.actions, Finish).error["step"] == "e1"


def test_a_skipped_condition_writes_skipped() -> None:
    step = cond(when={"path": "input.nope", "op": "exists"})
    out = plan(doc(task("a"), step), run(), [ok("a", {"kind": "bug"})], NOW)
    assert only(out.actions, Skip).kind == "condition"
    assert only(out.actions, Finish).status == "completed"


# --- sleeps and waits ---------------------------------------------------------------------


def waiting(step_id: str, kind: str, due: datetime | None, **fields: Any) -> AttemptView:
    return in_flight(step_id, status="waiting", kind=kind, not_before=due, **fields)


def test_a_sleep_opens_a_waiting_row_with_a_timer_and_the_run_shows_waiting() -> None:
    out = plan(doc({"id": "nap", "kind": "sleep", "ms": 2000}, task("b")), run(), [], NOW)
    opened = only(out.actions, Open)
    assert (opened.status, opened.timer, opened.not_before) == (
        "waiting",
        "sleep",
        NOW + timedelta(seconds=2),
    )
    assert out.waiting and out.of(Schedule) == []


def test_a_sleep_not_yet_due_plans_nothing_and_stays_waiting() -> None:
    journal = [waiting("nap", "sleep", NOW + timedelta(seconds=1))]
    out = plan(doc({"id": "nap", "kind": "sleep", "ms": 2000}, task("b")), run(), journal, NOW)
    assert out.actions == [] and out.waiting


def test_a_due_sleep_closes_and_the_next_step_gets_the_input_before_the_sleep() -> None:
    journal = [ok("a", {"x": 1}), waiting("nap", "sleep", NOW)]
    out = plan(
        doc(task("a"), {"id": "nap", "kind": "sleep", "ms": 5}, task("b")), run(), journal, NOW
    )
    close = only(out.actions, Close)
    assert (close.attempt_id, close.status) == (journal[1].id, "succeeded")
    # A sleep's output is null, and it is the previous step's output for the next one.
    assert only(out.actions, Schedule).input is None
    assert not out.waiting


@pytest.mark.parametrize(
    "until",
    ["2026-01-01T11:00:00Z", "2026-01-01T11:00:00", "1767265200000", 1767265200000, 0],
)
def test_a_sleep_until_in_the_past_is_over_within_the_same_plan(until: Any) -> None:
    out = plan(
        doc({"id": "nap", "kind": "sleep_until", "until": "${input.at}"}, task("b")),
        run(input={"at": until}),
        [],
        NOW,
    )
    assert only(out.actions, Open).status == "succeeded"
    assert only(out.actions, Schedule).step_id == "b"


@pytest.mark.parametrize(
    ("until", "due"),
    [
        ("2026-01-01T13:00:00+01:00", datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
        ("2026-01-01T12:30:00Z", datetime(2026, 1, 1, 12, 30, tzinfo=UTC)),
        ("2026-01-01T12:30:00", datetime(2026, 1, 1, 12, 30, tzinfo=UTC)),
        (1767270600000, datetime(2026, 1, 1, 12, 30, tzinfo=UTC)),
        ("1767270600000", datetime(2026, 1, 1, 12, 30, tzinfo=UTC)),
    ],
)
def test_sleep_until_reads_iso_8601_and_epoch_ms(until: Any, due: datetime) -> None:
    out = plan(
        doc({"id": "nap", "kind": "sleep_until", "until": "${input.at}"}),
        run(input={"at": until}),
        [],
        T0 - timedelta(hours=1),
    )
    opened = only(out.actions, Open)
    if due <= T0 - timedelta(hours=1):
        assert opened.status == "succeeded"
    else:
        assert (opened.status, opened.not_before) == ("waiting", due)


@pytest.mark.parametrize(
    "until",
    [
        "next tuesday",
        None,
        True,
        {"at": 1},
        10**30,
        "2026-13-01",
        # Beyond what the database can store: each of these raised there, or in the
        # reconciler on every pass, instead of failing the step once.
        "2030-01-01T00:00:00+99:00",
        "2030-01-01T00:00:00+16:00",
        "2030-01-01T00:00:00-23:59",
        "9999-12-31T23:59:59-10:00",
        "0001-01-01T00:00:00+05:00",
        "10000-01-01T00:00:00Z",
        253402300800000,
        -62135596800001,
        "99999999999999999999",
        1e300,
        float("nan"),
        float("inf"),
    ],
)
def test_a_sleep_until_that_is_not_a_time_fails_the_step_as_invalid_input(until: Any) -> None:
    out = plan(
        doc({"id": "nap", "kind": "sleep_until", "until": "${input.at}"}, task("b")),
        run(input={"at": until}),
        [],
        NOW,
    )
    opened = only(out.actions, Open)
    assert opened.status == "failed" and opened.error["class"] == "invalid_input"
    assert opened.error["message"].startswith("until: ")
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "invalid_input",
        "nap",
    )


def test_a_bad_sleep_until_with_continue_goes_on() -> None:
    out = plan(
        doc(
            {"id": "nap", "kind": "sleep_until", "until": "soon", "on_error": "continue"},
            task("b", input="${steps.nap.status}"),
        ),
        run(),
        [],
        NOW,
    )
    assert only(out.actions, Schedule).input == "failed"


def test_a_wait_event_resolves_its_key_per_run_and_sets_a_timeout_timer() -> None:
    step = {
        "id": "w",
        "kind": "wait_event",
        "event": "approved",
        "key": "${input.ticket}",
        "timeout_ms": 60_000,
    }
    out = plan(doc(step), run(input={"ticket": 42}), [], NOW)
    opened = only(out.actions, Open)
    assert opened.input == {"event": "approved", "key": "42"}
    assert (opened.timer, opened.not_before) == ("wait_timeout", NOW + timedelta(minutes=1))
    assert opened.wait_key == wait_key("approved", "42") != wait_key("approved", "43")
    assert out.waiting


def test_a_wait_event_without_timeout_has_no_timer() -> None:
    out = plan(doc({"id": "w", "kind": "wait_event", "event": "e"}), run(), [], NOW)
    opened = only(out.actions, Open)
    assert opened.timer is None and opened.not_before is None
    assert opened.input == {"event": "e", "key": ""}


def test_a_wait_event_that_took_its_event_passes_the_payload_on() -> None:
    journal = [ok("w", {"ok": True}, kind="wait_event")]
    out = plan(
        doc({"id": "w", "kind": "wait_event", "event": "e"}, task("b", input="${steps.w.output}")),
        run(),
        journal,
        NOW,
    )
    assert only(out.actions, Schedule).input == {"ok": True}


def test_a_timed_out_wait_fails_the_run_with_class_timeout() -> None:
    journal = [waiting("w", "wait_event", NOW)]
    out = plan(
        doc({"id": "w", "kind": "wait_event", "event": "e", "timeout_ms": 5}, task("b")),
        run(),
        journal,
        NOW,
    )
    close = only(out.actions, Close)
    assert (close.status, close.error["class"]) == ("timed_out", "timeout")
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "timeout",
        "w",
    )


def test_a_timed_out_wait_with_continue_goes_on_and_a_guard_sees_its_status() -> None:
    journal = [waiting("w", "wait_event", NOW - timedelta(milliseconds=1))]
    out = plan(
        doc(
            {
                "id": "w",
                "kind": "wait_event",
                "event": "e",
                "timeout_ms": 5,
                "on_error": "continue",
            },
            task("b", when={"path": "steps.w.error.class", "op": "eq", "value": "timeout"}),
        ),
        run(),
        journal,
        NOW,
    )
    assert only(out.actions, Schedule).step_id == "b"


def test_a_run_in_retry_back_off_is_not_waiting_and_names_its_timer() -> None:
    journal = [failed("a", "retryable", at=NOW)]
    out = plan(doc(task("a", retry={"max_attempts": 2, "initial_ms": 1000})), run(), journal, NOW)
    wake = only(out.actions, Wake)
    assert (wake.purpose, wake.key) == ("retry_backoff", f"retry:{journal[0].id}")
    assert not out.waiting


def test_a_sleep_counts_towards_max_steps() -> None:
    out = plan(
        doc(task("a"), {"id": "nap", "kind": "sleep", "ms": 5}, limits={"max_steps": 1}),
        run(),
        [ok("a")],
        NOW,
    )
    assert only(out.actions, Finish).error["class"] == "limit"


def test_key_text_and_parse_until_edges() -> None:
    assert key_text("abc") == "abc" and key_text(None) == "" and key_text(7) == "7"
    assert key_text({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    assert parse_until("2026-01-01T12:00:00.250+00:00") == T0 + timedelta(milliseconds=250)
    with pytest.raises(ValueError, match="out of range"):
        parse_until(-(10**20))
    with pytest.raises(ValueError, match=r"'2030-01-01T00:00:00\+16:00' has an offset beyond"):
        parse_until("2030-01-01T00:00:00+16:00")
    with pytest.raises(ValueError, match=r"9999-12-31T23:59:59-10:00.* out of range"):
        parse_until("9999-12-31T23:59:59-10:00")
    # The edges that can be stored, all in UTC.
    assert parse_until("2030-01-01T15:59:00+15:59") == datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_until("2029-12-31T08:01:00-15:59") == datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_until(253402300799999) == datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    assert parse_until(-62135596800000) == datetime(1, 1, 1, tzinfo=UTC)
    assert parse_until("2026-01-01T13:00:00+01:00").utcoffset() == timedelta(0)
