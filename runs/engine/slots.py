"""Concurrency keys (CONTRACT section 13): a document's ``concurrency: {"key"?, "limit"}``.

A run of such a workflow gets its key when it starts (``key`` resolved over its input; "" for
a limit per workflow) and waits ``pending``, with nothing planned and no worker held, until
the key has a free slot: at most ``limit`` runs of one key hold a slot at once. A run holds
its slot from its admission (``Run.admitted_at``) until it ends, whatever the end.

Invariants:

- The database decides races: every admission locks the key's :class:`ConcurrencyGate` row
  (``SELECT ... FOR UPDATE``), then counts the key's holders. Two starts or ends at once
  take turns on that lock, and the second counts what the first committed (each statement
  of a read-committed transaction reads what had committed before it), so no two take the
  last slot.
- Locks are taken gate first, then waiting runs (``SKIP LOCKED``): an end holds its own run
  (a holder) and then the gate, and nothing holds a waiting run and then asks for the gate
  (an advance of a run waiting for a slot plans nothing and touches no gate; a waiting run
  cancelled held no slot and frees none). So admissions never deadlock.
- A key admits its waiting runs highest ``priority`` first, then in arrival order.
- Admission is durable: ``admitted_at`` is written in the transaction that frees the slot
  (a run's end) or starts the run, and the advance message follows on commit. Should that
  message be lost, the reconciler advances an admitted run left ``pending``
  (``reconcile.advance_stuck``); should a slot be free while runs wait (however that
  came about: rows changed by hand, a restored backup), the reconciler's pass
  (:func:`admit_waiting`) admits them, the keys whose turn came longest ago first, one run
  each in turn, so a key with a long queue never keeps the others waiting.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from workflows.templates import interpolate

from .. import dispatch
from ..models import RUN_NOT_ENDED, ConcurrencyGate, Run
from ..status import RunStatus
from . import journal
from .isolation import guarded

logger = logging.getLogger(__name__)

# The longest key kept as it is; a longer one is kept as its beginning and its digest.
KEY_MAX = 255
# At most this many runs admitted by one call (one end, one start): should more slots be
# free at once, the reconciler's passes admit the rest.
ADMIT_BATCH = 100
# The reconciler's admissions as its failures are counted (isolation.py), per key.
ADMIT = "reconcile.admitted"
_NONE_ADMITTED: list[Run] = []


@dataclass(frozen=True)
class Limit:
    """A document's ``concurrency``: the key template (None: per workflow) and the limit."""

    key: str | None
    limit: int


def limit_of(document: Mapping[str, Any]) -> Limit | None:
    spec = document.get("concurrency")
    if not isinstance(spec, Mapping):
        return None
    key = spec.get("key")
    return Limit(key=key if isinstance(key, str) else None, limit=int(spec["limit"]))


def key_for(limit: Limit, input: Any) -> str:
    """The run's key: the template resolved over its input, as text ("" per workflow; a
    missing path reads as ""). A key longer than KEY_MAX is its beginning and its digest:
    two long keys that differ stay apart."""
    if limit.key is None:
        return ""
    text = interpolate(limit.key, {"input": input}, max_bytes=1_048_576)
    if len(text) <= KEY_MAX:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{text[: KEY_MAX - len(digest) - 1]}~{digest}"


def _gate(workflow_id: str, key: str) -> ConcurrencyGate:
    """The key's gate row, locked until the transaction ends (made on first use)."""
    gate = ConcurrencyGate.objects.select_for_update().filter(workflow_id=workflow_id, key=key)
    found = gate.first()
    if found is not None:
        return found
    ConcurrencyGate.objects.bulk_create(
        [ConcurrencyGate(workflow_id=workflow_id, key=key)], ignore_conflicts=True
    )
    return gate.get()


def holders(workflow_id: str, key: str) -> int:
    """How many runs hold a slot of the key (admitted, not ended)."""
    return Run.objects.filter(
        workflow_id=workflow_id,
        concurrency_key=key,
        admitted_at__isnull=False,
        # Named as the partial index run_slot_holders names them.
        status__in=RUN_NOT_ENDED,
    ).count()


def waiting(workflow_id: str, key: str) -> Any:
    """The key's runs waiting for a slot, in the order they are admitted."""
    return Run.objects.filter(
        workflow_id=workflow_id,
        concurrency_key=key,
        admitted_at__isnull=True,
        status=RunStatus.PENDING,
    ).order_by(F("priority").desc(), "created_at", "id")


