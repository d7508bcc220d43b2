"""Writes for runs: start, cancel, pause, resume, retry. Views, admin, the builder and tasks
call these; none of them changes a status without a lock on the run row."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from workflows import access, secrets, selectors
from workflows.errors import Conflict, FieldError, InvalidInput, NotFound, echo
from workflows.heartbeats import StepHandler
from workflows.inputs import input_errors
from workflows.preflight import start_problems, start_waits
from workflows.queues import version_queue_errors
from workflows.templates import TooLarge, check_size, encoded_size

from . import dispatch, retries, tracing, vault
from .engine import budgets, costs, delivery, journal, slots, trees, unservable
from .engine.advance import advance_locked
from .engine.ending import cancelled_error, end_run
from .engine.plan import IN_DOUBT, MAX_VALUE_BYTES, Schedule, plan, top_level_ids
from .engine.store import Increment, update_run
from .models import (
    Account,
    Event,
    Run,
    RunAction,
    RunFault,
    StepRun,
    Timer,
    TimerPurpose,
)
from .moves import move_run, move_steps
from .selectors import run_tree_ending
from .status import RUN_TERMINAL, IllegalTransition, RunStatus, StepStatus, check_run_move

if TYPE_CHECKING:
    # A fork's seed (runs.forks calls run_start with one: imported there, not here).
    from .forks import Seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartResult:
    run: Run
    created: bool
    # Its first step planned in the start's transaction (asked for with ``plan_now``, or
    # because a handler has no live worker): the caller reads the planned journal.
    planned: bool = False


class StartPacer:
    """Whether a request may plan the run it starts (``run_start(plan_now=...)``): at most
    ``START_INLINE_PER_SECOND`` a second in this process, a token bucket holding one second's
    worth.

    Planned in the request, the answer shows the first step and the run costs no advance
    message; but each costs the web process the planner and a transaction of five statements.
    When starts come faster than that, the requests would wait behind one another's planning:
    past the rate a start inserts its run and a worker plans it (one ``runs.advance``), so a
    burst of starts waits for one insert each, and the workers, sized for planning, plan.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens: float | None = None
        self.at = 0.0

    def take(self) -> bool:
        rate = float(settings.DJFLOW["START_INLINE_PER_SECOND"])
        now = self.clock()
        full = self.tokens is None or rate <= 0
        tokens = rate if full else min(rate, (self.tokens or 0.0) + (now - self.at) * rate)
        self.at = now
        if tokens >= 1:
            self.tokens = tokens - 1
            return True
        self.tokens = tokens
        return False

    def reset(self) -> None:
        self.tokens = None


inline_starts = StartPacer()


