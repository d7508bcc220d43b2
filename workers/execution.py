"""Running one attempt of a worker step: claim, run the handler, record, advance.

Claiming is idempotent: the claim is a conditional update from ``scheduled``, so a duplicate
delivery, a second worker or a redelivered message updates no row and does nothing. The
claim commits before the body runs, which is what ``at_most_once`` needs: an attempt lost
after ``started`` is found ``running`` with a lapsed lease and failed, never run again.
Recording is conditional on the claim's fencing token, so a worker whose attempt was given
up meanwhile (expired, cancelled) cannot overwrite the journal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F
from django.utils import timezone

from runs import dispatch, metrics, vault
from runs import tracing as run_tracing
from runs.engine import budgets, calls, hooks, isolation, journal, unservable
from runs.engine.advance import (
    ADVANCE_ACTIONS,
    BatchFailed,
    Budget,
    advance_locked,
    advance_many,
    lock_run_recording_reading,
    lock_runs_recording_reading,
    run_advance_holding,
)
from runs.engine.ending import Ends
from runs.engine.plan import MAX_VALUE_BYTES
from runs.engine.store import attempts_in_flight, record_charged, request_advance
from runs.models import Effect, Run, StepRun
from runs.moves import hand_back
from runs.status import RUN_TERMINAL, StepStatus
from workflows import kinds, secrets
from workflows.failures import BudgetWait, Deferred, StepFailure
from workflows.templates import TooLarge, check_size

from . import batches, task_events, tracing
from .claims import Claimed, claim_attempt, claim_of, claimed_from
from .context import StepContext, bound_logger
from .leases import keeper

logger = logging.getLogger(__name__)
T = TypeVar("T")


def execute(
    step_run_id: int,
    *,
    worker: str,
    soft_limit: float | None = None,
    queue: str | None = None,
    more: Sequence[int] = (),
    priority: int | None = None,
) -> str:
    """Run one attempt, then, while it pays, the run's next ones; returns what happened to
    the last (``not-scheduled``, ``succeeded``, ...).

    Continuing in the same task spares a broker hop per step of a sequential run: the next
    attempt is written by the same transaction that recorded this one, and this worker claims
    it like any other. It continues only with a next attempt for the same queue, in the main
    thread (its own time limit is a SIGALRM), within the task's soft time limit, and for at
    most ``INLINE_MAX_STEPS`` steps or ``INLINE_SECONDS``; otherwise the next attempt is
    offered through the broker as usual.

    Each step's ``timeout_ms`` is enforced here by SIGALRM (main thread only); Celery's soft
    time limit, set ``INLINE_SECONDS`` later, is the backstop.

    ``more`` are attempts of the same fan-out sent in the same message: run one after
    another, within the same budget, after this one; the rest is offered through the broker
    when the budget is spent, or by ``workers.batches``' thread as soon as one runs past
    ``HAND_OFF_SECONDS``.
    """
    alarm = threading.current_thread() is threading.main_thread()
    chain = _Chain(worker, time.monotonic(), soft_limit, queue)
    rest = None
    if more:
        offer = partial(dispatch.offer_ids, queue=queue, soft_limit=soft_limit, priority=priority)
        rest = batches.Rest(list(more), offer)
    try:
        return _execute(step_run_id, chain, alarm, rest)
    except BaseException:
        if rest is not None:
            # Whatever stopped this task (a database error, Celery's time limit): the rest
            # of its message goes to other workers now, not after LOST_MESSAGE_SECONDS.
            with contextlib.suppress(Exception):
                rest.hand_off()
        raise


def _execute(step_run_id: int, chain: _Chain, alarm: bool, rest: batches.Rest | None) -> str:
    # Each attempt shows in Flower as a task of its own (when the worker sends task events).
    shown = task_events.StepEvents.for_current_task()
    first = partial(_execute_one, step_run_id, chain, own_alarm=alarm)
    outcome, held = _watched(rest, partial(shown.around, step_run_id, None, first))
    if outcome in (HANDED_BACK, DEFERRED):
        if rest is not None:
            # Not this worker's (no handler), or every model slot taken: the rest as one
            # message, for a worker that has them.
            with contextlib.suppress(Exception):
                rest.offer = partial(rest.offer, together=True)
                rest.hand_off()
        if outcome == HANDED_BACK:
            raise HandedBack(f"attempt {step_run_id} handed back: this worker lacks its handler")
        raise HandedBack(f"attempt {step_run_id} handed back: it waits for a model slot")
    while held is not None:
        step_run, workflow_id, claimed = held
        if claimed is None:
            # The step is recorded: a broker outage must not fail its task (see offer_now).
            dispatch.offer_now(step_run, workflow_id=workflow_id)
            break
        chain.chained += 1
        outcome, held = shown.around(
            step_run.id,
            (step_run, workflow_id),
            partial(_execute_one, step_run.id, chain, own_alarm=True, claimed=claimed),
        )
    if rest is not None:
        _run_rest(rest, chain, shown, own_alarm=alarm)
    return outcome


def _run_rest(rest: batches.Rest, chain: _Chain, shown: Any, *, own_alarm: bool) -> None:
    """Run the rest of a fan-out's message while the task's budget allows (each attempt
    claimed on its own: one claimed elsewhere meanwhile is skipped); offer what is left."""
    try:
        # A message's attempts share the first one's time limit (runs.dispatch groups them
        # so), and Celery's soft limit is that plus INLINE_SECONDS: the budget bounds them.
        while chain.has_time(0.0):
            step_run_id = rest.next()
            if step_run_id is None:
                return
            chain.chained += 1
            one = partial(_execute_one, step_run_id, chain, own_alarm=own_alarm)
            outcome, _ = _watched(rest, partial(shown.around, step_run_id, None, one))
            if outcome in (HANDED_BACK, DEFERRED):
                # That attempt went back through the broker; so does the rest, together.
                rest.offer = partial(rest.offer, together=True)
                break
    finally:
        rest.hand_off()


def _watched(rest: batches.Rest | None, run: Callable[[], T]) -> T:
    """``run`` one attempt of a message, its rest offered elsewhere should it run long."""
    if rest is None:
        return run()
    rest.running()
    try:
        return run()
    finally:
        rest.ran()


@dataclass
class _Chain:
    """The task running a run's steps one after another (see execute)."""

    worker: str
    started: float
    soft_limit: float | None
    queue: str | None
    chained: int = 0
    # The claims the recording transaction being tried makes on the attempts it runs next:
    # should its commit go unacknowledged, they may be claimed with nobody to run them.
    pending: list[uuid.UUID] = field(default_factory=list)
    # A batch of fired runs (advance_and_execute): its next attempt (of another run), which
    # the transaction recording this chain's last step claims while there is time; what it
    # claimed.
    then: tuple[StepRun, str] | None = None
    then_claimed: Claimed | None = None
    # A batch's attempts claimed ahead (advance_and_execute): their results, kept here to be
    # recorded together (_record_all) instead of each in a transaction of its own.
    collect: _Collected | None = None

    def goes_on_with(self, step_run: StepRun) -> bool:
        """Whether this task runs ``step_run`` (the run's next attempt) itself."""
        return (self.queue is None or step_run.queue == self.queue) and self.has_time_for(step_run)

    def has_time_for(self, step_run: StepRun) -> bool:
        return self.has_time(step_run.timeout_ms / 1000)

    def has_time(self, step_seconds: float) -> bool:
        """Whether a next step of at most ``step_seconds`` fits in this task's budget."""
        inline = settings.DJFLOW
        elapsed = time.monotonic() - self.started
        return (
            threading.current_thread() is threading.main_thread()
            and self.chained < inline["INLINE_MAX_STEPS"]
            and elapsed < inline["INLINE_SECONDS"]
            # Celery's own soft limit for this task must not fire inside the next step's time.
            and (self.soft_limit is None or elapsed + step_seconds <= self.soft_limit)
        )


