"""Claiming an attempt: the conditional update that decides which delivery runs the body.

Claiming is idempotent: the update only matches an attempt still ``scheduled``, so a
duplicate delivery, a second worker or a redelivered message updates no row. On Postgres the
claim and the read of what the worker needs are one ``UPDATE ... RETURNING`` (one round trip
per step); elsewhere (the embedded SQLite default) a read then the same conditional update.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection

from runs.engine.journal import from_json, from_timestamp
from runs.engine.sql import cursor as prepared_cursor
from runs.models import Run, StepRun
from runs.moves import move_steps
from runs.status import StepStatus, step_sources


@dataclass(frozen=True)
class Claimed:
    """What the worker needs of an attempt it claimed."""

    id: int
    run_id: Any
    step_id: str
    attempt: int
    input: Any
    timeout_ms: int
    idempotency_key: str
    queue: str
    refusals: int
    celery_task_id: str
    workflow_id: str
    version_id: int
    claim: uuid.UUID
    deadline_at: datetime
    # Where the step sits: "" at the top level, "fan[3]/" inside a composite step.
    path: str = ""
    # The run's secrets as stored (encrypted; "" for none): the input's tokens stand for them.
    secrets: str = ""
    # The step's kind: its module in the registry says how the attempt runs.
    kind: str = "task"
    # Who the run's model calls count against (runs.models.Run.account).
    account: str = ""
    # The run's generation and root run: the attempt's place in its run's trace
    # (runs.tracing derives the parent step span's id from them).
    generation: int = 1
    root_run_id: Any = None
    # The run's recipe versions by name, over what its recipe steps pin (a fork's).
    recipe_pins: Any = None


def lease_until(now: datetime, deadline: datetime) -> datetime:
    """A lease from ``now``, never past the attempt's deadline plus grace."""
    lease = now + timedelta(seconds=settings.DJFLOW["LEASE_SECONDS"])
    grace = timedelta(seconds=settings.DJFLOW["DEADLINE_GRACE_SECONDS"])
    return min(lease, deadline + grace)


# The claim's move, checked against the table when this module loads.
(CLAIMED_FROM,) = step_sources(StepStatus.RUNNING, [StepStatus.SCHEDULED])
CLAIMED_TO = StepStatus.RUNNING

# The claim sets the attempt's deadline and its lease, which never outlives the deadline plus
# grace: the timer tick finds a lapsed lease on the lease index (runs.engine.timers) and times
# out an attempt whose worker hangs past its time limit, or gives up one whose worker was lost.
# No timer row per attempt: its insert at the claim and delete at the record were most of what
# Postgres spent on a step (0.6 ms of 0.9, pg_stat_statements on 16 runs of 200 steps).
_CLAIM_POSTGRES = """
UPDATE {step_run} AS s
   SET status = %(target)s, claim = %(claim)s, worker = %(worker)s, started_at = %(now)s,
       deadline_at = %(now)s + s.timeout_ms * interval '1 millisecond',
       lease_expires_at = LEAST(
           %(now)s + %(lease)s * interval '1 second',
           %(now)s + s.timeout_ms * interval '1 millisecond' + %(grace)s * interval '1 second')
  FROM {run} AS r
 WHERE s.id = %(id)s AND s.status = %(source)s AND r.id = s.run_id
RETURNING s.id, s.run_id, s.step_id, s.attempt, s.input, s.timeout_ms, s.idempotency_key,
          s.queue, s.refusals, s.celery_task_id, r.workflow_id, r.version_id, s.deadline_at,
          s.path, r.secrets, s.kind, r.account, s.generation, r.root_run_id, r.recipe_pins
"""


def claim_of(step_run: StepRun, *, worker: str, now: datetime, claim: uuid.UUID) -> dict[str, Any]:
    """The fields of a claim on an attempt not yet inserted (``runs.engine.apply``'s
    ``claim_as``): inserted with them, it is claimed as ``claim_attempt`` would claim it."""
    deadline = now + timedelta(milliseconds=step_run.timeout_ms)
    return {
        "status": CLAIMED_TO,
        "claim": claim,
        "worker": worker,
        "started_at": now,
        "deadline_at": deadline,
        "lease_expires_at": lease_until(now, deadline),
    }


