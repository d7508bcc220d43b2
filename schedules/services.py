"""Writes for schedules: create, change, delete, and the fire beat asks for.

Who may do what (CONTRACT section 8, ``workflows.access``): a schedule of a workflow is
created only by a starter of it, and its runs are started as that user, its *owner*, who must
still be a starter at each fire (a fire they may no longer make fails, recorded on the
schedule and logged). A schedule is read by its owner and the workflow's viewers (not by
another starter, who reads only their own runs), and changed or deleted by its owner or an
operator of the workflow; a caller who may not see it gets 404.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.schedules import crontab
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
from django_celery_beat.validators import crontab_validator

from runs import metrics as run_metrics
from runs import services as run_services
from runs import vault
from workflows import access, secrets
from workflows import selectors as workflow_selectors
from workflows.errors import EngineError, FieldError, Forbidden, InvalidInput, echo
from workflows.inputs import input_errors
from workflows.models import Workflow

from . import clock, selectors
from .models import Schedule

logger = logging.getLogger(__name__)

# The sweep's failures, as counted (runs.metrics.pass_failed).
SWEEP = "schedules.sweep"

TASK = "schedules.fire"
# Beat's clock queue (CELERY_TASK_QUEUES): a fire must not wait behind a backlog of steps.
QUEUE = "timers"
CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
# The longest interval: a year (a schedule rarer than that is a cron's job).
MAX_EVERY_MS = 366 * 24 * 3600 * 1000
# How early a message may come for its slot (clocks of beat and worker hosts differ a
# little); an interval's is at most a quarter of it (schedules.clock.due says why).
EARLY = timedelta(seconds=1)


# --- create, change, delete ------------------------------------------------------------------


@transaction.atomic
def schedule_create(
    *,
    workflow: str,
    input: Any = None,
    version: int | None = None,
    cron: str | None = None,
    every_ms: int | None = None,
    enabled: bool = True,
    catch_up: str | None = None,
    user: AbstractBaseUser | None = None,
) -> Schedule:
    """A schedule of ``workflow`` with a fixed ``input``: on ``cron`` (five fields, minute
    first, in ``CELERY_TIMEZONE``) or every ``every_ms`` milliseconds, exactly one of them.

    ``user`` must be a starter of the workflow (404 when they may not see it, 403 when they
    may only see it) and becomes the owner. Bad values are a 400 naming each field: the cron
    syntax, ``every_ms`` outside [``DJFLOW_SCHEDULE_MIN_INTERVAL_MS``, a year], an input the
    version's ``input_schema`` refuses (the latest version's when none is pinned), a
    user who already owns ``DJFLOW_SCHEDULES_PER_WORKFLOW`` schedules of the workflow.

    The cap is per owner, not per workflow: counted over the workflow, any starter (the
    global ``runs.add_run`` makes one of every workflow) could take every slot, and its
    authors and other starters could then make none (issue 36). Each user's schedules start
    runs as that user, who answers for them; the work a schedule makes is bounded by
    ``DJFLOW_SCHEDULE_MIN_INTERVAL_MS``.
    """
    access.require_start(user, workflow)
    person = user if user is not None and user.is_authenticated else None
    if person is None:
        # Its runs are started as its owner, checked at each fire: an ownerless schedule is
        # one whose owner was deleted, and never fires.
        raise Forbidden(errors=[FieldError(None, "a schedule is made by a signed-in user")])
    pinned = workflow_selectors.version_get(workflow_id=workflow, number=version)
    errors = _timing_errors(cron, every_ms)
    if catch_up is not None and catch_up not in clock.CATCH_UP:
        errors.append(FieldError("catch_up", f"must be one of {', '.join(clock.CATCH_UP)}"))
    errors += input_errors(pinned, input)
    limit = int(settings.DJFLOW["SCHEDULES_PER_WORKFLOW"])
    # Counted under the workflow's row lock: two creates at once cannot both pass the limit.
    Workflow.objects.select_for_update().filter(pk=workflow).first()
    if Schedule.objects.filter(workflow_id=workflow, owner_id=person.pk).count() >= limit:
        errors.append(
            FieldError(
                "workflow",
                f"you have {limit} schedules of workflow '{workflow}', the most one user may "
                "have (DJFLOW_SCHEDULES_PER_WORKFLOW): delete one first",
            )
        )
    if errors:
        raise InvalidInput(errors=errors)
    now = timezone.now()
    stored_input, registry = vault.seal_input(pinned.document.get("input_schema"), input)
    # As run_start does: this context's logs and error reports (which carry the request's
    # body) mask the secrets it received.
    secrets.expose(secrets.plaintexts(registry))
    task = PeriodicTask(
        # Renamed with the schedule's id below; unique meanwhile.
        name=f"djflow schedule {uuid.uuid4().hex}",
        task=TASK,
        queue=QUEUE,
        enabled=bool(enabled),
        # Beat counts the first period from now, as next_run_at does.
        last_run_at=now,
        description=f"Starts a run of workflow '{workflow}' (djflow schedule).",
    )
    if cron is not None:
        task.crontab = _crontab(cron)
    else:
        assert every_ms is not None
        task.interval = _interval(every_ms)
    task.save()
    schedule = Schedule.objects.create(
        workflow_id=workflow,
        version=version,
        input=stored_input,
        secrets=vault.encrypt(registry),
        owner=person,  # type: ignore[misc]  # the configured user model
        task=task,
        catch_up=catch_up,
        timing=timing_of(task),
        next_run_at=_following(task)(now),
        created_at=now,
    )
    task.name = f"djflow schedule {schedule.pk}: {workflow}"
    task.kwargs = json.dumps({"schedule_id": schedule.pk})
    task.save(update_fields=["name", "kwargs"])
    return schedule


@transaction.atomic
def schedule_change(
    *,
    schedule_id: Any,
    user: AbstractBaseUser | None = None,
    enabled: bool | None = None,
    catch_up: str | None = None,
) -> Schedule:
    """Turn a schedule on or off, or change what it does with missed slots. Turned back on,
    it waits for its next slot from now: the slots it was off for are not missed ones."""
    schedule = _locked(schedule_id, user)
    if catch_up is not None:
        if catch_up not in clock.CATCH_UP:
            raise InvalidInput(
                errors=[FieldError("catch_up", f"must be one of {', '.join(clock.CATCH_UP)}")]
            )
        schedule.catch_up = catch_up
    if enabled is not None and bool(enabled) != schedule.task.enabled:
        task = schedule.task
        task.enabled = bool(enabled)
        if enabled:
            now = timezone.now()
            task.last_run_at = now
            schedule.next_run_at = _following(task)(now)
        task.save(update_fields=["enabled", "last_run_at"])
    schedule.save()
    return schedule


@transaction.atomic
def schedule_delete(*, schedule_id: Any, user: AbstractBaseUser | None = None) -> None:
    """Delete the schedule and its periodic task (beat drops it at its next check). Runs it
    started are kept. A fire already on its way finds no schedule and starts nothing."""
    schedule = _locked(schedule_id, user)
    # The schedule goes with its task (on_delete CASCADE); deleting the task through the
    # model tells beat (django-celery-beat's signals mark the schedule changed).
    schedule.task.delete()


def _locked(schedule_id: Any, user: AbstractBaseUser | None) -> Schedule:
    """The schedule, locked, once ``user`` may change it: 404 when they may not see it, 403
    when they may see it but neither own it nor operate its workflow."""
    schedule = selectors.schedule_row(schedule_id, Schedule.objects.select_for_update(of=("self",)))
    selectors.require_view(user, schedule)
    if not may_change(user, schedule):
        raise Forbidden(
            errors=[
                FieldError(
                    "id",
                    f"schedule {schedule.pk} is not yours: only its owner or an operator of "
                    f"workflow '{schedule.workflow_id}' may change or delete it",
                )
            ]
        )
    return schedule


def may_change(user: Any, schedule: Schedule) -> bool:
    if access.trusted(user):
        return True
    own = schedule.owner_id is not None and getattr(user, "pk", None) == schedule.owner_id
    return own or access.OPERATOR in access.roles(user, schedule.workflow_id)


# --- timing ----------------------------------------------------------------------------------


def _timing_errors(cron: Any, every_ms: Any) -> list[FieldError]:
    if (cron is None) == (every_ms is None):
        return [FieldError("cron", "give exactly one of cron and every_ms")]
    if cron is not None:
        return [FieldError("cron", problem) for problem in cron_problems(cron)]
    minimum = int(settings.DJFLOW["SCHEDULE_MIN_INTERVAL_MS"])
    if isinstance(every_ms, bool) or not isinstance(every_ms, int):
        return [FieldError("every_ms", "must be a whole number of milliseconds")]
    if not minimum <= every_ms <= MAX_EVERY_MS:
        return [
            FieldError(
                "every_ms",
                f"must be from {minimum} (DJFLOW_SCHEDULE_MIN_INTERVAL_MS) to {MAX_EVERY_MS} "
                f"(a year), not {every_ms}",
            )
        ]
    if every_ms % 1000 and every_ms * 1000 > MAX_MICROSECONDS:
        return [
            FieldError(
                "every_ms",
                f"over {MAX_MICROSECONDS // 1000} ms must be whole seconds (a multiple of "
                f"1000), not {every_ms}",
            )
        ]
    return []


def cron_problems(cron: Any) -> list[str]:
    """What is wrong with a cron expression: five fields (minute, hour, day of month, month,
    day of week), each as django-celery-beat's admin checks it."""
    if not isinstance(cron, str):
        return ["must be a string of five fields: minute hour day-of-month month day-of-week"]
    fields = cron.split()
    if len(fields) != len(CRON_FIELDS):
        return [
            f"'{echo(cron)}' has {len(fields)} fields, not 5 (minute hour day-of-month month "
            "day-of-week)"
        ]
    try:
        crontab_validator(" ".join(fields))
        # Celery's own check of the whole: a day that never comes (the 31st of February).
        crontab(**dict(zip(CRON_FIELDS, fields, strict=True)))
    except Exception as error:  # Django's ValidationError or the parser's ValueError
        messages = getattr(error, "messages", None) or [str(error)]
        return [f"'{echo(cron)}' is not a cron expression: {'; '.join(map(str, messages))}"]
    return []