# How long one batch of fired runs (workers.advance_runs) holds its pool process before it
# sends the rest back to the queue. Measured with 20-run batches on a loaded 2-core machine
# (60-100 ms a run): batches of 1-2 s kept the one-second clock tick waiting for a free pool
# process (timer firing p99 1.7 s against 1.0 s with one advance message a run), and ran past
# INLINE_SECONDS, which offered 15 % of the next steps through the broker after all.
ADVANCE_RUNS_SECONDS = 0.25
# Runs of a batch advanced in one transaction (runs.engine.advance.advance_many): one commit
# for them all instead of one each. The batch's time is looked at between chunks: the
# attempts of a chunk's runs are run here (within INLINE_SECONDS), not offered, so a chunk is
# small enough to keep a batch near ADVANCE_RUNS_SECONDS (about 5-10 ms a run here).
ADVANCE_RUNS_CHUNK = 10


def advance_and_execute(
    run_ids: list[str],
    *,
    worker: str,
    queues: Collection[str],
    soft_limit: float | None = None,
) -> int:
    """Advance each run (a fired timer's), and run the lone next attempt an advance leaves
    here, inline, as :func:`execute` runs a run's next step; returns the attempts run.

    A resumed run then costs no ``execute_step`` message. An attempt is run here only when
    it is for a queue this worker consumes (``queues``), this worker has its handler, and
    the task's time allows (``_Chain.goes_on_with``, counted over the whole batch);
    otherwise it is offered through the broker as an advance offers it. Each advance is one
    bounded round (a run with more to plan asks for another advance).

    Runs are advanced ``ADVANCE_RUNS_CHUNK`` at a time in one transaction, a savepoint each
    (``advance_many``): a run that fails to advance is rolled back alone and left to the
    reconciler (its timer fired, nothing in flight), the others commit. Should the chunk's
    transaction fail as a whole, its runs are advanced one by one, as before batching. The
    first attempt run here is claimed by that transaction, and each next one by the
    transaction that records the attempt before it (``_Chain.then``): a fired run's step
    costs one commit, its recording, instead of three (advance, claim, record).

    After ``ADVANCE_RUNS_SECONDS`` the runs not yet advanced go back to the engine's queue as
    one message: the pool process is free again for the clock's tick and the messages
    queued behind this one, and those runs' next steps are still run without a message of
    their own.
    """
    batch = _Batch(worker, queues, soft_limit, time.monotonic())
    for start in range(0, len(run_ids), ADVANCE_RUNS_CHUNK):
        if start and batch.spent():
            rest = run_ids[start:]
            dispatch.advance_in_batches(rest, size=len(rest))
            break
        batch.advance(run_ids[start : start + ADVANCE_RUNS_CHUNK])
    return batch.chained


