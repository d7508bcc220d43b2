"""The inspector's timeline (runs.timeline): queue wait and run time of every attempt on one
axis, the back-off before a retry, bounded to the most recent attempts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runs import timeline
from runs.timeline import CHART_W, LABEL_W

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def attempt(
    n: int, scheduled: int, started: int | None, finished: int | None, **kw: object
) -> timeline.Attempt:
    values: dict[str, object] = {
        "id": n,
        "label": "send",
        "instance": "|send",
        "attempt": n,
        "status": "failed",
        "scheduled_at": at(scheduled),
        "started_at": at(started) if started is not None else None,
        "finished_at": at(finished) if finished is not None else None,
    }
    values.update(kw)
    return timeline.Attempt(**values)  # type: ignore[arg-type]


def test_queue_wait_run_time_and_back_off_are_distinguished() -> None:
    attempts = [
        attempt(1, 0, 100, 300),
        # Back-off 300 → 800, queued 800 → 1000, ran 1000 → 2000.
        attempt(2, 800, 1000, 2000, status="succeeded"),
    ]
    chart = timeline.chart(attempts, now=at(5000))
    first, second = chart.rows
    px = CHART_W / 2000
    assert first.backoff is None
    assert first.wait is not None and first.run is not None
    assert (first.wait.x, first.wait.w) == (LABEL_W, 100 * px)
    assert (first.run.x, first.run.w) == (LABEL_W + 100 * px, 200 * px)
    assert second.backoff is not None and second.wait is not None and second.run is not None
    assert (second.backoff.x, second.backoff.w) == (LABEL_W + 300 * px, 500 * px)
    assert second.wait.x == LABEL_W + 800 * px and second.run.x == LABEL_W + 1000 * px
    assert second.run.x + second.run.w == LABEL_W + CHART_W
    assert second.backoff.title == "back-off 500 ms" and second.run.title == "ran 1.0 s"
    assert second.y > first.y


def test_a_running_attempt_runs_until_now_and_a_queued_one_only_waits() -> None:
    chart = timeline.chart(
        [
            attempt(1, 0, 1000, None, status="running", instance="a"),
            attempt(1, 500, None, None, status="scheduled", instance="b"),
        ],
        now=at(4000),
    )
    running, queued = chart.rows
    assert running.run is not None and running.run.x + running.run.w == LABEL_W + CHART_W
    assert queued.run is None and queued.wait is not None
    assert queued.wait.x + queued.wait.w == LABEL_W + CHART_W
    assert chart.end == at(4000)


def test_the_chart_is_bounded_and_says_how_many_it_left_out() -> None:
    many = [attempt(1, i * 10, i * 10 + 1, i * 10 + 5, instance=str(i)) for i in range(1000)]
    chart = timeline.chart(many, now=at(20_000), limit=200, omitted=50)
    assert len(chart.rows) == 200
    assert chart.omitted == 850
    assert chart.rows[0].attempt.instance == "800"
    assert chart.height == timeline.AXIS_H + 200 * timeline.ROW_H + 4


def test_a_retry_whose_previous_attempt_was_cut_still_shows_its_back_off() -> None:
    chart = timeline.chart([attempt(1, 0, 10, 20), attempt(2, 500, 510, 520)], now=at(600), limit=1)
    [row] = chart.rows
    # The back-off began before the chart does: drawn from its start.
    assert row.backoff is not None and row.backoff.x == LABEL_W


def test_ticks_are_round_and_durations_read_well() -> None:
    chart = timeline.chart([attempt(1, 0, 0, 65_000)], now=at(70_000))
    labels = [tick.label for tick in chart.ticks]
    assert labels[0] == "0" and labels[1] == "+10.0 s" and len(labels) <= 8
    assert timeline.duration(840) == "840 ms"
    assert timeline.duration(3_200) == "3.2 s"
    assert timeline.duration(245_000) == "4 min 05 s"
    assert timeline.duration(7_800_000) == "2 h 10 min"
    assert timeline.duration(3 * 86_400_000 + 4 * 3_600_000) == "3 d 4 h"


def test_no_attempts_is_an_empty_chart() -> None:
    chart = timeline.chart([], now=T0)
    assert chart.rows == [] and chart.start is None


def test_an_approval_waited_it_never_ran() -> None:
    """Issue 37: an approval decided after a minute was drawn "ran 1 min 00 s"."""
    chart = timeline.chart(
        [
            attempt(1, 0, 0, 60_000, status="succeeded", instance="a", waits=True),
            attempt(1, 0, 0, None, status="waiting", instance="b", waits=True),
            attempt(1, 0, 10, 500, status="succeeded", instance="c"),
        ],
        now=at(60_000),
    )
    decided, open_, task = (row.run for row in chart.rows)
    assert decided is not None and decided.title == "waited 1 min 00 s"
    assert open_ is not None and open_.title.startswith("waiting")
    assert task is not None and task.title == "ran 490 ms"