def _crontab(cron: str) -> CrontabSchedule:
    spec = dict(zip(CRON_FIELDS, cron.split(), strict=True))
    tz = settings.CELERY_TIMEZONE
    found = CrontabSchedule.objects.filter(**spec, timezone=tz).order_by("id").first()
    return found or CrontabSchedule.objects.create(**spec, timezone=tz)


# IntervalSchedule's periods, longest first, in milliseconds (a period's "every" is a 32-bit
# integer: microseconds hold at most 35 minutes).
PERIODS = (
    (IntervalSchedule.DAYS, 86_400_000),
    (IntervalSchedule.HOURS, 3_600_000),
    (IntervalSchedule.MINUTES, 60_000),
    (IntervalSchedule.SECONDS, 1000),
)
MAX_MICROSECONDS = 2**31 - 1


def _interval(every_ms: int) -> IntervalSchedule:
    """The interval as the admin shows it best: in the longest period that divides it."""
    every, period = every_ms * 1000, IntervalSchedule.MICROSECONDS
    for name, length in PERIODS:
        if every_ms % length == 0:
            every, period = every_ms // length, name
            break
    found = IntervalSchedule.objects.filter(every=every, period=period).order_by("id").first()
    return found or IntervalSchedule.objects.create(every=every, period=period)


