"""bench.run_all's issue 17 table: each Goal figure comes from the right measurement."""

from __future__ import annotations

import pytest

from bench import goals
from bench.common import Row, read_rows, write_rows
from bench.pg_counts import cpu_delta
from bench.run_all import Sitting, goal_rows


def sitting() -> Sitting:
    return Sitting(
        sequential={10: (3.0, 1.0), 200: (3.3, 1.1), 2000: (4.2, 1.0)},
        shapes={"16x200": (480.0, 1000.0), "1000x5": (300.0, 1000.0)},
        timers=[
            Row("2,000 due at once: all timers fired (bare: all tasks started)", "s", 5, 2, True),
            Row("2,000 due at once: all runs completed (bare: all tasks ran)", "s", 30, 10, True),
            Row("200 over 10 s, lateness of the timer's firing, p50", "ms", 500, 2, True),
            Row("200 over 10 s, lateness of the timer's firing, p99", "ms", 1200, 4, True),
        ],
        fanout=[Row("2,000 items: start to run completed / chord body ran", "s", 12, 10, True)],
        scale_out=[
            {
                "nodes": 2,
                "concurrency": 2,
                "runs": 16,
                "steps": 200,
                "engine": 400.0,
                "bare": 900.0,
                "worker_cpu_ms": 2.0,
                "postgres_cpu_ms": 1.5,
                "redis_cpu_ms": 0.1,
            }
        ],
        counts={
            "many": {
                "label": "16x200",
                "statements_per_step": 5.0,
                "commits_per_step": 2.0,
                "rollbacks": 0,
            }
        },
    )


def by_name(rows: list[goals.GoalRow]) -> dict[str, goals.GoalRow]:
    return {row.name: row for row in rows}


def test_every_goal_of_the_issue_has_its_row_and_verdict() -> None:
    rows = by_name(goal_rows(sitting(), 200, [(16, 200), (1000, 5)]))
    sequential = rows["200 sequential steps vs relay"]
    assert (
        sequential.ratio == pytest.approx(3.0)
        and sequential.goal
        and sequential.goal.met(sequential) is False
    )
    assert sequential.dbos == goals.SEQUENTIAL[0]
    length = rows["per-step cost, 2,000 steps / 10 steps"]
    assert length.engine == pytest.approx(1.4) and length.goal and length.goal.met(length) is False
    many = rows["16x200 vs independent tasks"]
    assert many.ratio == pytest.approx(0.48) and many.start == goals.MANY_LONG[1]
    # The sub-benchmarks' rows are found whatever count --scale gave them.
    foreach = rows["2,000 items: start to run completed / chord body ran"]
    assert foreach.goal and foreach.goal.met(foreach) is True  # 1.2x
    burst = rows["2,000 due at once: all runs completed (bare: all tasks ran)"]
    assert burst.goal and burst.goal.met(burst) is False  # 3x against 2x
    late = rows["200 over 10 s, lateness of the timer's firing, p99"]
    assert late.goal and late.goal.met(late) is False  # 1,200 ms against 1 s
    starts = next(row for row in rows.values() if row.name.startswith("starts per second"))
    assert starts.engine is None and starts.goal and starts.goal.met(starts) is None
    scale = next(row for row in rows.values() if row.name.startswith("scale-out"))
    assert "2 worker nodes x 2 processes" in scale.name and scale.engine == 400.0
    assert rows["Postgres statements per step (16x200)"].engine == 5.0
    assert rows["Postgres commits per step (16x200; rollbacks 0)"].engine == 2.0


def test_a_sub_benchmark_not_run_is_not_measured() -> None:
    empty = Sitting(sequential={200: (3.0, 1.0)})
    rows = goal_rows(empty, 200, [(16, 200)])
    foreach = next(row for row in rows if row.name.startswith("foreach"))
    assert foreach.engine is None and goals.goal_cell(foreach).endswith("not measured")


def test_rows_go_through_json_unchanged(tmp_path) -> None:
    rows = [Row("a", "s", 1.5, None, True), Row("b", "ms", None, 2.0, False)]
    path = str(tmp_path / "rows.json")
    write_rows(path, rows)
    assert read_rows(path) == rows


def test_cpu_of_a_process_started_in_between_counts_from_zero() -> None:
    assert cpu_delta({1: 1.0, 2: 5.0}, {1: 1.5, 2: 5.0, 3: 0.25}) == 0.75


@pytest.mark.parametrize(("length", "runs"), [(10, 23), (2, 199), (200, 1), (2000, 1)])
def test_a_short_runs_per_step_cost_is_averaged_over_as_many_intervals_as_a_200_step_run(
    length: int, runs: int
) -> None:
    from bench.common import runs_for

    assert runs_for(length) == runs


def test_a_run_length_under_two_steps_is_refused_before_anything_starts() -> None:
    """A per-step figure is timed between a run's first and last step: one step has none."""
    from bench.run_all import main

    with pytest.raises(SystemExit) as refused:
        main(["--lengths", "1,10"])
    assert refused.value.code == 2