def run_start(
    *,
    workflow: str,
    input: Any = None,
    version: int | None = None,
    idempotency_key: str | None = None,
    correlation: str | None = None,
    account: str | None = None,
    priority: int | None = None,
    user: AbstractBaseUser | None = None,
    plan_now: bool = True,
    fork: Seed | None = None,
) -> StartResult:
    """Start a run of ``workflow`` (its latest version unless pinned).

    ``user`` must be a starter of the workflow (404 when they may not see it, 403 when they
    may but not start it). The same ``idempotency_key`` for the same workflow and caller
    returns the run it started first (``created`` false), whatever the rest of the call says.
    An input that fails the version's ``input_schema``, or a ``task``/``agent`` handler no
    worker has served within ``UNSERVABLE_SECONDS`` (when ``START_CHECKS_WORKERS``), is
    refused, every problem named at once.

    A handler a worker served within that window but no live worker serves now (workers
    restarting) is accepted (CONTRACT section 14): the run is planned in the request, whatever
    ``plan_now`` says (no worker may be there to plan it), and its first attempts of such
    steps start their wait for a worker at once (``runs.engine.unservable``), so the run's
    ``reason`` says what it waits for from its first read, and the step fails as
    ``unservable`` if no worker serves it within the window.

    With ``plan_now`` (the default) the run is created and its first step planned in one
    transaction; the attempt is offered to a worker after commit (and offered again by the
    reconciler should that message be lost): the caller reads the first step at once.
    Without it (``POST /runs`` past :class:`StartPacer`'s pace) the run is inserted
    ``pending`` and one ``runs.advance`` message sent on commit: a worker plans the first
    step, and the client waits for one insert, not for the planner. Should that message be
    lost, the reconciler advances the pending run (``reconcile.advance_stuck``).

    ``fork`` (``runs.forks``) makes the run a fork: its fields are set, its input keeps the
    source's secret tokens, and its journal is given the source's kept rows before the
    first plan.

    ``priority`` (0 to 9, default 5) rides on the run's messages as the broker's priority
    and orders the runs waiting for a slot of one concurrency key. A workflow whose
    document has ``concurrency`` gives the run its key, and the run is admitted in the same
    transaction when the key has a free slot; otherwise it is created ``pending`` and waits,
    nothing planned, until a run of its key ends (``runs.engine.slots``).
    """
    if priority is None:
        priority = dispatch.DEFAULT_PRIORITY
    elif isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        raise InvalidInput(
            errors=[FieldError("priority", "must be an integer from 0 (lowest) to 9 (highest)")]
        )
    access.require_start(user, workflow)
    access.require_account(user, account)
    person = user if user is not None and user.is_authenticated else None
    # Keys are scoped to (workflow, caller): another user's key finds nothing here.
    same_key = Run.objects.filter(
        workflow_id=workflow, idempotency_key=idempotency_key, created_by=person
    )
    if idempotency_key is not None:
        existing = same_key.first()
        if existing is not None:
            return StartResult(existing, created=False)
    pinned = selectors.version_get(workflow_id=workflow, number=version)
    # The input, named recipes, knowledge bases and tools that exist, configured providers,
    # live workers for the handlers (workflows.preflight).
    problems = start_problems(pinned, input)
    if problems:
        raise InvalidInput(errors=problems)
    # No query while live workers serve every step (the pre-flight's read is kept).
    waits = start_waits(pinned)
    plan_now = plan_now or bool(waits)
    # Secrets are stored as tokens, their plaintext encrypted on the run (workflows.secrets);
    # this request holds them until it ends, so its logs and error reports mask them.
    stored_input, registry = vault.seal_input(
        pinned.document.get("input_schema"), input, inherited=fork.inherited if fork else None
    )
    secrets.expose(secrets.plaintexts(registry))
    # Planned in the request, the run and its first step commit together. Handed to a worker,
    # the run is one INSERT, which needs no transaction of its own (two round trips fewer);
    # inside a caller's transaction a savepoint keeps that usable should a concurrent start
    # with the same key win the insert.
    limit = slots.limit_of(pinned.document)
    # Resolved over the stored input: a key read from a secret is its token, never the
    # secret in a column of its own.
    try:
        key = slots.key_for(limit, stored_input) if limit is not None else None
    except TooLarge as error:
        # The template may read the input many times: bounded like a step's input.
        message = f"makes a concurrency key (concurrency.key) {error}; it is at most 1 MiB"
        raise InvalidInput(errors=[FieldError("input", message)]) from None
    alone = not plan_now and not transaction.get_connection().in_atomic_block and limit is None
    try:
        with contextlib.nullcontext() if alone else transaction.atomic():
            run = Run.objects.create(
                workflow_id=workflow,
                version=pinned,
                input=stored_input,
                secrets=vault.encrypt(registry),
                idempotency_key=idempotency_key,
                correlation=correlation,
                # A label for sharing model capacity fairly (CONTRACT section 10), not a
                # boundary of who may see what: the permission model decides that.
                account=account or (person.get_username() if person is not None else ""),
                priority=priority,
                concurrency_key=key,
                created_by=person,
                **(fork.fields() if fork is not None else {}),
            )
            if fork is not None:
                fork.copy_into(run)
            # With a concurrency key and no free slot, the run waits pending: a run of its
            # key that ends admits it.
            if key is None or _admitted(run, key):
                if plan_now:
                    # Plan the first step in the same transaction: its first attempt is
                    # offered on commit.
                    advance_locked(run)
                    if waits:
                        _wait_for_workers(run, waits)
                else:
                    dispatch.advance_on_commit(run.id, priority=priority)
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent start with the same idempotency key won the insert.
        return StartResult(same_key.get(), created=False)
    # The request's trace points to the run's own (runs.tracing), when traced.
    tracing.link_to_run(run.id)
    return StartResult(run, created=True, planned=plan_now)


def _wait_for_workers(run: Run, waits: list[StepHandler]) -> None:
    """Start the wait of the run's first attempts whose handler no live worker serves (the
    start found one that served it within the window). Arming checks liveness again, and is
    idempotent; attempts of other steps, and the steps met later, are armed by the worker
    that hands them back or by the reconciler, as for any attempt."""
    handlers = {step.step_id: step.handler for step in waits}
    now = timezone.now()
    scheduled = run.steps.filter(
        status=StepStatus.SCHEDULED, step_id__in=handlers, waiting_since__isnull=True
    )
    for attempt in scheduled:
        unservable.unservable_arm(
            step_run_id=attempt.id,
            run_id=run.id,
            handler=handlers[attempt.step_id],
            queue=attempt.queue,
            now=now,
        )