@dataclass
class _Batch:
    """One ``advance_runs`` task's batch of fired runs (see advance_and_execute)."""

    worker: str
    queues: Collection[str]
    soft_limit: float | None
    started: float
    chained: int = 0

    def spent(self) -> bool:
        return time.monotonic() - self.started >= ADVANCE_RUNS_SECONDS

    def chain(self, step_run: StepRun) -> _Chain:
        # The run's steps after this one stay on its queue, as in execute().
        return _Chain(self.worker, self.started, self.soft_limit, step_run.queue, self.chained)

    def runs_here(self, step_run: StepRun, workflow_id: str) -> bool:
        """Whether this task runs the attempt (else it is offered through the broker)."""
        return (
            self.chain(step_run).goes_on_with(step_run)
            and step_run.queue in self.queues
            and _serves(step_run, workflow_id)
        )

    def ahead(self, step_run: StepRun) -> bool:
        """Whether the attempt is claimed as the chunk inserts it, run with the chunk's other
        such attempts, and recorded with them (``run_ahead``): an ``at_least_once`` attempt
        at the top of its run that this task runs. A worker lost in between leaves it
        ``running`` until its lease lapses, and the run tries it again, as the contract lets
        an ``at_least_once`` attempt be; an ``at_most_once`` one is claimed only just before
        its body runs, and its result recorded as soon as it ends."""
        return (
            step_run.effect != Effect.AT_MOST_ONCE
            and not step_run.path
            and _lost_before_late(step_run)
            and self.runs_here(step_run, step_run.run.workflow_id)
        )

    def advance(self, run_ids: list[str]) -> None:
        claims: dict[int, Claimed | None] = {}
        token = uuid.uuid4()
        now = timezone.now()

        def claim_ahead(step_run: StepRun) -> dict[str, Any] | None:
            if not self.ahead(step_run):
                return None
            return claim_of(step_run, worker=self.worker, now=now, claim=token)

        def claim_first(held: list[tuple[StepRun, str]]) -> None:
            # In the chunk's transaction, which commits before the body runs: the first
            # attempt's claim costs no commit of its own. Not when attempts were claimed
            # ahead: their bodies run first, and this one (perhaps at_most_once) would wait
            # claimed behind them, its lease running down; it is claimed as it runs.
            if any(step_run.claim is not None for step_run, _ in held):
                return
            for step_run, workflow_id in held:
                if self.runs_here(step_run, workflow_id):
                    claims[step_run.id] = claim_attempt(
                        step_run.id, worker=self.worker, now=timezone.now(), claim=token
                    )
                    return

        try:
            held = advance_many(run_ids, hold=True, claim_as=claim_ahead, before_commit=claim_first)
        except BatchFailed:
            logger.warning("advance_runs: %d runs one by one", len(run_ids), exc_info=True)
            # The commit may have gone through unacknowledged: what it claimed (the first
            # attempt, and those inserted claimed) is nobody's.
            with contextlib.suppress(Exception):
                _release(token)
            self.advance_each(run_ids)
            return
        shown = task_events.StepEvents.for_current_task()
        nexts: list[Held] = []
        try:
            nexts = self.run_ahead([entry for entry in held if entry[0].claim is not None], shown)
        except Exception:
            # The chunk's other runs must not wait for the reconciler too. What was recorded
            # is committed (the runs' next attempts, held, are the reconciler's lost
            # messages); what is still claimed and unrecorded is handed back and offered.
            logger.exception("advance_runs: %d attempts run ahead failed", len(held))
            with contextlib.suppress(Exception):
                _release(token)
        held = [entry for entry in held if entry[0].claim is None]
        for index, (step_run, workflow_id) in enumerate(held):
            claimed = claims.pop(step_run.id, None)
            # Not self.spent(): the time is looked at between chunks, and an attempt of a run
            # advanced here is run here (past INLINE_SECONDS it is offered, see runs_here).
            if claimed is None and not self.runs_here(step_run, workflow_id):
                dispatch.offer_now(step_run, workflow_id=workflow_id)
                continue
            chain = self.chain(step_run)
            after = held[index + 1] if index + 1 < len(held) else None
            if after is not None and self.runs_here(*after):
                chain.then = after
            try:
                _run_chain(chain, shown, (step_run, workflow_id, claimed))
            except Exception:
                # The other runs of the batch must not wait for the reconciler too.
                logger.exception(
                    "advance_runs: run %s failed; the reconciler takes it", step_run.run_id
                )
            self.chained = chain.chained
            if after is not None and chain.then_claimed is not None:
                # Claimed by the last recording: run next, whatever happened after it.
                claims[after[0].id] = chain.then_claimed
        for step_run, workflow_id, _ in nexts:
            # The next steps of the runs recorded together, each claimed as it is run.
            if not self.runs_here(step_run, workflow_id):
                dispatch.offer_now(step_run, workflow_id=workflow_id)
                continue
            try:
                self.chained = _run_chain(
                    self.chain(step_run), shown, (step_run, workflow_id, None)
                )
            except Exception:
                logger.exception(
                    "advance_runs: run %s failed; the reconciler takes it", step_run.run_id
                )

    def run_ahead(self, ahead: list[tuple[StepRun, str]], shown: Any) -> list[Held]:
        """Run the attempts the chunk's transaction inserted claimed (``ahead``), one after
        another, and record their results in one transaction (``_record_all``): a fired
        run's step then costs no transaction of its own. Returns the runs' next attempts
        (committed ``scheduled``).

        Nothing claimed waits long behind a slow body: while one runs past
        ``batches.HAND_OFF_SECONDS``, the hand-off thread records the results collected so
        far and hands back the attempts not yet run (offered again), as it offers the rest of
        a fan-out's message (``_overdue``). Past the task's time, the attempts not yet run
        are handed back too. Otherwise a claimed attempt waiting behind a body longer than
        its own time limit would be timed out by the tick without having run."""
        if not ahead:
            return []
        claimed = {
            step_run.id: (step_run, workflow_id, claimed_from(step_run, step_run.run))
            for step_run, workflow_id in ahead
        }
        # Claimed, not yet started: their leases kept alive while the others run.
        for _, _, row in claimed.values():
            keeper.hold(row.id, row.claim, row.deadline_at)
        results = _Collected()
        rest = batches.Rest(list(claimed), partial(_overdue, claimed, results), always=True)
        try:
            while (step_run_id := rest.next()) is not None:
                held = claimed[step_run_id]
                chain = self.chain(held[0])
                if not chain.goes_on_with(held[0]):
                    _give_back([held, *(claimed[i] for i in rest.take())])
                    break
                chain.collect = results
                rest.running()
                try:
                    _run_chain(chain, shown, held)
                except Exception:
                    logger.exception(
                        "advance_runs: run %s failed; the reconciler takes it", held[0].run_id
                    )
                finally:
                    rest.ran()
                self.chained = chain.chained
        finally:
            try:
                # Stopped early (a BaseException): what was not run goes back now.
                left = rest.take()
                if left:
                    _give_back([claimed[i] for i in left])
            finally:
                try:
                    outcomes = _record_all(results.take())
                finally:
                    for _, _, row in claimed.values():
                        keeper.release(row.id)
        return [held for _, held in outcomes if held is not None]

    def advance_each(self, run_ids: list[str]) -> None:
        """Each run in a transaction of its own (a chunk whose transaction failed)."""
        shown = task_events.StepEvents.for_current_task()
        for run_id in run_ids:
            try:
                fired = run_advance_holding(run_id=run_id, seconds=0)[1]
                if fired is None:
                    continue
                step_run, workflow_id = fired
                if not self.runs_here(step_run, workflow_id):
                    dispatch.offer_now(step_run, workflow_id=workflow_id)
                    continue
                self.chained = _run_chain(self.chain(step_run), shown, (*fired, None))
            except Exception as error:
                # Logged, counted and marked (runs.engine.isolation); the reconciler takes
                # the run after its back-off, and the chunk's other runs go on.
                isolation.record_failure("workers.advance_runs", run_id, error)


