"""plan() and a document's ``on_failure`` steps (CONTRACT section 13): they run when a step's
failure would fail the run, read ``${error}``, complete the run with their last output, and
leave the original error in place (with theirs beside it) when they fail themselves."""

from __future__ import annotations

from datetime import timedelta

from runs.engine.plan import AttemptView, Finish, Schedule, Wake, plan

from .test_plan import NOW, RETRY3, T0, doc, failed, in_flight, ok, only, run, task

HANDLER = "_on_failure[1]/"


def handled(*steps, on_failure=None, **top):
    return doc(
        *steps,
        on_failure=on_failure
        or [
            task("tidy", input={"why": "${error.message}", "step": "${error.step}"}),
            task("report"),
        ],
        **top,
    )


def test_a_failed_step_starts_the_handler_with_the_error_in_its_templates() -> None:
    out = plan(handled(task("a"), task("b")), run(), [ok("a", 1), failed("b")], NOW)
    scheduled = only(out.actions, Schedule)
    assert (scheduled.step_id, scheduled.path) == ("tidy", HANDLER)
    assert scheduled.input == {"why": "fatal failure", "step": "b"}
    assert not out.of(Finish)


def test_the_first_handler_steps_default_input_is_the_error() -> None:
    out = plan(handled(task("a"), on_failure=[task("tidy")]), run(), [failed("a", "fatal")], NOW)
    assert only(out.actions, Schedule).input == {
        "class": "fatal",
        "message": "fatal failure",
        "step": "a",
    }


def test_handler_steps_go_in_order_and_the_run_completes_with_the_last_ones_output() -> None:
    steps = handled(task("a"), output={"never": "${steps.a.output}"})
    journal = [failed("a"), ok("tidy", {"tidied": 1}, path=HANDLER)]
    out = plan(steps, run(), journal, NOW)
    second = only(out.actions, Schedule)
    assert (second.step_id, second.path, second.input) == ("report", HANDLER, {"tidied": 1})

    journal.append(ok("report", {"reported": True}, path=HANDLER))
    finish = only(plan(steps, run(), journal, NOW).actions, Finish)
    # The document's output template reads the main steps, which did not all run: the
    # handler's own last output is the run's.
    assert (finish.status, finish.output, finish.error) == ("completed", {"reported": True}, None)


def test_a_failed_handler_fails_the_run_with_the_original_error_and_its_own_beside_it() -> None:
    journal = [failed("a", "invalid_input"), failed("tidy", "fatal", path=HANDLER)]
    finish = only(plan(handled(task("a")), run(), journal, NOW).actions, Finish)
    assert finish.status == "failed"
    assert (finish.error["class"], finish.error["step"]) == ("invalid_input", "a")
    assert finish.error["on_failure"] == {
        "class": "fatal",
        "message": "fatal failure",
        "step": "tidy",
    }


def test_handler_steps_retry_by_their_own_policy() -> None:
    steps = handled(task("a"), on_failure=[task("tidy", retry=RETRY3)])
    journal = [failed("a"), failed("tidy", "retryable", path=HANDLER, at=NOW - timedelta(hours=1))]
    scheduled = only(plan(steps, run(), journal, NOW).actions, Schedule)
    assert (scheduled.step_id, scheduled.attempt, scheduled.path) == ("tidy", 2, HANDLER)


def test_a_handler_step_in_flight_holds_the_run() -> None:
    journal = [failed("a"), in_flight("tidy", path=HANDLER)]
    out = plan(handled(task("a")), run(), journal, NOW)
    assert out.actions == [] and not out.waiting


def test_a_handler_that_sleeps_shows_the_run_waiting() -> None:
    steps = handled(task("a"), on_failure=[{"id": "nap", "kind": "sleep", "ms": 60_000}])
    out = plan(steps, run(), [failed("a")], NOW)
    assert out.waiting and not out.of(Finish)


def test_a_step_time_out_runs_the_handler() -> None:
    journal = [failed("a", "timeout", status="timed_out")]
    scheduled = only(plan(handled(task("a")), run(), journal, NOW).actions, Schedule)
    assert scheduled.input["why"] == "timeout failure"