def _admitted(run: Run, key: str) -> bool:
    """Admit the key's waiting runs (``run`` just joined them) while it has free slots:
    True when ``run`` is among them. The others admitted (runs of higher priority or that
    came first: a slot freed without admitting them) are sent an advance on commit."""
    now = timezone.now()
    admitted = slots.admit_and_advance(run.workflow_id, key, now=now, skip=run.id)
    if all(other.id != run.id for other in admitted):
        return False
    run.admitted_at = now
    return True


def _locked(run_id: Any, user: AbstractBaseUser | None = None, *, lock: bool = True) -> Run:
    """The run, locked (unless ``lock`` is false: a read that changes nothing), once
    ``user`` may operate it (404 when they may not see it, 403 when they may see but not
    operate it; ``None`` is trusted code)."""
    try:
        run_id = uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    # NO KEY UPDATE, as the engine's advances lock a run: inserts that only reference it (a
    # child's start, an advance request) do not wait behind an operator's action. FOR UPDATE
    # made them wait, and a cancel then deadlocked with its tree's own child starts.
    runs = Run.objects.select_for_update(no_key=True) if lock else Run.objects.all()
    run = runs.filter(id=run_id).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_operate_run(user, run)
    return run


def record_action(
    run_id: Any, action: str, user: AbstractBaseUser | None, detail: Any = None
) -> RunAction:
    """Who did ``action`` to the run, and when: shown on the run (API, admin)."""
    person = user if user is not None and user.is_authenticated else None
    return RunAction.objects.create(
        run_id=run_id,
        action=action,
        actor=person,
        actor_name=person.get_username() if person is not None else "",
        detail=detail,
    )


@transaction.atomic
def run_cancel(
    *,
    run_id: Any,
    reason: str = "cancelled by an operator",
    user: AbstractBaseUser | None = None,
    audit: Mapping[str, Any] | None = None,
) -> Run:
    """Cancel the run and, transitively, its children. Scheduled attempts are cancelled;
    running ones are revoked best-effort and their results will be refused. ``user`` must
    operate the run; its children follow whoever may operate them. ``audit`` is kept with
    the recorded action (a bulk action's id).

    The run itself is cancelled in this transaction; the runs below it are too when their
    tree has started at most ``DJFLOW_CANCEL_INLINE_RUNS``, each unless another
    transaction holds it, and a ``runs.end_tree`` task cancels the rest after commit
    (``run_tree_ending`` then holds). Idempotent: a run already cancelled is left as it
    is (nothing recorded), and its tree's task is asked for again should runs below it
    still be live."""
    run = _locked(run_id, user)
    if run.status == RunStatus.CANCELLED:
        if run_tree_ending(run=run):
            dispatch.end_tree_on_commit(run.root_run_id or run.id)
        return run
    check_run_move(run.status, RunStatus.CANCELLED)
    if user is not None:
        record_action(run.id, "cancel", user, dict(audit) if audit else None)
    # A child cancelled on its own fails its subworkflow step (class cancelled).
    end_run(run, RunStatus.CANCELLED, now=timezone.now(), error=cancelled_error(reason))
    return run


@transaction.atomic
def run_pause(*, run_id: Any, user: AbstractBaseUser | None = None) -> Run:
    """Stop scheduling new steps. Attempts already running finish and are recorded."""
    run = _locked(run_id, user)
    check_run_move(run.status, RunStatus.PAUSED)
    if run.concurrency_key is not None and run.admitted_at is None:
        # Nothing of it runs, and a paused run could not wait its turn: cancel it instead.
        raise IllegalTransition(
            errors=[
                FieldError(
                    "status",
                    "the run waits for a concurrency slot and runs nothing yet: cancel it "
                    "to take it out of the queue",
                )
            ]
        )
    record_action(run.id, "pause", user)
    move_run(run, RunStatus.PAUSED)
    return run


@transaction.atomic
def run_resume(*, run_id: Any, user: AbstractBaseUser | None = None) -> Run:
    run = _locked(run_id, user)
    check_run_move(run.status, RunStatus.RUNNING)
    if run.status != RunStatus.PAUSED:
        # An illegal move is a conflict with the run's state, like every other (409).
        raise IllegalTransition(errors=[FieldError("status", f"a {run.status} run is not paused")])
    record_action(run.id, "resume", user)
    # Should the advance message be lost, the reconciler advances a run this quiet.
    move_run(run, RunStatus.RUNNING)
    RunFault.objects.filter(run_id=run.id).delete()
    dispatch.advance_on_commit(run.id)
    return run