def claimed_from(step_run: StepRun, run: Run) -> Claimed:
    """What ``claim_attempt`` returns, for an attempt inserted claimed (``claim_of``) by the
    transaction that holds ``run``: no statement, the rows are in hand."""
    if step_run.claim is None or step_run.deadline_at is None:
        raise ValueError(f"attempt {step_run.id} was not inserted claimed")
    return Claimed(
        id=step_run.id,
        run_id=run.id,
        step_id=step_run.step_id,
        attempt=step_run.attempt,
        # As read back from its column: the handler gets the same input either way.
        input=from_json(json.dumps(step_run.input)),
        timeout_ms=step_run.timeout_ms,
        idempotency_key=step_run.idempotency_key,
        queue=step_run.queue,
        refusals=step_run.refusals,
        celery_task_id=step_run.celery_task_id,
        workflow_id=run.workflow_id,
        version_id=run.version_id,
        claim=step_run.claim,
        deadline_at=step_run.deadline_at,
        path=step_run.path,
        secrets=run.secrets,
        kind=step_run.kind,
        account=run.account,
        generation=step_run.generation,
        root_run_id=run.root_run_id,
        recipe_pins=run.recipe_pins,
    )


def claim_attempt(
    step_run_id: int, *, worker: str, now: datetime, claim: uuid.UUID | None = None
) -> Claimed | None:
    """Claim a scheduled attempt for ``worker`` (with ``claim`` as its fencing token, a new
    one unless given); None when it is not (or no longer) ours."""
    claim = claim or uuid.uuid4()
    if connection.vendor == "postgresql":
        return _claim_postgres(step_run_id, worker, now, claim)
    return _claim_portable(step_run_id, worker, now, claim)


def _claim_postgres(
    step_run_id: int, worker: str, now: datetime, claim: uuid.UUID
) -> Claimed | None:
    sql = _CLAIM_POSTGRES.format(step_run=StepRun._meta.db_table, run=Run._meta.db_table)
    params = {
        "claim": claim,
        "worker": worker,
        "now": now,
        "lease": settings.DJFLOW["LEASE_SECONDS"],
        "grace": settings.DJFLOW["DEADLINE_GRACE_SECONDS"],
        "id": step_run_id,
        "source": str(CLAIMED_FROM),
        "target": str(CLAIMED_TO),
    }
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    return Claimed(
        id=row[0],
        run_id=row[1],
        step_id=row[2],
        attempt=row[3],
        input=from_json(row[4]),
        timeout_ms=row[5],
        idempotency_key=row[6],
        queue=row[7],
        refusals=row[8],
        celery_task_id=row[9],
        workflow_id=row[10],
        version_id=row[11],
        claim=claim,
        # The claim sets it (from the attempt's timeout_ms): never NULL here.
        deadline_at=from_timestamp(row[12]) or now,
        path=row[13],
        secrets=row[14],
        kind=row[15],
        account=row[16],
        generation=row[17],
        root_run_id=row[18],
        recipe_pins=from_json(row[19]),
    )


def _claim_portable(
    step_run_id: int, worker: str, now: datetime, claim: uuid.UUID
) -> Claimed | None:
    row = (
        StepRun.objects.select_related("run")
        .filter(id=step_run_id, status=CLAIMED_FROM)
        .only(
            "id",
            "run_id",
            "step_id",
            "attempt",
            "input",
            "timeout_ms",
            "idempotency_key",
            "queue",
            "refusals",
            "celery_task_id",
            "path",
            "kind",
            "generation",
            "run__workflow_id",
            "run__root_run_id",
            "run__version_id",
            "run__secrets",
            "run__account",
            "run__recipe_pins",
        )
        .first()
    )
    if row is None:
        return None
    deadline = now + timedelta(milliseconds=row.timeout_ms)
    claimed = move_steps(
        StepRun.objects.filter(id=row.id),
        CLAIMED_TO,
        sources=[CLAIMED_FROM],
        claim=claim,
        worker=worker,
        started_at=now,
        deadline_at=deadline,
        lease_expires_at=lease_until(now, deadline),
    )
    if not claimed:
        return None
    return Claimed(
        id=row.id,
        run_id=row.run_id,
        step_id=row.step_id,
        attempt=row.attempt,
        input=row.input,
        timeout_ms=row.timeout_ms,
        idempotency_key=row.idempotency_key,
        queue=row.queue,
        refusals=row.refusals,
        celery_task_id=row.celery_task_id,
        workflow_id=row.run.workflow_id,
        version_id=row.run.version_id,
        claim=claim,
        deadline_at=deadline,
        path=row.path,
        secrets=row.run.secrets,
        kind=row.kind,
        account=row.run.account,
        generation=row.generation,
        root_run_id=row.run.root_run_id,
        recipe_pins=row.run.recipe_pins,
    )
