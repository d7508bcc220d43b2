"""Issue 17's table (bench/goals.py): goals read the right quantity, cells say what was met."""

from __future__ import annotations

from bench.goals import Goal, GoalRow, figure, format_goal_table, goal_cell


def test_a_ratio_goal_at_most_reads_engine_over_bare() -> None:
    goal = Goal("ratio", 1.5, at_most=True)
    assert goal.met(GoalRow("seq", "ms/step", engine=1.4, bare=1.0, goal=goal)) is True
    assert goal.met(GoalRow("seq", "ms/step", engine=1.6, bare=1.0, goal=goal)) is False


def test_a_ratio_goal_at_least_is_met_from_its_limit_up() -> None:
    goal = Goal("ratio", 0.6, at_most=False)
    assert goal.met(GoalRow("many", "steps/s", engine=600, bare=1000, goal=goal)) is True
    assert goal.met(GoalRow("many", "steps/s", engine=599, bare=1000, goal=goal)) is False


def test_an_engine_goal_ignores_bare() -> None:
    goal = Goal("engine", 1000.0, at_most=True)
    assert goal.met(GoalRow("p99", "ms", engine=900.0, bare=1.0, goal=goal)) is True
    assert goal.met(GoalRow("p99", "ms", engine=1100.0, bare=5000.0, goal=goal)) is False


def test_an_unmeasured_figure_is_neither_met_nor_missed() -> None:
    goal = Goal("ratio", 2.0, at_most=True)
    row = GoalRow("burst", "s", engine=None, bare=11.7, goal=goal)
    assert goal.met(row) is None
    assert goal_cell(row) == "ratio <= 2x: not measured"
    assert goal_cell(GoalRow("burst", "s", engine=30.0, bare=10.0, goal=goal)) == (
        "ratio <= 2x: MISSED"
    )


def test_figures_group_thousands_from_100_and_keep_two_decimals_below() -> None:
    assert figure(1252.4) == "1,252"
    assert figure(2.816) == "2.82"
    assert figure(None) == "n/a"


def test_the_table_has_a_line_per_row_under_the_issues_columns() -> None:
    rows = [
        GoalRow(
            "200 sequential steps vs relay",
            "ms/step",
            2.0,
            1.0,
            Goal("ratio", 1.5, True),
            "1.94 ms vs 0.97 relay: 2.0x",
            "3.0x",
        ),
        GoalRow("statements per step", "statements", 6.0, None),
    ]
    text = format_goal_table(rows).splitlines()
    assert len(text) == 4
    assert "DBOS Transact 3.4 (issue 17)" in text[0]
    assert "issue 17's starting figure" in text[0]
    assert "2.00x" in text[2] and "ratio <= 1.5x: MISSED" in text[2] and "2.0x" in text[2]
    # A figure of the engine alone has no bare or ratio cell, not "n/a".
    assert "n/a" not in text[3]
    markdown = format_goal_table(rows, markdown=True).splitlines()
    assert markdown[1] == "|" + "---|" * 7
    assert markdown[2].startswith("| 200 sequential steps vs relay (ms/step) | 2.00 | 1.00 | 2.00x")
