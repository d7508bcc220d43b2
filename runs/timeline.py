"""The run inspector's timeline (a Gantt chart) of attempts: for each, the time it waited in
the queue (``scheduled_at`` → ``started_at``) and the time it ran (``started_at`` →
``finished_at``, or now while it runs), and before a retry the back-off since the previous
attempt of the same step instance ended (the next attempt's row is written when its back-off
timer fires, so its ``scheduled_at`` is the end of the back-off).

Pure Python, no Django: the page hands in the attempts it read, this module places them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

LABEL_W = 230  # the column of step names, left of the bars
CHART_W = 690
ROW_H = 20
AXIS_H = 24
# Room right of the axis for the last tick's label.
RIGHT_PAD = 40
# Nice tick spacings, in milliseconds: about six ticks whatever the run's length.
_STEPS_MS = [
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    15_000,
    30_000,
    60_000,
    120_000,
    300_000,
    600_000,
    900_000,
    1_800_000,
    3_600_000,
    7_200_000,
    21_600_000,
    43_200_000,
    86_400_000,
    172_800_000,
    604_800_000,
]


@dataclass(frozen=True)
class Attempt:
    """What the chart needs of one attempt."""

    id: int
    label: str
    # Identifies the step instance (run, path, step id): its attempts are retries of each other.
    instance: str
    attempt: int
    status: str
    scheduled_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # A step that waits in the engine (an approval, an event, a sleep): its time from start to
    # end was spent waiting, not running, and its bar says so whatever its status.
    waits: bool = False


@dataclass(frozen=True)
class Bar:
    x: float
    w: float
    title: str


@dataclass(frozen=True)
class Row:
    attempt: Attempt
    y: float
    backoff: Bar | None
    wait: Bar | None
    run: Bar | None


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Chart:
    rows: list[Row]
    ticks: list[Tick]
    width: float
    height: float
    start: datetime | None
    end: datetime | None
    # Attempts left out of the chart (the oldest ones) to keep the page bounded.
    omitted: int


def duration(ms: float) -> str:
    """A duration as people read it: 840 ms, 3.2 s, 4 min 05 s, 2 h 10 min, 3 d 4 h."""
    if ms < 1_000:
        return f"{ms:.0f} ms"
    seconds = ms / 1_000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def _ms(delta: timedelta) -> float:
    return delta.total_seconds() * 1_000


def chart(
    attempts: Sequence[Attempt], *, now: datetime, limit: int = 200, omitted: int = 0
) -> Chart:
    """Place ``attempts`` (in the order they were written) on one time axis, one row each.
    Only the ``limit`` most recent are drawn; ``omitted`` counts attempts the caller already
    left out, and the chart's own ``omitted`` adds those it drops."""
    dropped = max(len(attempts) - limit, 0)
    shown = list(attempts[dropped:])
    if not shown:
        return Chart([], [], LABEL_W + CHART_W + RIGHT_PAD, AXIS_H, None, None, omitted + dropped)
    ends: dict[str, datetime] = {}
    for attempt in attempts[:dropped]:
        if attempt.finished_at is not None:
            ends[attempt.instance] = attempt.finished_at
    start = min(a.scheduled_at for a in shown)
    # A back-off that began before the first shown attempt is drawn from the chart's start.
    end = max(max(a.finished_at or now for a in shown), start + timedelta(milliseconds=1))
    span = _ms(end - start)

    def x(moment: datetime) -> float:
        return LABEL_W + CHART_W * max(0.0, min(1.0, _ms(moment - start) / span))

    def bar(a: datetime, b: datetime, what: str) -> Bar:
        return Bar(x(a), max(x(b) - x(a), 1.0), f"{what} {duration(_ms(b - a))}")

    rows = []
    for index, attempt in enumerate(shown):
        backoff = wait = run = None
        previous_end = ends.get(attempt.instance)
        if previous_end is not None and attempt.attempt > 1 and attempt.scheduled_at > previous_end:
            backoff = bar(max(previous_end, start), attempt.scheduled_at, "back-off")
        begun = attempt.started_at
        if begun is not None:
            wait = bar(attempt.scheduled_at, begun, "queued")
            # An engine step (a wait, a sleep, an approval) is "started" when it begins to wait.
            run = bar(begun, attempt.finished_at or now, _doing(attempt))
        else:
            # Never started (still queued, or cancelled in the queue): all of it was waiting.
            wait = bar(attempt.scheduled_at, attempt.finished_at or now, "queued")
        if attempt.finished_at is not None:
            ends[attempt.instance] = attempt.finished_at
        rows.append(Row(attempt, AXIS_H + index * ROW_H, backoff, wait, run))
    return Chart(
        rows,
        _ticks(span),
        LABEL_W + CHART_W + RIGHT_PAD,
        AXIS_H + len(rows) * ROW_H + 4,
        start,
        end,
        omitted + dropped,
    )


def _doing(attempt: Attempt) -> str:
    if attempt.status == "waiting":
        return "waiting"
    # An approval's row has ended (succeeded) once someone decided: it waited, it never ran.
    return "waited" if attempt.waits else "ran"


def _ticks(span_ms: float) -> list[Tick]:
    step = next((s for s in _STEPS_MS if span_ms / s <= 7), _STEPS_MS[-1])
    ticks = []
    at = 0
    while at <= span_ms:
        ticks.append(Tick(LABEL_W + CHART_W * at / span_ms, "0" if at == 0 else f"+{duration(at)}"))
        at += step
    return ticks