@transaction.atomic
def run_budget_add(*, run_id: Any, add_usd: Decimal, user: AbstractBaseUser | None = None) -> Run:
    """Raise the run's ``limits.max_cost_usd`` by ``add_usd`` (CONTRACT section 17), and offer
    again the attempts of its tree that wait for that limit: the step goes on (or waits
    again, should the top-up still be too small). ``user`` must operate the run; recorded on
    it. A run with no limit of its own, or that has ended, is a 409."""
    run = _locked(run_id, user)
    if run.status in RUN_TERMINAL:
        raise IllegalTransition(
            errors=[FieldError("status", f"a {run.status} run's budget cannot be raised")]
        )
    if costs.limit_of_version(run.version_id) is None:
        root = f" (its root run {run.root_run_id} has one)" if run.root_run_id else ""
        raise Conflict(
            errors=[FieldError("add_usd", f"the run has no limits.max_cost_usd to raise{root}")]
        )
    record_action(run.id, "budget", user, {"add_usd": str(add_usd)})
    Run.objects.filter(id=run.id).update(budget_added_usd=F("budget_added_usd") + add_usd)
    run.refresh_from_db(fields=["budget_added_usd"])
    budgets.release(budgets.waiting_on_run(run))
    return run


@transaction.atomic
def account_save(
    *, name: str, budget_usd: Decimal | None, period: str | None, user: AbstractBaseUser | None
) -> Account:
    """Set account ``name``'s budget and period (``None``/"" a budget in total), making its
    row on first use, and offer again the attempts waiting for it (those that still do not
    fit wait again). The engine's counters are not written here, but for a new row or a
    new period: what the account's runs' attempts that ended in the current period cost
    (calls then in flight are not counted against the budget)."""
    period = period or ""
    now = timezone.now()
    found = Account.objects.select_for_update().filter(name=name).first()
    if found is None:
        start = costs.period_start(period, now)
        spent = _spent_since(name, start)
        Account.objects.bulk_create(
            [Account(name=name, period=period, period_start=start or now, spent_usd=spent)],
            ignore_conflicts=True,
        )
        found = Account.objects.select_for_update().get(name=name)
    changes: dict[str, Any] = {"budget_usd": budget_usd}
    if found.period != period:
        start = costs.period_start(period, now)
        changes.update(
            period=period, period_start=start or now, spent_usd=_spent_since(name, start)
        )
    Account.objects.filter(name=name).update(**changes, updated_at=now)
    record_account_action(name, user, {k: str(v) for k, v in changes.items()})
    budgets.release(budgets.waiting_on_account(name))
    return Account.objects.get(name=name)


def _spent_since(account: str, start: Any) -> Decimal:
    """What the account's attempts that ended since ``start`` (ever, for None) cost."""
    found = StepRun.objects.filter(run__account=account, cost_usd__gt=0)
    if start is not None:
        found = found.filter(finished_at__gte=start)
    total = found.aggregate(total=Sum("cost_usd"))["total"]
    return Decimal(total or 0)


def record_account_action(name: str, user: AbstractBaseUser | None, detail: Any) -> None:
    """Who changed an account's budget: in the log (accounts have no runs to show it on)."""
    who = user.get_username() if user is not None and user.is_authenticated else "-"
    logger.info("account %s budget set by %s: %s", name, who, detail)


@dataclass(frozen=True)
class RetryPreview:
    """What a retry would do, answered by a dry run without changing anything: the step it
    starts from (``restart_at``: a top-level step id), the top-level steps that would run again
    and those whose outputs are kept (document order), and what would change in the run's
    input (``[{"field", "before", "after"}]``, secrets shown as ``••••``) and in the resolved
    input of the steps the retry schedules first (``[{"step", "path", "before", "after"}]``)."""

    generation: int
    restart_at: str | None
    rerun: list[str]
    kept: list[str]
    input_changes: list[dict[str, Any]]
    step_inputs: list[dict[str, Any]]


