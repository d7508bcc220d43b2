"""Cancel or retry many runs by the list's filters (CONTRACT section 13): ``POST
/runs/cancel``, ``POST /runs/retry``, ``manage.py cancel|retry``.

The request counts the runs matched that the caller may operate (``affected``) and writes one
:class:`~runs.models.BulkAction`; workers do the rest a batch at a time, each batch one
transaction (at most ``BULK_BATCH`` runs), each run through the same service a single action
uses (``run_cancel``, ``run_retry``), which checks again, under the run's lock, that the caller
may operate it, and records who did it and when on the run (with the bulk action's id).

Which runs: those ``selectors.run_list`` gives for the filters (the list's own code), that
the caller may operate, in a status the action applies to (cancel: a run not ended; retry: a
failed top-level run, whose failed subworkflows are retried with it), created before the
request: a run started after it is never touched. A run that ended, or was retried, before
its batch came is passed over (``skipped``).

Durable like the engine: the batch message carries ids only and may arrive twice or never.
A batch runs under the action's row lock and only if its number is the next one, so a
second delivery does nothing; an action whose next message was lost is offered again by the
reconciler (``reoffer_idle``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from workflows import access
from workflows.errors import EngineError, FieldError, InvalidInput, NotFound, echo

from . import selectors, services
from .engine import isolation
from .models import BulkAction, Run
from .status import RUN_MOVES, RunStatus

logger = logging.getLogger(__name__)

# A run a batch failed on, as counted and marked (runs.engine.isolation).
BULK = "bulk_action"

TASK = "runs.bulk_action"
CANCEL = BulkAction.Action.CANCEL
RETRY = BulkAction.Action.RETRY

# The list's filters (selectors.run_list's keywords) a bulk action takes.
FILTERS = selectors.RUN_LIST_FILTERS
_WHEN = ("created_after", "created_before")

# The statuses each action applies to: cancel, every status with a move to cancelled (a run
# not ended); retry, a failed run (a plain retry, from its failed step).
APPLIES_TO: dict[str, tuple[str, ...]] = {
    CANCEL: tuple(s for s in RunStatus if RunStatus.CANCELLED in RUN_MOVES[s]),
    RETRY: (RunStatus.FAILED,),
}


@dataclass(frozen=True)
class BulkStart:
    affected: int
    action: BulkAction | None  # None: a dry run, or nothing matched


def bulk_action_start(
    *,
    action: str,
    user: AbstractBaseUser | None,
    dry_run: bool = False,
    send: bool = True,
    **filters: Any,
) -> BulkStart:
    """Count the runs ``action`` would affect and, unless ``dry_run`` (or there are none),
    hand them to workers (``send``; otherwise the caller runs the batches, and the reconciler
    hands them to workers should it stop). At least one filter is required: a request that
    names none is a 400, never "every run". A ``status`` the action does not apply to is a
    400 naming it."""
    given = {name: value for name, value in filters.items() if value is not None}
    unknown = sorted(set(given) - set(FILTERS))
    if unknown:
        raise InvalidInput(errors=[FieldError(name, "is not a filter") for name in unknown])
    if not given:
        raise InvalidInput(
            errors=[
                FieldError(
                    "filters",
                    f"name at least one filter ({', '.join(FILTERS)}): a bulk {action} of "
                    "every run is refused",
                )
            ]
        )
    status = given.get("status")
    if status is not None and status not in APPLIES_TO[action]:
        raise InvalidInput(
            errors=[
                FieldError(
                    "status",
                    f"a {status} run cannot be {_done(action)}; {action} takes "
                    f"{', '.join(APPLIES_TO[action])}",
                )
            ]
        )
    now = timezone.now()
    affected = bulk_matches(action=action, filters=given, user=user, before=now).count()
    if dry_run or affected == 0:
        return BulkStart(affected, None)
    person = user if user is not None and user.is_authenticated else None
    with transaction.atomic():
        bulk = BulkAction.objects.create(
            action=action,
            filters={k: v.isoformat() if isinstance(v, datetime) else v for k, v in given.items()},
            requested_by=person,
            requested_by_name=person.get_username() if person is not None else "",
            requested_at=now,
            affected=affected,
            updated_at=now,
        )
        if send:
            send_on_commit(bulk.id, 0)
    return BulkStart(affected, bulk)


def _done(action: str) -> str:
    return "cancelled" if action == CANCEL else "retried"


def bulk_matches(
    *, action: str, filters: Mapping[str, Any], user: Any, before: datetime
) -> QuerySet[Run]:
    """The runs ``action`` applies to: the list's runs for ``filters`` (``selectors.run_list``,
    newest first), narrowed to those ``user`` may operate, in a status the action takes,
    created at or before ``before``."""
    parsed = {
        name: parse_datetime(value) if name in _WHEN and isinstance(value, str) else value
        for name, value in filters.items()
    }
    runs = selectors.run_list(**parsed, user=user)
    operable = access.run_operate_filter(user)
    if operable is not None:
        runs = runs.filter(operable)
    runs = runs.filter(status__in=APPLIES_TO[action], created_at__lte=before)
    if action == RETRY:
        # A failed child is retried by its parent's retry (it reruns the failed subworkflow
        # step); retried on its own as well, it would run twice.
        runs = runs.filter(parent_run__isnull=True)
    return runs


def send_on_commit(bulk_id: Any, batch: int) -> None:
    # robust: a broker outage must not undo the committed batch; the reconciler offers an
    # action that stays quiet again (reoffer_idle).
    transaction.on_commit(lambda: send(bulk_id, batch), robust=True)


def send(bulk_id: Any, batch: int) -> None:
    current_app.signature(TASK, (str(bulk_id), batch), ignore_result=True).apply_async()


_SERVICES: dict[str, Callable[..., Any]] = {
    CANCEL: services.run_cancel,
    RETRY: services.run_retry,
}


def bulk_action_batch(*, bulk_id: Any, batch: int, send_next: bool = True) -> bool:
    """Do batch number ``batch`` of the action, in one transaction: at most ``BULK_BATCH``
    runs, newest first from where the last batch stopped; answers whether another batch is
    to come (and, with ``send_next``, has been sent to a worker). A batch that is not the
    next one (done already: a message delivered twice) does nothing and answers False."""
    with transaction.atomic():
        bulk = BulkAction.objects.select_for_update().filter(id=bulk_id).first()
        if bulk is None or bulk.finished_at is not None or bulk.batches != batch:
            return False
        now = timezone.now()
        user = bulk.requested_by
        if user is None and bulk.requested_by_name:
            # Its requester was deleted since: no one is left to act for (None would be
            # trusted code, which may do anything).
            bulk.finished_at = now
            bulk.updated_at = now
            bulk.save(update_fields=["finished_at", "updated_at"])
            logger.warning("bulk %s: its requester was deleted; nothing more is done", bulk.id)
            return False
        size = max(1, int(settings.DJFLOW["BULK_BATCH"]))
        runs = bulk_matches(
            action=bulk.action, filters=bulk.filters, user=user, before=bulk.requested_at
        )
        if bulk.cursor_created_at is not None:
            runs = runs.filter(
                Q(created_at__lt=bulk.cursor_created_at)
                | Q(created_at=bulk.cursor_created_at, id__lt=bulk.cursor_id)
            )
        rows = list(runs.values_list("id", "created_at")[:size])
        service = _SERVICES[bulk.action]
        audit = {"bulk": str(bulk.id)}
        for run_id, _ in rows:
            try:
                # The single action's own service and checks. It is atomic: a savepoint here,
                # so one that is refused leaves the batch's others done.
                service(run_id=run_id, user=user, audit=audit)
            except EngineError as refused:
                # Ended, retried or no longer the caller's to operate since it was counted.
                logger.info("bulk %s: run %s passed over: %s", bulk.id, run_id, refused)
                bulk.skipped += 1
            except Exception as error:
                # A run the service fails on (its journal unreadable, say): its savepoint is
                # rolled back, the failure logged, counted and marked on it, and the batch
                # goes on; raised, it rolled the whole batch back, and the reconciler's
                # re-offer ran it into the same run again forever (runs.engine.isolation).
                isolation.record_failure(BULK, run_id, error)
                bulk.skipped += 1
            else:
                bulk.done += 1
        bulk.batches += 1
        bulk.updated_at = now
        if rows:
            bulk.cursor_id, bulk.cursor_created_at = rows[-1]
        more = len(rows) == size
        if more and send_next:
            send_on_commit(bulk.id, bulk.batches)
        elif not more:
            bulk.finished_at = now
            # Counted but not acted on: a run that ended, was retried or stopped being the
            # caller's to operate before its batch came is no longer even matched.
            bulk.skipped = max(bulk.skipped, bulk.affected - bulk.done)
        bulk.save()
        return more


def reoffer_idle(now: datetime, batch: int) -> int:
    """Offer again the next batch of each unfinished action that has not moved for
    ``LOST_MESSAGE_SECONDS`` (its message lost). A duplicate offer does nothing: the batch
    number decides."""
    quiet = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    idle = BulkAction.objects.filter(finished_at__isnull=True, updated_at__lte=quiet).values_list(
        "id", "batches", "updated_at"
    )[:batch]
    offered = 0
    for bulk_id, batches, updated_at in list(idle):
        # The claim: only one reconciler moves updated_at from the value it read.
        if BulkAction.objects.filter(id=bulk_id, updated_at=updated_at).update(updated_at=now):
            send(bulk_id, batches)
            offered += 1
    return offered


def bulk_action_finish(*, bulk_id: Any) -> BulkAction:
    """Run the action's remaining batches here, one transaction each, until it is done (a
    command's foreground; a worker doing a batch at the same time is waited for, and its
    batch is not done twice)."""
    while True:
        bulk = BulkAction.objects.get(id=bulk_id)
        if bulk.finished_at is not None:
            return bulk
        bulk_action_batch(bulk_id=bulk_id, batch=bulk.batches, send_next=False)


def bulk_action_get(*, bulk_id: Any, user: Any) -> BulkAction:
    """A bulk action, for its requester (and superusers): anyone else gets the 404 of one
    that does not exist."""
    try:
        key = uuid.UUID(str(bulk_id))
    except ValueError:
        raise NotFound(
            errors=[FieldError("id", f"'{echo(bulk_id)}' is not a bulk action id")]
        ) from None
    found = BulkAction.objects.filter(id=key).first()
    mine = found is not None and (
        access.trusted(user)
        or (found.requested_by_id is not None and found.requested_by_id == user.pk)
    )
    if found is None or not mine:
        raise NotFound(errors=[FieldError("id", f"unknown bulk action '{key}'")])
    return found
