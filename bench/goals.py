"""Issue 17's table: each figure of its Goal beside its target, DBOS's figure and where we began.

Pure: rows in, text out (``bench.run_all`` fills the rows from its measurements and the
sub-benchmarks' JSON). The DBOS Transact 3.4 figures and the starting figures are quoted
from issue 17 (its table and its text) or, where the issue gives none, from
``bench/README.md`` (marked so); they are constants on purpose: they are what the figures of
this run are compared with, not measurements of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Where the quoted constants come from.
ISSUE = "issue 17"
README = "bench/README.md"


@dataclass(frozen=True)
class Goal:
    """A target on one quantity of a row: its ``ratio`` (engine / bare) or its ``engine``
    figure, at most or at least ``limit``."""

    on: Literal["ratio", "engine"]
    limit: float
    at_most: bool

    def met(self, row: GoalRow) -> bool | None:
        value = row.ratio if self.on == "ratio" else row.engine
        if value is None:
            return None
        return value <= self.limit if self.at_most else value >= self.limit

    def text(self) -> str:
        sign = "<=" if self.at_most else ">="
        unit = "x" if self.on == "ratio" else ""
        what = "ratio" if self.on == "ratio" else "engine"
        return f"{what} {sign} {self.limit:g}{unit}"


@dataclass(frozen=True)
class GoalRow:
    """One figure of issue 17's Goal. ``bare`` may be absent (a figure of the engine alone);
    ``dbos`` and ``start`` are quoted text (see the module's docstring)."""

    name: str
    unit: str
    engine: float | None
    bare: float | None
    goal: Goal | None = None
    dbos: str = ""
    start: str = ""

    @property
    def ratio(self) -> float | None:
        if self.engine is None or not self.bare:
            return None
        return self.engine / self.bare


def figure(value: float | None) -> str:
    """A figure as the tables print it: thousands grouped from 100, two decimals below."""
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def goal_cell(row: GoalRow) -> str:
    if row.goal is None:
        return ""
    met = row.goal.met(row)
    verdict = "not measured" if met is None else "met" if met else "MISSED"
    return f"{row.goal.text()}: {verdict}"


HEADER = (
    "figure",
    "engine",
    "bare Celery",
    "ratio",
    "goal",
    f"DBOS Transact 3.4 ({ISSUE})",
    "issue 17's starting figure",
)


def cells(row: GoalRow) -> tuple[str, ...]:
    ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
    bare = "" if row.bare is None and row.engine is not None else figure(row.bare)
    return (
        f"{row.name} ({row.unit})",
        figure(row.engine),
        bare,
        ratio,
        goal_cell(row),
        row.dbos,
        row.start,
    )


def format_goal_table(rows: Sequence[GoalRow], markdown: bool = False) -> str:
    """The rows under :data:`HEADER`, aligned for a terminal, or as a Markdown table."""
    lines = [HEADER, *(cells(row) for row in rows)]
    if markdown:
        out = ["| " + " | ".join(line) + " |" for line in lines]
        out.insert(1, "|" + "---|" * len(HEADER))
        return "\n".join(out)
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    text = [
        " | ".join(
            cell.ljust(widths[i]) if i in (0, 4, 5, 6) else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in lines
    ]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


# --- Issue 17's quoted figures -------------------------------------------------------------
# (DBOS's figure, the starting figure), as the issue's table and text give them.

SEQUENTIAL = (
    "1.94 ms vs 0.97 relay: 2.0x",
    "2.82 (quiet) to 5.61 (shared) vs 0.94 to 1.57: 3.0x to 3.6x",
)
LENGTH = ("", "a 1,000-step run: 1.9x to 2.7x the per-step cost of a 100-step run")
MANY_LONG = ("519 vs 1,221: 0.43x", "407 to 445 vs 874 to 1,252: 0.36x to 0.47x")
MANY_SHORT = ("", "395 to 491 vs 791 to 1,121: 0.44x to 0.50x")
FOREACH = ("", "51.9 vs 19.7: 2.6x")
BURST = ("", "143 to 151 vs 11.7: 12x")
# The issue gives no lateness figure; bench/README.md's timers section does (one sitting).
LATENESS = ("", f"4,022 ms vs 4.27 ({README}; 1,440 to 4,022 over three sittings)")
STARTS = ("", "145 vs 976: 0.15x")
# "with 1, 2 and 4 worker processes it ran 195, 395 and 381 steps/s (bare Celery: 615, 791,
# 969)": issue 17's text.
SCALE_OUT = {1: "195 vs 615: 0.32x", 2: "395 vs 791: 0.50x", 4: "381 vs 969: 0.39x"}
STATEMENTS = ("", "about 6 statements per step")