@transaction.atomic
def run_retry(
    *,
    run_id: Any,
    user: AbstractBaseUser | None = None,
    from_step: str | None = None,
    input: Any = None,
    dry_run: bool = False,
    audit: Mapping[str, Any] | None = None,
) -> Run | RetryPreview:
    """Retry a run; a new generation starts, the old attempts stay in the journal.

    Without ``from_step``: a failed run, from its failed step, keeping what succeeded (the
    failed step gets a fresh attempt budget). With ``from_step`` (any ended run: completed,
    failed, cancelled, timed out): that top-level step (or the one it is inside) and every
    top-level step after it run again, as if for the first time (guards evaluated again);
    the steps before it keep their outputs (``runs.retries``). ``input`` (an object) replaces
    the run's input, checked against the version's ``input_schema``, and templates resolve
    against it from now on; a secret it omits keeps its stored value. Either way the run's
    limits count afresh from now. ``dry_run`` changes nothing and answers what the retry
    would do (:class:`RetryPreview`).

    ``user`` must operate the run (404 when they may not see it, 403 when they may only see
    it); a bad ``from_step`` or ``input`` is a 400 naming it, a run in a status the retry
    does not take a 409. A child run is retried through its parent (409). ``audit`` is
    kept with the recorded action (a bulk action's id).
    """
    errors = []
    if input is not None and not isinstance(input, Mapping):
        errors.append(FieldError("input", f"must be a JSON object, not {_json_name(input)}"))
    if from_step is not None and not isinstance(from_step, str):
        errors.append(FieldError("from_step", "must be a step id (a string)"))
    if errors:
        raise InvalidInput(errors=errors)
    # A dry run writes nothing: it does not hold the run's lock, which would keep the run's
    # workers from recording while it plans.
    run = _locked(run_id, user, lock=not dry_run)
    document = journal.document_of(run.version_id)
    if from_step is not None and from_step not in top_level_ids(document["steps"]):
        message = (
            f"'{echo(from_step)}' is not a step of {run.workflow_id} version {run.version.number}"
        )
        if from_step in journal.steps_of(run.version_id):
            # The handler is no place to start from: it runs again if the run fails again.
            message = (
                f"'{echo(from_step)}' is an on_failure step; retry from one of the run's "
                "steps (the handler runs again should the run fail again)"
            )
        raise InvalidInput(errors=[FieldError("from_step", message)])
    _check_retryable(run, from_step=from_step is not None, edit=input is not None)
    # A retry runs steps again: a version naming a queue its saver may not name now (an
    # engine queue, or one DJFLOW_STEP_QUEUES no longer lists) is refused as its start is.
    refused = version_queue_errors(run.version, document=document)
    if refused:
        raise InvalidInput(errors=refused)
    stored_input, sealed = run.input, run.secrets
    if input is not None:
        stored_input, sealed = _edited_input(run, document, input, user)
    attempts = journal.journal_of(run.id)
    restart = retries.restart_at(document["steps"], attempts, from_step)
    reruns = list(run.reruns or [])
    if from_step is not None and restart is not None:
        reruns.append({"generation": run.generation + 1, "from_step": restart})
    if dry_run:
        rerun, kept = retries.split(document["steps"], attempts, restart)
        return RetryPreview(
            generation=run.generation + 1,
            restart_at=restart,
            rerun=rerun,
            kept=kept,
            # Each value up to DJFLOW_ANSWER_VALUE_BYTES, all of them within
            # DJFLOW_MAX_ANSWER_BYTES (a larger one is {"bytes": n}; /runs/{id}/input has it).
            **_bounded_preview(
                retries.changes(run.input, stored_input),
                _next_inputs(run, document, attempts, stored_input, reruns),
            ),
        )
    detail: dict[str, Any] = {"generation": run.generation + 1}
    if from_step is not None:
        detail |= {"from_step": from_step, "restart_at": restart}
    if input is not None:
        # Kept with its tokens (the API shows them masked), bounded (RETRY_CHANGE_PATHS paths,
        # small values only): what changed. The input each generation runs on is the run's.
        detail |= _recorded_changes(retries.changes(run.input, stored_input, raw=True))
    slot = _retry_slot(run)
    action = record_action(run.id, "retry", user, detail | dict(audit or {}))
    # What the action keeps (at most about RETRY_DETAIL_BYTES) counts towards the run's
    # stored_bytes, as an event's payload does; never refused: a retry is how a run that
    # reached DJFLOW_MAX_RUN_BYTES is taken up again.
    charged = encoded_size(action.detail)
    update_run(run.id, {"stored_bytes": Increment(charged)})
    run.stored_bytes += charged
    move_run(
        run,
        RunStatus.RUNNING,
        **slot,
        generation=run.generation + 1,
        input=stored_input,
        secrets=sealed,
        reruns=reruns,
        error=None,
        output=None,
        finished_at=None,
        started_at=timezone.now(),
        deadline_at=None,  # set by the next advance from the document's limits
    )
    trees.restarted(run)
    # An operator took the run up again: the periodic passes try it at once, not at the end
    # of a back-off its failures earned (runs.engine.isolation).
    RunFault.objects.filter(run_id=run.id).delete()
    dispatch.advance_on_commit(run.id)
    return run


