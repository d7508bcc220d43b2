"""The fire decision (schedules.clock.due), with the clock passed in: which slot a message
starts, what is missed, and what comes next. No database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schedules.clock import ONE, SKIP, due

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
GRACE = timedelta(seconds=60)
EARLY = timedelta(seconds=1)


def hourly(moment: datetime) -> datetime:
    """The next top of the hour after ``moment``, as a crontab "0 * * * *" gives it."""
    return moment.replace(minute=0, second=0, microsecond=0) + HOUR


def cron(now: datetime, next_run_at: datetime = T0, catch_up: str = ONE):
    return due(
        next_run_at=next_run_at,
        now=now,
        following=hourly,
        catch_up=catch_up,
        grace=GRACE,
        early=EARLY,
    )


def test_a_message_before_the_slot_starts_nothing():
    assert cron(T0 - timedelta(seconds=5)) is None


def test_a_message_a_moment_early_fires_the_slot():
    fire = cron(T0 - timedelta(milliseconds=300))
    assert fire is not None and fire.slot == T0 and fire.next_run_at == T0 + HOUR


def test_on_time_fires_the_slot_and_moves_to_the_next():
    fire = cron(T0 + timedelta(milliseconds=40))
    assert fire is not None
    assert (fire.slot, fire.missed, fire.next_run_at) == (T0, 0, T0 + HOUR)


def test_a_second_message_for_the_same_slot_finds_nothing_due():
    first = cron(T0 + timedelta(milliseconds=40))
    assert first is not None
    # The other beat's message, 300 ms later, reads the next_run_at the first one wrote.
    assert cron(T0 + timedelta(milliseconds=340), next_run_at=first.next_run_at) is None


@pytest.mark.parametrize("catch_up", [ONE, SKIP])
def test_late_within_grace_is_on_time_for_both(catch_up):
    fire = cron(T0 + timedelta(seconds=59), catch_up=catch_up)
    assert fire is not None and fire.slot == T0 and fire.missed == 0


def test_beat_down_for_hours_one_makes_one_start_for_the_latest_slot():
    # Beat was down from 9:50 to 13:20: the 10:00, 11:00, 12:00 and 13:00 slots passed.
    fire = cron(T0 + timedelta(hours=3, minutes=20), catch_up=ONE)
    assert fire is not None
    assert fire.slot == T0 + 3 * HOUR  # one start, for the latest
    assert fire.missed == 3  # 10:00, 11:00 and 12:00 start nothing of their own
    assert fire.next_run_at == T0 + 4 * HOUR
    assert fire.late == timedelta(minutes=20)


def test_beat_down_for_hours_skip_makes_no_start_and_waits_for_the_next_slot():
    fire = cron(T0 + timedelta(hours=3, minutes=20), catch_up=SKIP)
    assert fire is not None
    assert fire.slot is None
    assert fire.missed == 4
    assert fire.next_run_at == T0 + 4 * HOUR
    # ... where the next message fires on time.
    nxt = cron(T0 + 4 * HOUR + timedelta(milliseconds=5), next_run_at=fire.next_run_at)
    assert nxt is not None and nxt.slot == T0 + 4 * HOUR and nxt.missed == 0


def test_one_missed_slot_past_grace():
    late = T0 + timedelta(minutes=5)
    assert cron(late, catch_up=SKIP).slot is None
    assert cron(late, catch_up=ONE).slot == T0


def test_catch_up_must_be_known():
    with pytest.raises(ValueError, match="catch_up"):
        cron(T0, catch_up="all")


def interval(now, next_run_at, every=timedelta(seconds=90), catch_up=ONE):
    return due(
        next_run_at=next_run_at,
        now=now,
        following=lambda moment: moment + every,
        catch_up=catch_up,
        grace=GRACE,
        early=min(EARLY, every / 4),
        every=every,
    )


def test_an_interval_keeps_to_the_phase_of_its_beat():
    """Beat sends an interval's message ``every`` after its last one plus a few milliseconds
    of lag; a thousand fires later the slots still come on time (none missed), where slots
    fixed at creation would have fallen 8 s behind."""
    every = timedelta(seconds=90)
    next_run_at = T0
    sent = T0
    for _ in range(1000):
        arrives = sent + timedelta(milliseconds=3)
        fire = interval(arrives, next_run_at, every)
        assert fire is not None and fire.missed == 0 and fire.late < timedelta(seconds=2)
        next_run_at = fire.next_run_at
        # The other beat, 40 s out of phase, finds nothing due.
        assert interval(arrives + timedelta(seconds=40), next_run_at, every) is None
        sent = sent + every + timedelta(milliseconds=8)


def test_an_interval_after_beat_was_down():
    every = timedelta(seconds=90)
    back = T0 + timedelta(minutes=10, seconds=7)
    fire = interval(back, T0, every, catch_up=ONE)
    assert fire is not None
    assert fire.slot == T0 + 6 * every  # the latest slot at or before 10:10:07
    assert fire.missed == 6
    # The returning beat sends its next message `every` after this one.
    assert fire.next_run_at == back + every - min(EARLY, every / 4)
    skipped = interval(back, T0, every, catch_up=SKIP)
    assert skipped is not None and skipped.slot is None and skipped.missed == 7


def every_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0) + MINUTE


def test_a_cron_down_for_longer_than_the_walk_finds_its_latest_slot_from_now():
    """Beat down for 30 days on a cron every minute: 43,200 slots, more than a fire walks;
    the one start is still for the latest slot, and the schedule waits for the next."""
    now = T0 + timedelta(days=30, seconds=20)
    fire = due(
        next_run_at=T0,
        now=now,
        following=every_minute,
        catch_up=ONE,
        grace=GRACE,
        early=EARLY,
    )
    assert fire is not None
    assert fire.slot == T0 + timedelta(days=30)
    assert fire.next_run_at == T0 + timedelta(days=30, minutes=1)
    assert fire.missed >= 10_000
    # The next message, on time, starts the next slot only.
    nxt = due(
        next_run_at=fire.next_run_at,
        now=fire.next_run_at,
        following=every_minute,
        catch_up=ONE,
        grace=GRACE,
        early=EARLY,
    )
    assert nxt.slot == fire.next_run_at and nxt.missed == 0


def test_an_interval_down_for_a_year_is_arithmetic():
    every = timedelta(seconds=60)
    fire = interval(T0 + timedelta(days=365, seconds=30), T0, every)
    assert fire.slot == T0 + timedelta(days=365)
    assert fire.missed == 365 * 24 * 60
