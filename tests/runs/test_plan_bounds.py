"""Bounded work in the planner (contract section 9): max_steps by default and over a tree,
subworkflow depth, 1 MiB values refused while templates render, and the planning budget.

For each bound, a case just under it and one just over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import tracemalloc
from typing import Any

import pytest

from runs.engine.plan import (
    DEFAULT_MAX_STEPS,
    MAX_SUBWORKFLOW_DEPTH,
    MAX_VALUE_BYTES,
    Finish,
    Open,
    Schedule,
    plan,
)

from .test_plan import NOW, doc, in_flight, ok, only, run, task

MIB = MAX_VALUE_BYTES


def sleep(step_id: str) -> dict[str, Any]:
    return {"id": step_id, "kind": "sleep", "ms": 0}


def sub(step_id: str = "child", workflow: str = "inner") -> dict[str, Any]:
    return {"id": step_id, "kind": "subworkflow", "workflow": workflow}


def string_of(size: int) -> str:
    """A string whose compact JSON is ``size`` bytes (its two quotes included)."""
    return "x" * (size - 2)


# --- max_steps ----------------------------------------------------------------------------------


def test_max_steps_defaults_to_1000() -> None:
    journal = [ok(f"s{i}") for i in range(999)]
    steps = [task(f"s{i}") for i in range(1001)]
    assert only(plan(doc(*steps), run(), journal, NOW).actions, Schedule).step_id == "s999"
    journal.append(ok("s999"))
    finish = only(plan(doc(*steps), run(), journal, NOW).actions, Finish)
    assert finish.status == "failed"
    assert finish.error["class"] == "limit"
    assert f"limits.max_steps ({DEFAULT_MAX_STEPS})" in finish.error["message"]


def test_max_steps_counts_the_other_runs_of_the_tree() -> None:
    # A child whose root allows 10: the root and the other runs made 8, this one 1.
    journal = [ok("a")]
    child = run(depth=1, tree_used=8, tree_limit=10)
    assert only(plan(doc(task("a"), task("b")), child, journal, NOW).actions, Schedule)
    over = run(depth=1, tree_used=9, tree_limit=10)
    finish = only(plan(doc(task("a"), task("b")), over, journal, NOW).actions, Finish)
    assert finish.error["class"] == "limit"
    assert "(10) reached by the run, its subworkflows" in finish.error["message"]
    # A root counts its descendants against its own limit.
    root = run(tree_used=8)
    limited = doc(task("a"), task("b"), limits={"max_steps": 10})
    assert only(plan(limited, root, journal, NOW).actions, Schedule)
    root = run(tree_used=9)
    assert only(plan(limited, root, journal, NOW).actions, Finish).error["class"] == "limit"


def test_a_body_run_counts_against_max_steps_too() -> None:
    body = {"id": "l", "kind": "loop", "max_iterations": 5, "do": [task("x"), task("y")]}
    limited = doc(body, limits={"max_steps": 1})
    assert [o.start is not None for o in plan(limited, run(), [], NOW).of(Open)] == [False, True]
    finish = only(plan(limited, run(tree_used=1), [], NOW).actions, Finish)
    assert finish.error["class"] == "limit"


# --- subworkflow depth --------------------------------------------------------------------------


def test_a_subworkflow_starts_a_child_up_to_8_deep_and_fails_past_it() -> None:
    under = plan(doc(sub()), run(depth=MAX_SUBWORKFLOW_DEPTH - 1), [], NOW)
    assert only(under.actions, Open).start == {
        "workflow": "inner",
        "version": None,
        "input": {"ticket": "Q: hello"},
    }
    over = plan(doc(sub()), run(depth=MAX_SUBWORKFLOW_DEPTH), [], NOW)
    opened = only(over.actions, Open)
    assert (opened.status, opened.start) == ("failed", None)
    assert opened.error["class"] == "invalid_input"
    assert "at most 8 deep" in opened.error["message"]
    finish = only(over.actions, Finish)
    assert (finish.error["class"], finish.error["step"]) == ("invalid_input", "child")


# --- 1 MiB values -------------------------------------------------------------------------------


def test_a_resolved_input_of_1_mib_is_scheduled_and_one_byte_more_fails_the_step() -> None:
    step = task("a", input={"text": "${input.text}"})
    # {"text":"..."} is 10 bytes around the string's own JSON.
    fits = run(input={"text": string_of(MIB - 10)})
    assert json.dumps(only(plan(doc(step), fits, [], NOW).actions, Schedule).input)
    over = run(input={"text": string_of(MIB - 9)})
    out = plan(doc(step), over, [], NOW)
    opened = only(out.actions, Open)
    assert (opened.status, opened.error["class"]) == ("failed", "invalid_input")
    assert opened.error["message"].startswith("input: the resolved value is over 1048576 bytes")
    assert only(out.actions, Finish).error["class"] == "invalid_input"
    assert not out.of(Schedule)


def test_the_default_input_is_bounded_too() -> None:
    assert only(plan(doc(task("a")), run(input=string_of(MIB)), [], NOW).actions, Schedule)
    out = plan(doc(task("a")), run(input=string_of(MIB + 1)), [], NOW)
    assert only(out.actions, Finish).error["class"] == "invalid_input"


def test_every_field_an_engine_step_resolves_is_bounded() -> None:
    big = run(input={"text": string_of(MIB)})
    steps = [
        {"id": "w", "kind": "wait_event", "event": "e", "key": "${input.text}${input.text}"},
        {"id": "u", "kind": "sleep_until", "until": "${input.text}!"},
        {"id": "h", "kind": "handoff", "group": "g", "message": "${input.text}${input.text}"},
        {**sub(), "input": ["${input.text}", "${input.text}"]},
    ]
    for step in steps:
        finish = only(plan(doc(step), big, [], NOW).actions, Finish)
        assert finish.error["class"] == "invalid_input", step
    # The run's own output template.
    output = doc(task("a"), output=["${input.text}", "${input.text}"])
    finish = only(plan(output, big, [ok("a")], NOW).actions, Finish)
    assert finish.error["class"] == "invalid_input"
    assert finish.error["message"].startswith("output:")


def test_a_composite_steps_output_is_bounded() -> None:
    fan = {"id": "fan", "kind": "foreach", "items": "${input.xs}", "do": task("one")}
    half = string_of(MIB // 2 - 2)
    journal = [in_flight("fan", kind="foreach"), ok("one", path="fan[0]/", output=half)]
    fits = plan(
        doc(fan), run(input={"xs": [1, 2]}), [*journal, ok("one", path="fan[1]/", output=half)], NOW
    )
    assert only(fits.actions, Finish).status == "completed"
    over = plan(
        doc(fan),
        run(input={"xs": [1, 2]}),
        [*journal, ok("one", path="fan[1]/", output=half + "xy")],
        NOW,
    )
    finish = only(over.actions, Finish)
    assert finish.error["class"] == "invalid_input"
    assert "output: the step's output is over 1048576 bytes" in finish.error["message"]


def test_a_template_bomb_fails_fast_and_small() -> None:
    # 5,000 references to a 280 KB value: 1.4 GB had it been built.
    bomb = task("a", input={"copies": [{"again": ["${input.big}"] * 100}] * 50})
    big = run(input={"big": ["x" * 10] * 20_000})
    tracemalloc.start()
    started = time.monotonic()
    try:
        out = plan(doc(bomb), big, [], NOW)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 2.0
    assert only(out.actions, Finish).error["class"] == "invalid_input"
    assert peak < 50 * 2**20, f"the planner allocated {peak / 2**20:.0f} MiB at its peak"


def test_interpolated_text_is_bounded_while_it_is_built() -> None:
    bomb = task("a", input="${input.big}" * 10_000)
    big = run(input={"big": {"k": "v" * 100_000}})
    tracemalloc.start()
    try:
        out = plan(doc(bomb), big, [], NOW)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert only(out.actions, Finish).error["class"] == "invalid_input"
    assert peak < 20 * 2**20


# --- the planning budget ------------------------------------------------------------------------


def conditions(times: int) -> dict[str, Any]:
    """A loop of conditions that take no branch: engine rows only, none counted."""
    cond = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.no", "op": "exists"},
        "then": [sleep("never")],
    }
    return {"id": "spin", "kind": "loop", "max_iterations": times, "do": cond}


def test_the_walk_stops_at_its_budget_and_says_there_is_more() -> None:
    out = plan(doc(conditions(10_000)), run(), [], NOW, max_actions=20)
    assert out.more and len(out.actions) == 21  # the loop's row, opened where it began
    assert not out.of(Finish) and not out.waiting
    whole = plan(doc(conditions(30)), run(), [], NOW)
    assert not whole.more and whole.finish is not None


def test_a_parallels_branches_are_never_split() -> None:
    branches = {f"b{i}": task(f"t{i}") for i in range(30)}
    out = plan(
        doc({"id": "p", "kind": "parallel", "branches": branches}), run(), [], NOW, max_actions=5
    )
    assert len(out.of(Schedule)) == 30


def test_a_fan_out_is_split_by_the_budget() -> None:
    fan = {"id": "fan", "kind": "foreach", "items": "${input.xs}", "do": task("one")}
    out = plan(doc(fan), run(input={"xs": list(range(100))}), [], NOW, max_actions=20)
    assert out.more and len(out.of(Schedule)) == 20


# --- in a process of its own --------------------------------------------------------------------


BOMB_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    # Today's planner built the bomb in full: fail at 1 GiB instead of taking the machine.
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
    def peak_kib():
        # VmHWM: this process's own peak. ru_maxrss would do elsewhere, but Linux carries it
        # over exec from the forking process (pytest's, some hundred MB in a long session).
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from datetime import UTC, datetime
    from runs.engine.plan import RunView, plan
    now = datetime(2026, 1, 1, tzinfo=UTC)
    document = {"id": "wf", "steps": [{"id": "a", "kind": "task",
        "input": {"copies": [{"again": ["${input.big}"] * 100}] * 50}}]}
    view = RunView(id="r", status="pending", input={"big": ["x" * 10] * 20_000},
                   correlation=None, generation=1, started_at=None, deadline_at=None)
    try:
        out = plan(document, view, [], now)
        error = out.finish.error["class"] if out.finish else "none"
    except MemoryError:
        error = "MemoryError"
    peak = peak_kib()
    print(json.dumps({"error": error, "peak_kib": peak}))
    """
)


def test_a_template_bomb_keeps_the_process_under_200_mb() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", BOMB_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    print(f"template bomb: {found}, {time.monotonic() - started:.2f} s")
    assert found["error"] == "invalid_input"
    assert found["peak_kib"] < 200 * 1024


@pytest.mark.parametrize("depth", [0, 8])
def test_depth_is_read_from_the_view(depth: int) -> None:
    assert run(depth=depth).depth == depth
