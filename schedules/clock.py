"""When a schedule fires: a pure function of its state, its timing and the clock.

Beat (django-celery-beat's ``DatabaseScheduler``) sends ``schedules.fire`` when a schedule's
``PeriodicTask`` is due, and may send it more than once for one moment: two beats each send
theirs, a broker redelivers, a beat that restarts sends at once for a crontab whose
``last_run_at`` it last saved minutes ago. Which moment (a *slot*) a message starts is
therefore decided here, from the schedule's own ``next_run_at``, under the schedule row's lock
(``schedules.services.schedule_fire``), never from the message: a message that finds no slot
due starts nothing, so however many arrive, each slot starts at most one run.

A slot fired more than ``grace`` after its time was *missed* (beat was down, or every worker
was): with ``catch_up="one"`` the latest missed slot starts one run for all of them (like
APScheduler's ``coalesce`` and Airflow's ``catchup=False``, which also runs the latest
interval); with ``"skip"`` none does and the schedule goes on from its next slot. Slots
earlier than the latest due one never start a run of their own: a returning beat makes at
most one start.

No Django here (tests travel in time by passing ``now``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

SKIP = "skip"
ONE = "one"
CATCH_UP = (SKIP, ONE)

# Slots a fire walks at most (0.25 s of Celery's crontab arithmetic; a cron every minute:
# a week of beat being down). Past it the latest slot is found backwards from now, and the
# missed count says "at least".
MAX_WALK = 10_000


@dataclass(frozen=True)
class Due:
    """What one fire does: start a run for ``slot`` (``None``: start none, the slot was
    missed and ``catch_up`` is ``skip``), count ``missed`` slots that start nothing, and
    wait next for ``next_run_at``."""

    slot: datetime | None
    missed: int
    next_run_at: datetime
    late: timedelta


def due(
    *,
    next_run_at: datetime,
    now: datetime,
    following: Callable[[datetime], datetime],
    catch_up: str,
    grace: timedelta,
    early: timedelta,
    every: timedelta | None = None,
) -> Due | None:
    """The fire a message at ``now`` makes, or ``None`` when no slot is due (a second beat's
    message, a redelivery, an early one).

    ``following(slot)`` is the first slot after ``slot`` (a crontab's next matching minute,
    or ``slot + every``). A slot up to ``early`` in the future counts as due: beat's and the
    worker's clocks differ a little, and a message that came a moment early must not wait a
    whole period.

    An interval schedule (``every``) keeps to the phase of the beat that sends it, as Celery's
    own interval schedules count from ``last_run_at``: its next slot is ``every`` after this
    message (less ``early``), unless that is before the grid's. A slot fixed once at creation
    would fall behind beat by its few milliseconds of lag a fire, and after enough of them
    every fire would come later than ``grace``: missed. ``early`` must be under a quarter of
    ``every``: two beats' messages then never both find a slot of their own in one period.
    """
    if catch_up not in CATCH_UP:
        raise ValueError(f"catch_up must be one of {CATCH_UP}, not {catch_up!r}")
    horizon = now + early
    if next_run_at > horizon:
        return None
    if every is not None:
        # An interval's slots are a grid: no walk however long beat was down.
        earlier = int((horizon - next_run_at) / every)
        latest = next_run_at + earlier * every
    else:
        latest, earlier = _latest(next_run_at, horizon, following)
    late = max(now - latest, timedelta(0))
    upcoming = following(latest) if every is None else max(latest + every, now + every - early)
    if late <= grace or catch_up == ONE:
        return Due(slot=latest, missed=earlier, next_run_at=upcoming, late=late)
    return Due(slot=None, missed=earlier + 1, next_run_at=upcoming, late=late)


def _latest(
    first: datetime, horizon: datetime, following: Callable[[datetime], datetime]
) -> tuple[datetime, int]:
    """The last slot at or before ``horizon`` from ``first`` (itself one), and how many due
    slots came before it (at least that many, past ``MAX_WALK``)."""
    slot, earlier = first, 0
    while earlier < MAX_WALK:
        after = following(slot)
        if after > horizon:
            return slot, earlier
        slot, earlier = after, earlier + 1
    # Too many to count: look back from the horizon, twice as far each time, for a slot.
    back = timedelta(minutes=1)
    while (candidate := following(horizon - back)) > horizon:
        back *= 2
    slot = max(slot, candidate)
    while (after := following(slot)) <= horizon:
        slot = after
    return slot, earlier