def every_of(task: PeriodicTask) -> timedelta | None:
    if task.interval is None:
        return None
    return timedelta(seconds=task.interval.schedule.run_every.total_seconds())


def timing_of(task: PeriodicTask) -> str:
    cron = cron_of(task)
    if cron is not None:
        return f"cron:{cron} {task.crontab.timezone if task.crontab else ''}"
    every = every_of(task)
    return f"every:{round(every.total_seconds() * 1000)}" if every is not None else ""


def cron_of(task: PeriodicTask) -> str | None:
    tab = task.crontab
    if tab is None:
        return None
    return " ".join(str(getattr(tab, field)) for field in CRON_FIELDS)


def _following(task: PeriodicTask) -> Callable[[datetime], datetime]:
    """The first slot after a moment, as beat computes it for the task's schedule."""
    every = every_of(task)
    if every is not None:
        return lambda moment: moment + every
    if task.crontab is None:
        raise ValueError(f"periodic task {task.pk} has neither a crontab nor an interval")
    crontab = task.crontab.schedule

    def following(moment: datetime) -> datetime:
        start, delta, _ = crontab.remaining_delta(moment)
        return start + delta  # type: ignore[no-any-return]

    return following


# --- the fire --------------------------------------------------------------------------------


def schedule_fire(*, schedule_id: Any, now: datetime | None = None) -> clock.Due | None:
    """What beat's ``schedules.fire`` message does: under the schedule's row lock, decide
    which slot is due (``schedules.clock.due``), start its run, and move ``next_run_at`` on,
    in one transaction. A message that finds no slot due (the other beat's, a redelivered one)
    changes nothing: each slot starts at most one run. The run's idempotency key is the
    schedule's id and the slot, in the owner's scope: should the row's state ever be set back
    (a restore), the same slot still finds its run instead of starting another.

    A start that is refused (the owner may no longer start the workflow, was deleted or
    deactivated; the input no longer fits the latest version; no worker serves a handler) is
    recorded on the schedule (``failures``, ``last_error``) and logged; the schedule goes on
    to its next slot."""
    now = now or timezone.now()
    with transaction.atomic():
        rows = Schedule.objects.select_for_update(of=("self",)).select_related(
            "task", "task__crontab", "task__interval", "owner"
        )
        schedule = rows.filter(pk=schedule_id).first()
        if schedule is None or not schedule.task.enabled:
            return None
        every = every_of(schedule.task)
        early = EARLY if every is None else min(EARLY, every / 4)
        timing = timing_of(schedule.task)
        if timing != schedule.timing:
            # Edited on beat's "Periodic tasks" page since the last fire: the slots come from
            # the new timing, from now (a cron's slot of this minute is due: its message came).
            logger.info(
                "schedule %s (%s): timing changed from %s to %s",
                schedule.pk,
                schedule.workflow_id,
                schedule.timing,
                timing,
            )
            schedule.timing = timing
            schedule.next_run_at = _following(schedule.task)(now - early)
        decision = clock.due(
            next_run_at=schedule.next_run_at,
            now=now,
            following=_following(schedule.task),
            catch_up=catch_up_of(schedule),
            grace=timedelta(seconds=float(settings.DJFLOW["SCHEDULE_GRACE_SECONDS"])),
            early=early,
            every=every,
        )
        if decision is None:
            schedule.save(update_fields=["timing", "next_run_at"])
            return None
        schedule.next_run_at = decision.next_run_at
        if decision.missed:
            schedule.missed += decision.missed
            logger.warning(
                "schedule %s (%s): %d slot(s) missed (beat or the workers were down); "
                "catch_up=%s: %s",
                schedule.pk,
                schedule.workflow_id,
                decision.missed,
                catch_up_of(schedule),
                "none started" if decision.slot is None else f"one start for {decision.slot}",
            )
        if decision.slot is not None:
            _start(schedule, decision.slot, now)
        schedule.save()
        return decision