# What a retry's action records of its input's changes (security review, issue 36: eight
# retries each with a new 1,000,000-character topic stored 15 MB of details, uncharged, and
# GET /runs/{id} answered all of it): at most this many changed paths (the rest counted in
# ``input_changes_omitted``), each path at most PATH_CHARS characters, and a value only when
# it is at most RETRY_VALUE_BYTES and the values kept so far stay within RETRY_DETAIL_BYTES;
# another is ``{"bytes": n}`` (its compact JSON size). The run's whole input is its own
# (/runs/{id}/input).
RETRY_CHANGE_PATHS = 20
RETRY_PATH_CHARS = 200
RETRY_VALUE_BYTES = 1024
RETRY_DETAIL_BYTES = 4096
# A dry run answers at most this many changed paths of the input and of each step's input.
PREVIEW_CHANGE_PATHS = 100


def _bounded_changes(
    changes: list[dict[str, Any]],
    sides: tuple[str, ...],
    *,
    paths: int,
    largest: int,
    total: int,
    name: str = "field",
) -> tuple[list[dict[str, Any]], int]:
    """The first ``paths`` of ``changes``, each value of ``sides`` kept when it is at most
    ``largest`` bytes and within ``total`` with those kept before it, else ``{"bytes": n}``;
    and how many changes were left out. ``name``: the key of the path (cut to
    RETRY_PATH_CHARS characters)."""
    bounded, spent = [], 0
    for change in changes[:paths]:
        entry = dict(change)
        where = entry.get(name)
        if isinstance(where, str) and len(where) > RETRY_PATH_CHARS:
            entry[name] = where[:RETRY_PATH_CHARS] + "…"
        for side in sides:
            size = encoded_size(entry.get(side))
            if size <= largest and spent + size <= total:
                spent += size
            else:
                entry[side] = {"bytes": size}
        bounded.append(entry)
    return bounded, max(0, len(changes) - paths)


def _recorded_changes(changes: list[dict[str, Any]]) -> dict[str, Any]:
    """A retry action's ``input_changes`` (and ``input_changes_omitted`` when capped)."""
    kept, omitted = _bounded_changes(
        changes,
        ("before", "after"),
        paths=RETRY_CHANGE_PATHS,
        largest=min(RETRY_VALUE_BYTES, int(settings.DJFLOW["ANSWER_VALUE_BYTES"])),
        total=RETRY_DETAIL_BYTES,
    )
    return {"input_changes": kept} | ({"input_changes_omitted": omitted} if omitted else {})


def _bounded_preview(
    input_changes: list[dict[str, Any]], step_inputs: list[dict[str, Any]]
) -> dict[str, Any]:
    """A dry run's differences within the answer bounds (DJFLOW_ANSWER_VALUE_BYTES a value,
    DJFLOW_MAX_ANSWER_BYTES for all of them), at most PREVIEW_CHANGE_PATHS of each list."""
    largest, total = (
        int(settings.DJFLOW["ANSWER_VALUE_BYTES"]),
        int(settings.DJFLOW["MAX_ANSWER_BYTES"]),
    )
    changes, _ = _bounded_changes(
        input_changes,
        ("before", "after"),
        paths=PREVIEW_CHANGE_PATHS,
        largest=largest,
        total=total // 2,
    )
    steps, _ = _bounded_changes(
        step_inputs,
        ("before", "after"),
        paths=PREVIEW_CHANGE_PATHS,
        largest=largest,
        total=total // 2,
        name="path",
    )
    return {"input_changes": changes, "step_inputs": steps}


def _retry_slot(run: Run) -> dict[str, Any]:
    """A retried run of a workflow with concurrency runs again: it needs a slot of its key
    like a start does, taken now (the run's fields to write), or the retry is a 409 naming
    the key and its holders (retry once one ends). An ended run holds no slot, and waiting
    in the queue is a start's (a retried run keeps its operator's move to ``running``)."""
    if run.concurrency_key is None:
        return {}
    limit = slots.limit_of(journal.document_of(run.version_id))
    refused = limit and slots.refusal(run.workflow_id, run.concurrency_key, limit.limit)
    if refused:
        raise IllegalTransition(
            errors=[
                FieldError(
                    "status",
                    f"no concurrency slot of {slots.key_name(run)} for a retry now: {refused}; "
                    "retry once one is free",
                )
            ]
        )
    return {"admitted_at": timezone.now()}


def _json_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "a number" if isinstance(value, int | float) else type(value).__name__