def _run_chain(chain: _Chain, shown: Any, held: Held | None) -> int:
    """Run a fired run's next attempt (claimed here) and the steps its chain goes on with
    (claimed by the transactions that recorded the step before); returns the chain's count."""
    while held is not None:
        step_run, workflow_id, claimed = held
        chain.chained += 1
        _, held = shown.around(
            step_run.id,
            (step_run, workflow_id),
            partial(_execute_one, step_run.id, chain, own_alarm=True, claimed=claimed),
        )
        if held is not None and held[2] is None:
            dispatch.offer_now(held[0], workflow_id=held[1])
            break
    return chain.chained


def _lost_before_late(step_run: StepRun) -> bool:
    """Whether a worker lost with the attempt claimed leaves it ``lost`` (offered again
    without using its retry budget), not ``timed_out``: its lease (``LEASE_SECONDS``) lapses
    well before its deadline plus grace does. A batch claims ahead only such attempts: a
    lost worker may leave several claimed that never ran, and a short step's would each use
    up a try (runs.engine.plan: a lapse the tick sees past the deadline is a time-out). The
    margin, a third of the lease, covers a renewal made while the attempt waited (the lease
    then runs from it) and a late tick."""
    djflow = settings.DJFLOW
    lease = djflow["LEASE_SECONDS"]
    return bool(step_run.timeout_ms / 1000 + djflow["DEADLINE_GRACE_SECONDS"] > lease * 4 / 3)


class _Collected:
    """The results of a batch's attempts claimed ahead, waiting to be recorded together;
    taken by the task or by the hand-off thread (see ``_Batch.run_ahead``)."""

    def __init__(self) -> None:
        self._results: list[_Result] = []
        self._lock = threading.Lock()

    def append(self, result: _Result) -> None:
        with self._lock:
            self._results.append(result)

    def take(self) -> list[_Result]:
        with self._lock:
            taken, self._results = self._results, []
            return taken


def _overdue(
    claimed: dict[int, tuple[StepRun, str, Claimed]],
    results: _Collected,
    left: list[int],
    **_: Any,
) -> None:
    """From the hand-off thread, while a body of a batch runs long: record the results
    collected so far and hand back the attempts claimed ahead and not yet run, on a thread
    of its own (a recording may retry through a database outage for a minute: the hand-off
    thread must stay free to watch the next message). The runs' next attempts are offered
    (that thread runs no body)."""
    taken = results.take()
    if not left and not taken:
        return
    worker = threading.Thread(
        target=_catch_up, args=([claimed[i] for i in left], taken), name="batch-catch-up"
    )
    worker.daemon = True
    worker.start()


def _catch_up(left: list[tuple[StepRun, str, Claimed]], results: list[_Result]) -> None:
    try:
        try:
            _give_back(left)
        except Exception:
            # Their leases lapse (no longer kept) and the tick gives them up as lost.
            logger.warning("could not hand back %d attempts", len(left), exc_info=True)
            for _, _, row in left:
                keeper.release(row.id)
        for _outcome, held in _record_all(results):
            if held is not None:
                dispatch.offer_now(held[0], workflow_id=held[1])
    except Exception:
        logger.exception("advance_runs: recording a batch's results while a body ran failed")
    finally:
        # This thread's own connection.
        connection.close()


def _give_back(ahead: list[tuple[StepRun, str, Claimed]]) -> None:
    """Attempts a batch claimed ahead and will not run (its time is spent, or a body runs
    long): back to ``scheduled`` and offered, as an attempt a worker hands back."""
    if not ahead:
        return
    with transaction.atomic():
        now = timezone.now()
        for step_run, workflow_id, row in ahead:
            if _returned(row.id, row.claim, now):
                dispatch.offer_on_commit(step_run, workflow_id=workflow_id)
    logger.info("advance_runs: %d attempts claimed ahead offered again", len(ahead))


def _serves(step_run: StepRun, workflow_id: str) -> bool:
    """Whether this worker has the attempt's body (a worker without it offers the attempt
    instead of claiming it only to hand it back)."""
    # The run as the advance locked it (no query: the attempt was written with it).
    step = journal.steps_of(step_run.run.version_id).get(step_run.step_id)
    kind = kinds.get(step_run.kind)
    return bool(step is not None and kind and kind.body and kind.body(step, workflow_id))


# The run's next attempt, written by the transaction that recorded this one, with its
# workflow, and its claim when this task goes on with it (else it is offered).
Held = tuple[StepRun, str, Claimed | None]
HANDED_BACK = "unservable"
# The body could not go on now (every model slot of the account taken): offered again soon.
DEFERRED = "deferred"


class HandedBack(Exception):
    """The task's own attempt was handed back: this worker lacks its handler, and the
    attempt waits for another worker (offered again under the same task id, at once or by
    the reconciler). ``execute_step`` ends as RETRY, not SUCCESS (see there)."""


def _execute_one(
    step_run_id: int, chain: _Chain, *, own_alarm: bool, claimed: Claimed | None = None
) -> tuple[str, Held | None]:
    """Claim the attempt (unless the transaction that wrote it claimed it for this task),
    run its body, record it."""
    worker = chain.worker
    row = claimed or _reconnecting(
        lambda: claim_attempt(step_run_id, worker=worker, now=timezone.now())
    )
    if row is None:
        return "not-scheduled", None
    claim, deadline = row.claim, row.deadline_at

    step = journal.steps_of(row.version_id)[row.step_id]
    if row.recipe_pins and step.get("recipe") in row.recipe_pins:
        # A fork's recipe versions (runs.forks) win over the version the step pins.
        step = {**step, "recipe_version": row.recipe_pins[step["recipe"]]}
    kind = kinds.get(row.kind)
    # The kind's body: for task and agent, the handler this worker's WORKFLOW_MODULES
    # registered. A worker without it (or without the kind) hands the attempt back.
    handler = kind.body(step, row.workflow_id) if kind and kind.body else None
    if handler is None:
        _hand_back(row, claim, row.workflow_id)
        return HANDED_BACK, None

    # The attempt's span in its run's trace, and its ids on every log line it writes.
    with (
        run_tracing.running(row.run_id, row.root_run_id, row.step_id, row.attempt),
        tracing.attempt_span(row, worker) as span,
    ):
        return _run_claimed(row, claim, deadline, handler, span, chain, own_alarm=own_alarm)