def schedules_sweep(*, now: datetime | None = None) -> int:
    """Fire the enabled schedules whose slot is more than ``LOST_MESSAGE_SECONDS`` overdue
    (at most ``RECONCILE_BATCH``, the most overdue first), each in its own transaction as
    beat's message would: their message was lost. Returns how many started a run or
    recorded a miss or a failure."""
    now = now or timezone.now()
    overdue = now - timedelta(seconds=float(settings.DJFLOW["LOST_MESSAGE_SECONDS"]))
    ids = list(
        Schedule.objects.filter(task__enabled=True, next_run_at__lt=overdue)
        .order_by("next_run_at")
        .values_list("pk", flat=True)[: int(settings.DJFLOW["RECONCILE_BATCH"])]
    )
    fired = sum(_sweep_one(schedule_id, now) for schedule_id in ids)
    if fired:
        logger.warning("schedules: fired %d schedule(s) whose message was lost", fired)
    return fired


def _sweep_one(schedule_id: Any, now: datetime) -> int:
    """One schedule of the sweep, on its own: should firing it raise (anything but the
    refusals ``schedule_fire`` records itself), the failure is logged, counted
    (``djflow_pass_failures_total{pass="schedules.sweep"}``) and recorded on the schedule, and
    the sweep goes on with the others."""
    try:
        # A savepoint where the caller holds a transaction; schedule_fire's own otherwise.
        with transaction.atomic():
            return int(schedule_fire(schedule_id=schedule_id, now=now) is not None)
    except Exception as error:
        logger.exception("schedules: firing schedule %s failed; the sweep goes on", schedule_id)
        run_metrics.pass_failed(SWEEP)
        # A database that refuses this too (the connection lost) is in the log already.
        with contextlib.suppress(DatabaseError):
            Schedule.objects.filter(pk=schedule_id).update(
                failures=F("failures") + 1,
                last_error=f"the sweep: {type(error).__name__}: {error}"[:2000],
                last_error_at=now,
            )
        return 0