def _check_retryable(run: Run, *, from_step: bool, edit: bool) -> None:
    """409 unless the run may be retried so: from a step, any ended run; plainly (with or
    without a new input), a failed run. A child run's retry from a step or with a new input
    is its parent's to make (the parent's step holds the child's end)."""
    if (from_step or edit) and run.parent_run_id is not None:
        raise IllegalTransition(
            errors=[
                FieldError(
                    "id",
                    f"run {run.id} is a child run (of run {run.parent_run_id}): retry its "
                    "parent from the step that started it",
                )
            ]
        )
    allowed = RUN_TERMINAL if from_step else {RunStatus.FAILED}
    if run.status not in allowed:
        wanted = (
            "an ended run can be retried from a step"
            if from_step
            else (
                "only a failed run can be retried from its failed step (name from_step to "
                "rerun an ended run)"
            )
        )
        raise IllegalTransition(
            errors=[FieldError("status", f"{wanted}; this one is {run.status}")]
        )
    check_run_move(run.status, RunStatus.RUNNING)


def _edited_input(
    run: Run,
    document: Mapping[str, Any],
    given: Mapping[str, Any],
    user: AbstractBaseUser | None = None,
) -> tuple[Any, str]:
    """The run's new input as it is stored (secrets as tokens) and its sealed secrets; a 400
    naming each field ``input_schema`` refuses.

    An edit that changes the input and keeps a stored secret (omitted, or sent masked) is
    for those who could have the secret anyway: an author of the workflow (its handlers are
    their code) and the run's starter (who gave it). An operator who is neither must give
    each secret again: otherwise editing, say, the address a step sends the secret to would
    hand the operator a value they may never see."""
    schema = document.get("input_schema")
    try:
        registry = vault.decrypt(run.secrets, run_id=run.id)
    except vault.SecretsUnreadable as error:
        # The deployment's key changed: the edit cannot keep the stored secrets.
        raise Conflict(errors=[FieldError("input", str(error))]) from None
    # This request holds the run's secrets until it ends: its logs and error reports mask them.
    secrets.expose(secrets.plaintexts(registry))
    kept: list[str] = []
    plain = (
        retries.merged_input(schema, run.input, given, registry, kept) if schema else dict(given)
    )
    changed = plain != secrets.reveal(run.input, registry)
    if kept and changed and not _may_keep_secrets(user, run):
        raise InvalidInput(
            errors=[
                FieldError(
                    field,
                    "is a secret: give it again to retry with an edited input (only an author "
                    "of the workflow or the run's starter may keep the stored one)",
                )
                for field in kept
            ]
        )
    problems = input_errors(run.version, plain)
    if problems:
        raise InvalidInput(errors=problems)
    # The run's tokens are kept (old attempts, outputs and the journal hold them), and a
    # secret that did not change keeps its token.
    stored, sealed = vault.seal_input(schema, plain, inherited=registry)
    return stored, vault.encrypt(sealed)


def _may_keep_secrets(user: AbstractBaseUser | None, run: Run) -> bool:
    if user is None:  # the engine's own callers, code with the database's rights
        return True
    if run.created_by_id is not None and run.created_by_id == user.pk:
        return True
    return access.may_author(user, run.workflow_id, exists=True)