def _run_claimed(
    row: Claimed,
    claim: uuid.UUID,
    deadline: Any,
    handler: Callable[..., Any],
    span: Any,
    chain: _Chain,
    *,
    own_alarm: bool,
) -> tuple[str, Held | None]:
    ctx = StepContext(
        run_id=str(row.run_id),
        step_id=row.step_id,
        attempt=row.attempt,
        idempotency_key=row.idempotency_key,
        workflow_id=row.workflow_id,
        logger=bound_logger(str(row.run_id), row.step_id, row.attempt),
        step_run_id=row.id,
        account=row.account,
        deadline_at=deadline,
        trace_span=span,
    )
    try:
        run_secrets = vault.decrypt(row.secrets, run_id=row.run_id)
    except vault.SecretsUnreadable as unreadable:
        # The wrong key: the handler must not run on tokens as if they were the values.
        logger.error("attempt %s not run: %s", row.id, unreadable)
        error = {"class": "fatal", "message": str(unreadable)}
        return _record(row, claim, StepStatus.FAILED, None, error, ctx, {}, chain)
    ctx.conceal = partial(secrets.conceal, registry=run_secrets)
    # The handler gets the secrets (the stored input holds tokens); while it runs and its
    # result is recorded, logs and error reports of this process mask them.
    with secrets.exposing(secrets.plaintexts(run_secrets)):
        return _run_handler(
            row, claim, deadline, handler, ctx, run_secrets, chain, own_alarm=own_alarm
        )


def _run_handler(
    row: Claimed,
    claim: uuid.UUID,
    deadline: Any,
    handler: Callable[..., Any],
    ctx: StepContext,
    run_secrets: dict[str, Any],
    chain: _Chain,
    *,
    own_alarm: bool,
) -> tuple[str, Held | None]:
    keeper.hold(row.id, claim, deadline)
    status, output = StepStatus.SUCCEEDED, None
    error: dict[str, Any] | None = None
    try:
        with _time_limit(row.timeout_ms / 1000 if own_alarm else None):
            given = secrets.reveal(row.input, run_secrets)
            output = handler(ctx, given, _Prior(row.run_id, run_secrets))
    except Deferred as deferred:
        keeper.release(row.id)
        _defer(row, claim, deferred)
        return DEFERRED, None
    except BudgetWait as wait:
        keeper.release(row.id)
        _wait_for_budget(row, claim, wait)
        return DEFERRED, None
    except StepFailure as failure:
        if failure.error_class == "unservable":
            keeper.release(row.id)
            _hand_back(row, claim, row.workflow_id)
            return HANDED_BACK, None
        status, error = StepStatus.FAILED, dict(failure.as_error())
        if failure.retry_after_ms is not None:
            error["retry_after_ms"] = failure.retry_after_ms
    except SoftTimeLimitExceeded:
        status = StepStatus.TIMED_OUT
        error = {"class": "timeout", "message": f"the attempt ran past {row.timeout_ms} ms"}
    except Exception as exc:  # any other exception is fatal (contract section 5)
        status, error = StepStatus.FAILED, _fatal(exc)
    finally:
        keeper.release(row.id)
    if status == StepStatus.SUCCEEDED:
        try:
            json.dumps(output)
            # Every value passed between steps is bounded (contract section 9).
            check_size(output, MAX_VALUE_BYTES)
        except TooLarge as exc:
            status, output = StepStatus.FAILED, None
            error = {
                "class": "invalid_input",
                "message": f"the handler's output is {exc}; the limit is 1 MiB",
            }
        except (TypeError, ValueError) as exc:
            status, output = StepStatus.FAILED, None
            error = {"class": "fatal", "message": f"the handler's output is not JSON: {exc}"}
    return _record(row, claim, status, output, error, ctx, run_secrets, chain)


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """The worker-side time limit of a step: SIGALRM raises SoftTimeLimitExceeded in the
    body, as Celery's soft time limit would."""
    if seconds is None:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _record(
    row: Claimed,
    claim: uuid.UUID,
    status: str,
    output: Any,
    error: dict[str, Any] | None,
    ctx: StepContext,
    run_secrets: dict[str, Any],
    chain: _Chain | None = None,
) -> tuple[str, Held | None]:
    """Record the attempt's result and advance the run, in one transaction; through a
    database restart, keep trying (the body must not be lost, nor run again). An attempt a
    batch claimed ahead (``chain.collect``) is kept to be recorded with the batch's others."""
    if ctx.trace_span is not None:
        tracing.attempt_recorded(ctx.trace_span, status, error, ctx.cost_usd())
    result = _Result(row, claim, status, output, error, ctx, run_secrets)
    if chain is not None and chain.collect is not None and not row.path:
        # Its lease kept alive until the batch records it (see _Batch.run_ahead); its
        # values (its finish) and its duration as the body ended, not as it is recorded.
        keeper.hold(row.id, claim, row.deadline_at)
        result.values = _values(status, output, error, ctx, run_secrets)
        result.seconds = time.monotonic() - ctx.started
        chain.collect.append(result)
        return status, None
    return _recording(result, chain)


@dataclass
class _Result:
    """An attempt's result, to be recorded (``_record_once``'s arguments but the chain)."""

    row: Claimed
    claim: uuid.UUID
    status: str
    output: Any
    error: dict[str, Any] | None
    ctx: StepContext
    run_secrets: dict[str, Any]
    # Set as a batch collects it: what recording charges and writes, and how long it ran.
    values: tuple[Any, dict[str, Any]] | None = None
    seconds: float | None = None