def test_on_error_continue_is_no_failure_of_the_run() -> None:
    steps = handled(task("a", on_error="continue"), task("b"))
    scheduled = only(plan(steps, run(), [failed("a")], NOW).actions, Schedule)
    assert (scheduled.step_id, scheduled.path) == ("b", "")


def test_a_failure_inside_a_composite_runs_the_handler_naming_the_inner_step() -> None:
    steps = handled({"id": "each", "kind": "foreach", "items": "${input.xs}", "do": task("x")})
    each = AttemptView(id=500, step_id="each", attempt=1, status="running", kind="foreach")
    journal = [each, failed("x", path="each[0]/")]
    out = plan(steps, run(input={"xs": [1]}), journal, NOW)
    assert only(out.actions, Schedule).input["step"] == "x"


def test_a_run_limit_does_not_run_the_handler() -> None:
    attempts = [failed("a", "retryable", attempt=n, at=T0) for n in (1, 2)]
    steps = handled(
        task("a", retry={"max_attempts": 10, "backoff": "none"}), limits={"max_steps": 2}
    )
    finish = only(plan(steps, run(), attempts, NOW).actions, Finish)
    assert finish.error["class"] == "limit"
    assert not plan(steps, run(), attempts, NOW).of(Schedule)


def test_the_run_deadline_does_not_run_the_handler() -> None:
    out = plan(handled(task("a")), run(deadline_at=NOW), [failed("a")], NOW)
    assert only(out.actions, Finish).status == "timed_out"
    assert not out.of(Schedule)


def test_a_body_run_has_no_handler_of_its_own() -> None:
    """A body of several steps runs as an anonymous child run over its parent's document: its
    failure fails its parent's step, whose run then runs the handler, once."""
    out = plan(handled(task("a")), run(scope={"input": None, "steps": {}}), [failed("a")], NOW)
    assert only(out.actions, Finish).status == "failed"


def test_after_a_retry_of_the_run_the_handler_runs_again_in_the_new_generation() -> None:
    journal = [
        failed("a", generation=1),
        ok("tidy", 1, path=HANDLER, generation=1),
        ok("report", 2, path=HANDLER, generation=1),
        failed("a", attempt=2, generation=2),
    ]
    scheduled = only(plan(handled(task("a")), run(generation=2), journal, NOW).actions, Schedule)
    assert (scheduled.step_id, scheduled.path, scheduled.generation) == (
        "tidy",
        "_on_failure[2]/",
        2,
    )


def test_a_handler_that_waits_for_a_back_off_asks_for_a_wake() -> None:
    steps = handled(task("a"), on_failure=[task("tidy", retry=RETRY3)])
    journal = [failed("a"), failed("tidy", "retryable", path=HANDLER, at=NOW)]
    out = plan(steps, run(), journal, NOW)
    assert only(out.actions, Wake) and not out.of(Schedule)


def test_a_handler_step_whose_worker_was_lost_is_offered_again() -> None:
    """The handler's rows are journal rows like any: a crashed worker's attempt of one is
    given up and offered again (at_least_once), and the run resumes the handler."""
    lost = in_flight(
        "tidy",
        path=HANDLER,
        deadline_at=NOW + timedelta(minutes=1),
        lease_expires_at=NOW - timedelta(seconds=1),
    )
    out = plan(handled(task("a")), run(), [failed("a"), lost], NOW)
    scheduled = only(out.actions, Schedule)
    assert (scheduled.step_id, scheduled.path, scheduled.attempt) == ("tidy", HANDLER, 2)
    assert not out.of(Finish)


def test_a_handler_that_runs_into_max_steps_fails_the_run_with_the_original_error_first() -> None:
    steps = handled(task("a"), limits={"max_steps": 1})
    finish = only(plan(steps, run(), [failed("a", "fatal")], NOW).actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == ("failed", "fatal", "a")
    assert finish.error["on_failure"]["class"] == "limit"
    assert "limits.max_steps (1)" in finish.error["on_failure"]["message"]