def _next_inputs(
    run: Run,
    document: Mapping[str, Any],
    attempts: list[Any],
    stored_input: Any,
    reruns: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The resolved inputs of the attempts the retry would schedule first, beside those the
    same steps last ran with, from a plan over the would-be run (pure: nothing is applied).
    Later steps' inputs depend on outputs not made yet: unknowable before they run."""
    view = replace(
        journal.run_view(run, attempts),
        status=RunStatus.RUNNING,
        input=stored_input,
        generation=run.generation + 1,
        started_at=None,
        deadline_at=None,
        reruns=tuple((int(r["generation"]), str(r["from_step"])) for r in reruns),
    )
    planned = plan(document, view, attempts, timezone.now(), journal.planner_settings())
    scheduled = [a for a in planned.of(Schedule) if a.input is not None]
    last = _last_inputs(run, [(a.path, a.step_id) for a in scheduled])
    return [
        {
            "step": action.step_id,
            "path": action.path,
            "before": secrets.shown(last.get((action.path, action.step_id))),
            "after": secrets.shown(action.input),
        }
        for action in scheduled
    ]


def _last_inputs(run: Run, keys: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """The input of the latest attempt of each (path, step id), one query."""
    if not keys:
        return {}
    rows = (
        StepRun.objects.filter(run=run, step_id__in={step for _, step in keys})
        .order_by("path", "step_id", "attempt")
        .values_list("path", "step_id", "input")
    )
    return {(path, step): value for path, step, value in rows}


@transaction.atomic
def step_run_resolve(
    *,
    run_id: Any,
    step_run_id: Any,
    outcome: str,
    output: Any = None,
    user: AbstractBaseUser | None = None,
) -> Run:
    """An operator's answer for an in_doubt attempt (an at_most_once one whose worker was lost
    after it started), after checking its idempotency key with the third party:
    ``succeeded`` with the ``output`` the handler would have returned (the run goes on as if
    the attempt had succeeded), or ``failed`` (class in_doubt: never retried, whatever the
    step's retry policy, since its effect may be half done; the step's on_error applies).
    Recorded on the run (who and when); 409 when the attempt is not in doubt (any more)."""
    run = _locked(run_id, user)
    try:
        row_id = int(step_run_id)
    except (TypeError, ValueError):
        raise NotFound(
            errors=[FieldError("step_run_id", f"'{echo(step_run_id)}' is not a step run id")]
        ) from None
    step_run = StepRun.objects.filter(id=row_id, run=run).first()
    if step_run is None:
        raise NotFound(errors=[FieldError("step_run_id", f"run {run.id} has no step run {row_id}")])
    if step_run.status != StepStatus.IN_DOUBT:
        raise IllegalTransition(
            errors=[
                FieldError(
                    "status", f"step run {row_id} is {step_run.status}, not {StepStatus.IN_DOUBT}"
                )
            ]
        )
    if outcome == StepStatus.SUCCEEDED:
        try:
            check_size(output, MAX_VALUE_BYTES)
        except TooLarge as error:
            message = f"is {error}; a step's output is at most 1 MiB"
            raise InvalidInput(errors=[FieldError("output", message)]) from None
        # As if the attempt had succeeded: the doubt is in the run's actions, not its error.
        fields: dict[str, Any] = {"output": output, "error": None}
    elif outcome == StepStatus.FAILED:
        by = user.get_username() if user is not None and user.is_authenticated else "the system"
        fields = {
            "error": {
                "class": IN_DOUBT,
                "message": f"in doubt since its worker was lost; resolved as failed by {by}",
            }
        }
    else:
        raise InvalidInput(errors=[FieldError("outcome", "must be succeeded or failed")])
    now = timezone.now()
    move_steps(
        StepRun.objects.filter(id=row_id),
        outcome,
        sources=[StepStatus.IN_DOUBT],
        finished_at=now,
        **fields,
    )
    record_action(
        run.id,
        "resolve",
        user,
        {"step_run": row_id, "step_id": step_run.step_id, "outcome": outcome},
    )
    if outcome == StepStatus.SUCCEEDED:
        # What the answer stores counts towards the run's stored_bytes (DJFLOW_MAX_RUN_BYTES),
        # as an attempt's output does; not refused: the operator's answer is how the run
        # goes on, and it is at most 1 MiB.
        update_run(run.id, {"stored_bytes": Increment(encoded_size(output))})
    # Its deadline is moot now; the run plans on from the answer.
    Timer.objects.filter(
        step_run_id=row_id, purpose=TimerPurpose.IN_DOUBT, fired_at__isnull=True
    ).delete()
    dispatch.advance_on_commit(run.id)
    return run


EVENT_NAME_MAX = Event._meta.get_field("name").max_length
EVENT_KEY_MAX = Event._meta.get_field("key").max_length


def event_send(
    *, name: Any, key: Any, payload: Any = None, user: AbstractBaseUser | None = None
) -> tuple[Event, int]:
    """Deliver an event (contract sections 5 and 7): stored, then given to every wait on
    its name and key; returns the event and how many waits it resumed."""
    errors = []
    if not isinstance(name, str) or not name:
        errors.append(FieldError("name", "must be a non-empty string"))
    elif len(name) > EVENT_NAME_MAX:
        errors.append(FieldError("name", f"is longer than {EVENT_NAME_MAX} characters"))
    if not isinstance(key, str):
        errors.append(FieldError("key", "must be a string (the wait's resolved key)"))
    elif len(key) > EVENT_KEY_MAX:
        errors.append(FieldError("key", f"is longer than {EVENT_KEY_MAX} characters"))
    if errors:
        raise InvalidInput(errors=errors)
    # Only waits of runs whose workflow the caller operates (CONTRACT section 8): anyone
    # else's event could otherwise satisfy another team's approval gate.
    workflows = access.operated_workflow_ids(user)
    event, resumed = delivery.deliver(
        name=name, key=key, payload=payload, user=user, workflows=workflows
    )
    for run_id in resumed:
        record_action(run_id, "event", user, {"event": event.id, "name": name})
    return event, len(resumed)