def _recording(result: _Result, chain: _Chain | None) -> tuple[str, Held | None]:
    """``_record``'s transaction, tried again through a database restart."""
    give_up = time.monotonic() + settings.DJFLOW["RECORD_RETRY_SECONDS"]
    pause = 0.1
    # Claims on the next attempt made by tries that failed, perhaps after their commit.
    unsure: list[uuid.UUID] = []
    while True:
        try:
            recorded = _record_once(*_arguments(result), chain, values=result.values)
        except (OperationalError, InterfaceError):
            if chain is not None:
                unsure += chain.pending
            if time.monotonic() + pause > give_up:
                raise
            logger.warning(
                "recording attempt %s failed; reconnecting", result.row.id, exc_info=True
            )
            connection.close()
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
        else:
            for lost in unsure:
                _release(lost)
            _counted(result, recorded[0])
            return recorded


def _arguments(
    result: _Result,
) -> tuple[Claimed, uuid.UUID, str, Any, dict[str, Any] | None, StepContext, dict[str, Any]]:
    return (
        result.row,
        result.claim,
        result.status,
        result.output,
        result.error,
        result.ctx,
        result.run_secrets,
    )


def _counted(result: _Result, outcome: str) -> None:
    """Committed: counted now, off the recording's transaction (runs.metrics)."""
    metrics.attempt_recorded(
        workflow=result.row.workflow_id,
        kind=result.row.kind,
        status=None if outcome == "dropped" else result.status,
        error=result.error,
        seconds=result.seconds
        if result.seconds is not None
        else time.monotonic() - result.ctx.started,
        spans=result.ctx.spans,
    )


def _record_all(results: list[_Result]) -> list[tuple[str, Held | None]]:
    """Record a batch's results (``_Batch.run_ahead``) in one transaction: one commit, one
    BEGIN, for them all instead of one each; returns each one's outcome and the run's next
    attempt, held unclaimed (the caller runs or offers it). Should that transaction fail (a
    database error, one run's plan raising), each is recorded in a transaction of its own, as
    an attempt run alone is; one that fails there too is logged and left to its lease: the
    tick gives it up and the run retries it (these attempts are all ``at_least_once``)."""
    # As while each body ran: logs and error reports of the recording mask the secrets.
    exposed = [text for result in results for text in secrets.plaintexts(result.run_secrets)]
    try:
        with secrets.exposing(exposed):
            return _recorded_together(results) or _recorded_each(results)
    finally:
        for result in results:
            keeper.release(result.row.id)


def _recorded_together(results: list[_Result]) -> list[tuple[str, Held | None]] | None:
    """The results recorded in one transaction, or None when it failed (or there is one).
    The runs are locked, the results written and the journals read in three statements
    for them all (``lock_runs_recording_reading``); then each run is planned on in turn."""
    runs = {str(result.row.run_id) for result in results}
    if len(results) < 2 or len(runs) < len(results):
        return None
    if any(result.row.root_run_id is not None for result in results):
        # A run inside a tree may be changed by its parent's plan earlier in the batch, and
        # read before: recorded alone, it is locked and read in its own turn.
        return None
    values = [result.values or _values(*_arguments(result)[2:]) for result in results]
    # The runs that end here are ended together, as the last statement of the transaction.
    ends = Ends()
    try:
        with transaction.atomic():
            locked = lock_runs_recording_reading(
                [
                    (
                        result.row.run_id,
                        result.row.id,
                        result.claim,
                        written,
                        # As _record_once: no read when the plan must see a charge.
                        None if cost else journal.kept_through(result.row.run_id),
                    )
                    for result, (cost, written) in zip(results, values, strict=True)
                ]
            )
            # One run that raises rolls the batch back, and each is then recorded alone
            # (_recorded_each).
            outcomes = [
                _recorded(result.row, result.status, result.ctx, cost, *found, ends=ends)
                for result, (cost, _), found in zip(results, values, locked, strict=True)
            ]
            ends.flush()
    except Exception:
        logger.warning("advance_runs: %d results recorded one by one", len(results), exc_info=True)
        return None
    for result, (outcome, _) in zip(results, outcomes, strict=True):
        _counted(result, outcome)
    return outcomes


def _recorded_each(results: list[_Result]) -> list[tuple[str, Held | None]]:
    outcomes: list[tuple[str, Held | None]] = []
    for result in results:
        try:
            outcomes.append(_recording(result, None))
        except Exception:
            logger.exception(
                "advance_runs: run %s failed; the reconciler takes it", result.row.run_id
            )
            outcomes.append(("unrecorded", None))
    return outcomes


def _record_once(
    row: Claimed,
    claim: uuid.UUID,
    status: str,
    output: Any,
    error: dict[str, Any] | None,
    ctx: StepContext,
    run_secrets: dict[str, Any],
    chain: _Chain | None = None,
    *,
    values: tuple[Any, dict[str, Any]] | None = None,
) -> tuple[str, Held | None]:
    if chain is not None:
        chain.pending, chain.then_claimed = [], None
    # Taken as the body ended when a batch collected it (see _record).
    cost, result = values or _values(status, output, error, ctx, run_secrets)
    if row.path:
        return _record_inside(row, claim, result, cost, ctx)
    with transaction.atomic():
        # The journal after this process's settled prefix, read with the lock in one round
        # trip (used by the plan only if that prefix still applies). Not when the attempt is
        # charged below: the plan must read its cost (limits.max_cost_usd).
        after = None if cost else journal.kept_through(row.run_id)
        run, recorded, read = lock_run_recording_reading(
            row.run_id, row.id, claim, result, after=after
        )
        return _recorded(row, status, ctx, cost, run, recorded, read, chain)