def admit(workflow_id: str, key: str, *, now: datetime, most: int = ADMIT_BATCH) -> list[Run]:
    """Give the key's free slots to its waiting runs (highest priority first, then arrival),
    at most ``most`` of them, in the caller's transaction (which sends their advances: see
    :func:`admit_and_advance`). Returns the runs admitted.

    Each waiting run is admitted within the limit of its own version's document (a version
    without ``concurrency`` admits at once). A waiting run another transaction holds locked
    (it is being cancelled) is passed over: that transaction ends it."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("slots.admit runs inside the caller's transaction")
    gate = _gate(workflow_id, key)
    held = holders(workflow_id, key)
    admitted: list[Run] = []
    queue = waiting(workflow_id, key)
    if connection.features.has_select_for_update_skip_locked:
        queue = queue.select_for_update(skip_locked=True)
    # The limit of the last run admitted: with the key full at it, the next read is spared
    # (a start of a busy key admits itself and stops there).
    cap: int | None = None
    while len(admitted) < most and (cap is None or held < cap):
        run = queue.exclude(id__in=[r.id for r in admitted]).first()
        if run is None:
            break
        limit = limit_of(journal.document_of(run.version_id))
        if limit is not None and held >= limit.limit:
            break
        cap = limit.limit if limit is not None else None
        Run.objects.filter(id=run.id, admitted_at__isnull=True).update(
            admitted_at=now, updated_at=now
        )
        run.admitted_at = run.updated_at = now
        held += 1
        admitted.append(run)
    # Whether runs still wait, for the reconciler's pass (under the lock, so it is true).
    left = waiting(workflow_id, key).exists()
    if admitted or left != gate.waiting:
        changes: dict[str, Any] = {"waiting": left}
        if admitted:
            changes["turn_at"] = now
        ConcurrencyGate.objects.filter(id=gate.id).update(**changes)
    return admitted


def refusal(workflow_id: str, key: str, limit: int) -> str | None:
    """Why one more run may not hold a slot of the key now, or None when it may (under the
    gate's lock, in the caller's transaction, which then writes that run's
    ``admitted_at``): a retried run, which does not queue. Runs already waiting go first: a
    free slot is theirs."""
    _gate(workflow_id, key)
    held = holders(workflow_id, key)
    if held >= limit:
        return f"every slot is taken ({held} of {limit} running)"
    queued = waiting(workflow_id, key).count()
    if queued:
        return f"{queued} run(s) wait for a slot and go first ({held} of {limit} running)"
    return None


def admit_and_advance(
    workflow_id: str, key: str, *, now: datetime, skip: Any = None, most: int = ADMIT_BATCH
) -> list[Run]:
    """:func:`admit`, and an advance after commit for each run admitted (but ``skip``, a
    run id the caller plans itself)."""
    admitted = admit(workflow_id, key, now=now, most=most)
    for run in admitted:
        if run.id != skip:
            dispatch.advance_on_commit(run.id, priority=run.priority)
    return admitted


def release(run: Run, *, now: datetime) -> None:
    """``run`` (locked by the caller) has just ended in this transaction: if it held a slot,
    the key's next waiting runs are admitted in the same transaction."""
    if run.concurrency_key is None or run.admitted_at is None:
        return
    admitted = admit_and_advance(run.workflow_id, run.concurrency_key, now=now)
    if admitted:
        logger.debug("run %s ended: %d run(s) of its key admitted", run.id, len(admitted))


def admit_waiting(now: datetime | None = None, batch: int = 100) -> int:
    """The reconciler's pass: admit runs waiting while their key has a free slot, at most
    ``batch``. Keys take turns: the ``batch`` keys with runs waiting whose turn came longest
    ago are visited, in that order, one admission each per round (each its own
    transaction); each visited key's turn is then now, so a later pass visits the next keys
    and a key whose slots stay taken does not hold the pass's head. Returns how many runs
    were admitted."""
    now = now or timezone.now()
    turns = list(
        ConcurrencyGate.objects.filter(waiting=True)
        .order_by("turn_at", "id")
        .values_list("id", "workflow_id", "key")[:batch]
    )
    ConcurrencyGate.objects.filter(id__in=[gate for gate, _, _ in turns]).update(turn_at=now)
    keys = [(workflow_id, key) for _, workflow_id, key in turns]
    admitted = 0
    while keys and admitted < batch:
        served = []
        for workflow_id, key in keys:
            if admitted >= batch:
                break
            # A key whose admission fails (its waiting run's document unreadable, say) is
            # logged and counted, and the other keys take their turns (isolation.py); its
            # turn moved to now above, so it is visited last in the next pass.
            taken = guarded(
                ADMIT, None, partial(_admit_one, workflow_id, key, now), failed=_NONE_ADMITTED
            )
            if taken:
                admitted += 1
                served.append((workflow_id, key))
        keys = served
    return admitted


def _admit_one(workflow_id: str, key: str, now: datetime) -> list[Run]:
    with transaction.atomic():
        return admit_and_advance(workflow_id, key, now=now, most=1)


def waiting_reason(run: Run) -> str | None:
    """Why a run waits for a slot (the run's ``reason``), or None when it does not."""
    if run.concurrency_key is None or run.admitted_at is not None:
        return None
    if run.status != RunStatus.PENDING:
        return None
    limit = limit_of(journal.document_of(run.version_id))
    held = holders(run.workflow_id, run.concurrency_key)
    of = f" of {limit.limit}" if limit is not None else ""
    return f"waiting for a concurrency slot of {key_name(run)} ({held}{of} running)"


def key_name(run: Run) -> str:
    """The run's key as messages name it: "key 'acme'", or "workflow w" for a limit per
    workflow."""
    if run.concurrency_key:
        return f"key '{run.concurrency_key}'"
    return f"workflow {run.workflow_id}"