def catch_up_of(schedule: Schedule) -> str:
    return schedule.catch_up or str(settings.DJFLOW["SCHEDULE_CATCH_UP"])


def slot_key(schedule: Schedule, slot: datetime) -> str:
    """The run's idempotency key for one slot of a schedule (in UTC, to the microsecond)."""
    return f"schedule:{schedule.pk}:{slot.astimezone(UTC).isoformat()}"


def _start(schedule: Schedule, slot: datetime, now: datetime) -> None:
    try:
        # A savepoint: a refused start leaves the schedule's own row to be written.
        with transaction.atomic():
            owner = schedule.owner
            if owner is None:
                raise Forbidden(errors=[FieldError("owner", "the schedule's owner was deleted")])
            if not access.trusted(owner) and not getattr(owner, "is_active", False):
                raise Forbidden(errors=[FieldError("owner", f"user '{owner}' is inactive")])
            access.require_start(owner, schedule.workflow_id)
            plain = _plain_input(schedule)
            result = run_services.run_start(
                workflow=schedule.workflow_id,
                input=plain,
                version=schedule.version,
                idempotency_key=slot_key(schedule, slot),
                correlation=f"schedule:{schedule.pk}",
                user=owner,
                # One insert here; a worker plans the first step (the clock queue stays quick).
                plan_now=False,
            )
    except (EngineError, vault.SecretsUnreadable) as error:
        schedule.failures += 1
        schedule.last_error = f"{slot.isoformat()}: {error}"
        schedule.last_error_at = now
        logger.warning(
            "schedule %s (%s): the start for %s failed: %s",
            schedule.pk,
            schedule.workflow_id,
            slot.isoformat(),
            error,
        )
        return
    schedule.last_slot_at = slot
    schedule.last_run = result.run
    if result.created:
        schedule.starts += 1
        logger.info(
            "schedule %s (%s): started run %s for %s",
            schedule.pk,
            schedule.workflow_id,
            result.run.id,
            slot.isoformat(),
        )


def _plain_input(schedule: Schedule) -> Any:
    registry = vault.decrypt(schedule.secrets, run_id=f"of schedule {schedule.pk}")
    if not registry:
        return schedule.input
    return secrets.reveal(schedule.input, registry)


def shown_input(schedule: Schedule) -> Any:
    """The input as the API and the admin show it: secrets as ••••."""
    return secrets.shown(schedule.input) if schedule.secrets else schedule.input