def _values(
    status: str,
    output: Any,
    error: dict[str, Any] | None,
    ctx: StepContext,
    run_secrets: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """What recording an attempt charges its run, and the values it writes to its row."""
    # The run is charged what was not charged during the attempt (a recipe's model calls
    # are, as each is settled); the attempt shows all it cost.
    cost = ctx.uncharged_usd()
    # A secret the handler echoed (in its output, an error message, a span) is stored as its
    # token: masked wherever it is shown, the value again for the next handler.
    answered = secrets.conceal(
        {"output": output, "error": error, "spans": [span.as_dict() for span in ctx.spans]},
        run_secrets,
    )
    return cost, {
        "status": status,
        **answered,
        "finished_at": timezone.now(),
        "lease_expires_at": None,
        "usage": ctx.usage(),
        # A reservation a call left held (the attempt ended inside it: a time-out) is
        # released: the attempt is over (runs.engine.costs).
        "reserved_usd": 0,
    }


def _recorded(
    row: Claimed,
    status: str,
    ctx: StepContext,
    cost: Any,
    run: Run | None,
    recorded: bool,
    read: tuple[int, list[Any]] | None,
    chain: _Chain | None = None,
    *,
    ends: Ends | None = None,
) -> tuple[str, Held | None]:
    """The rest of recording an attempt, in the transaction that locked its run (``run``,
    None if it is gone) and wrote its result (``recorded``, False if its claim was lost).
    ``ends`` (several results recorded together) may take the run's end, written when the
    caller flushes it."""
    if run is None:
        return "dropped", None
    # The model calls it made, recorded and charged whether or not the result is still
    # wanted: they were made either way.
    calls.calls_record(ctx.model_calls)
    calls.tool_calls_record(ctx.tool_calls)
    if not recorded:
        # Given up meanwhile (time-out, lost lease, cancel): the journal already says so.
        logger.info("attempt %s finished after it was given up; result dropped", row.id)
        return "dropped", None
    if cost:
        Run.objects.filter(id=run.id).update(cost_usd=F("cost_usd") + cost)
        _charge_attempt(row.id, cost)
    held = None
    if run.status not in RUN_TERMINAL:
        budget = Budget(ADVANCE_ACTIONS)
        _, next_attempt = advance_locked(
            run, hold=True, budget=budget, claim_as=_claim_as(chain), read=read, ends=ends
        )
        if next_attempt is not None:
            claimed = None
            if chain is not None and next_attempt.claim is not None:
                # Inserted claimed by this transaction, which commits before its body
                # runs: the next step's claim costs no statement and no commit.
                claimed = claimed_from(next_attempt, run)
            held = (next_attempt, run.workflow_id, claimed)
    if chain is not None and chain.then is not None and (held is None or held[2] is None):
        # This run's chain stops here: the batch's next attempt (another run's) is
        # claimed by this transaction, as a run's own next step is.
        step_run = chain.then[0]
        if chain.has_time_for(step_run):
            chain.then_claimed = _claim_next(chain, step_run.id)
    return status, held


def _claim_as(chain: _Chain | None) -> Any:
    """apply_plan's ``claim_as`` for a chain: the claim of the run's next attempt when this
    task goes on with it, None otherwise (and without a chain)."""
    if chain is None:
        return None

    def claim_as(step_run: StepRun) -> dict[str, Any] | None:
        if not chain.goes_on_with(step_run):
            return None
        token = uuid.uuid4()
        chain.pending.append(token)
        return claim_of(step_run, worker=chain.worker, now=timezone.now(), claim=token)

    return claim_as


def _claim_next(chain: _Chain, step_run_id: int) -> Claimed | None:
    """Claim an attempt this task runs next, in the recording transaction (see _record)."""
    token = uuid.uuid4()
    chain.pending.append(token)
    return claim_attempt(step_run_id, worker=chain.worker, now=timezone.now(), claim=token)


def _record_inside(
    row: Claimed,
    claim: uuid.UUID,
    result: dict[str, Any],
    cost: Any,
    ctx: StepContext | None = None,
) -> tuple[str, Held | None]:
    """Record an attempt inside a composite step (a branch, an item, an iteration) without
    the run's lock, and ask for an advance only when one can change something.

    A fan-out's completions must not each plan the whole journal (quadratic in the number of
    items). A success changes nothing the planner acts on while other attempts of the run
    are still in flight, unless a ``concurrency`` window is waiting for the slot it frees;
    so a failure (a retry or on_error to decide) or a success in a capped fan-out asks in
    the transaction that records it (``_may_change_the_plan``), and any other success asks
    only when, once it has committed, nothing else of the run is in flight
    (``_nothing_else_in_flight``). Looking after the commit is what makes the last one ask:
    of two completions committing at once, the one that commits second sees the first, so
    at least one of them asks (both may: the request is made once). Completions no longer
    take turns on a lock. An advance already pending sees this one's writes (see
    ``request_advance``); a worker lost between the commit and the look leaves a run with
    nothing in flight, which the reconciler advances (``reconcile.advance_stuck``).
    """
    asks = _may_change_the_plan(row, result["status"])
    calls_made = ctx is not None and bool(ctx.model_calls or ctx.tool_calls)
    if cost or calls_made or asks:
        with transaction.atomic():
            if cost:
                # The run row before the step run: the order every advance locks them in.
                Run.objects.filter(id=row.run_id).update(cost_usd=F("cost_usd") + cost)
            calls.calls_record(ctx.model_calls if ctx is not None else [])
            calls.tool_calls_record(ctx.tool_calls if ctx is not None else [])
            outcome = record_charged(row.run_id, row.id, claim, result)
            if outcome == "lost":
                logger.info("attempt %s finished after it was given up; result dropped", row.id)
                return "dropped", None
            if cost:
                _charge_attempt(row.id, cost)
            if (asks or outcome == "refused") and request_advance(row.run_id):
                dispatch.advance_on_commit(row.run_id)
    else:
        # Nothing but the result to write (a plain item's success): one statement on
        # Postgres, autocommit, the run charged what it stores (DJFLOW_MAX_RUN_BYTES) in it.
        outcome = record_charged(row.run_id, row.id, claim, result)
        if outcome == "refused":
            # Over the run's cap: the attempt failed (class limit), which fails the run.
            with transaction.atomic():
                if request_advance(row.run_id):
                    dispatch.advance_on_commit(row.run_id)
    if outcome == "lost":
        logger.info("attempt %s finished after it was given up; result dropped", row.id)
        return "dropped", None
    if outcome == "refused":
        return StepStatus.FAILED, None
    if not asks:
        _ask_if_last(row)
    return result["status"], None


def _release(claim: uuid.UUID) -> None:
    """Hand back the attempt a recording transaction claimed for this task if that
    transaction committed after all (its commit was not acknowledged: the connection dropped)
    and a later try recorded nothing new: its body never ran, so it is offered again, like
    any attempt handed back, instead of waiting for its lease to lapse as lost (which would
    fail an at_most_once step that never ran)."""
    with transaction.atomic():
        for step_run in StepRun.objects.select_related("run").filter(
            claim=claim, status=StepStatus.RUNNING
        ):
            if _returned(step_run.id, claim, timezone.now()):
                logger.warning("attempt %s claimed by an unsure commit: offered", step_run.id)
                dispatch.offer_on_commit(step_run, workflow_id=step_run.run.workflow_id)


def _ask_if_last(row: Claimed) -> None:
    """After the commit of a success inside a composite: ask for an advance if nothing else
    of the run is in flight. The result is committed either way, so a database error here
    is logged, not raised: the reconciler advances a run left with nothing in flight."""
    try:
        if _nothing_else_in_flight(row) and request_advance(row.run_id):
            dispatch.advance_on_commit(row.run_id)
    except (OperationalError, InterfaceError):
        logger.warning("attempt %s recorded; could not ask for an advance", row.id, exc_info=True)


def _charge_attempt(step_run_id: int, cost: Any) -> None:
    """Add what recording charges to the attempt's cost: added, never set, since its model
    calls were charged to it as each was settled (runs.engine.costs)."""
    StepRun.objects.filter(id=step_run_id).update(cost_usd=F("cost_usd") + cost)


def _may_change_the_plan(row: Claimed, status: str) -> bool:
    """Whether this completion asks for an advance in the transaction that records it: a
    failure (a retry or on_error to decide), or a success inside a capped fan-out (the slot
    it frees lets the next item start). Any other success asks only if it was the last one
    in flight (``_ask_if_last``)."""
    if status != StepStatus.SUCCEEDED:
        return True
    steps = journal.steps_of(row.version_id)
    return any(
        steps.get(part.split("[", 1)[0], {}).get("concurrency") is not None
        for part in row.path.split("/")
        if part
    )


def _nothing_else_in_flight(row: Claimed) -> bool:
    return not attempts_in_flight(row.run_id, kinds.names(kinds.Role.WORKER), besides=row.id)


def _reconnecting(operation: Callable[[], T]) -> T:
    """Run ``operation``; if the connection turns out broken (a database restart since the
    last task), reconnect and run it once more."""
    try:
        return operation()
    except (OperationalError, InterfaceError):
        if connection.in_atomic_block:
            raise
        connection.close()
        return operation()


def _hand_back(row: Claimed, claim: uuid.UUID, workflow_id: str) -> None:
    """This worker lacks the handler (class unservable): requeue the attempt for another
    worker without using its retry budget.

    When no live worker serves the handler on the step's queue, the attempt starts (or goes
    on with) its wait for one, and is not offered again at once: workers without the
    handler would only hand it back. The reconciler offers it again, and the wait ends in
    an ``unservable`` failure if no worker that serves it comes (``runs.engine.unservable``).
    """
    handler = unservable.handler_of(workflow_id, row.version_id, row.step_id)
    with transaction.atomic():
        now = timezone.now()
        returned = _returned(row.id, claim, now, refusals=F("refusals") + 1)
        waits = returned and unservable.unservable_arm(
            step_run_id=row.id, run_id=row.run_id, handler=handler, queue=row.queue, now=now
        )
        # After that many refusals in a row the reconciler offers it again, slower.
        offered = (
            returned and not waits and row.refusals + 1 < settings.DJFLOW["MAX_QUICK_REFUSALS"]
        )
        if offered:
            dispatch.offer_on_commit(row, workflow_id=workflow_id)
    if offered:
        # Hold this pool slot a moment after the offer: a free worker that may have the
        # handler takes the message, instead of this one taking it straight back.
        time.sleep(settings.DJFLOW["UNSERVABLE_PAUSE_SECONDS"])


def _defer(row: Claimed, claim: uuid.UUID, deferred: Deferred) -> None:
    """The body cannot go on now (every model slot of the account is taken): hand the
    attempt back without spending its budget or counting a refusal, and offer it again after
    ``deferred.seconds``, so a worker process is not held idle while it waits.

    The offer is a countdown message: it lives in a worker's memory (DESIGN: durable time
    lives in the timer table), which is fine for seconds. Should it be lost, the attempt is
    ``scheduled`` and the reconciler offers it again after ``LOST_MESSAGE_SECONDS``.
    """
    logger.info("attempt %s handed back for %.1f s: %s", row.id, deferred.seconds, deferred)
    with transaction.atomic():
        if _returned(row.id, claim, timezone.now()):
            dispatch.offer_later_on_commit(
                row, workflow_id=row.workflow_id, seconds=deferred.seconds
            )


def _wait_for_budget(row: Claimed, claim: uuid.UUID, wait: BudgetWait) -> None:
    """The body's model call did not fit a budget (limits.on_budget "wait"): hand the
    attempt back without spending its budget, not offered again, and plan the run, which
    then shows budget_exceeded (runs.engine.budgets)."""
    logger.info("attempt %s waits for budget: %s", row.id, wait.message)
    with transaction.atomic():
        waiting = budgets.budget_wait(
            step_run_id=row.id, claim=claim, wait=wait.wait, now=timezone.now()
        )
        if waiting and request_advance(row.run_id):
            dispatch.advance_on_commit(row.run_id)
        if waiting:
            hooks.budget_exceeded(row.run_id, row.id)


def _returned(step_run_id: int, claim: uuid.UUID, now: Any, **more: Any) -> bool:
    """The claimed attempt back to ``scheduled``, if the claim still holds (runs.moves)."""
    return hand_back(step_run_id, claim, now, **more)


def _fatal(exc: BaseException) -> dict[str, Any]:
    return {
        "class": "fatal",
        "message": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }


class _Prior(Mapping[str, Any]):
    """``prior``: earlier steps' outputs by id, read from the journal on first use."""

    def __init__(self, run_id: Any, run_secrets: Mapping[str, Any]) -> None:
        self.run_id = run_id
        self._secrets = run_secrets
        self._outputs: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._outputs is None:
            rows = (
                StepRun.objects.filter(run_id=self.run_id, status=StepStatus.SUCCEEDED)
                .order_by("id")
                .values_list("step_id", "output")
            )
            # An output that carries a secret stores its token: the handler gets the value.
            self._outputs = secrets.reveal(dict(rows), self._secrets)
        return self._outputs

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())
