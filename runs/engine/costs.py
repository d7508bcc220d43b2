"""Cost reservations for model calls (CONTRACT section 10: "Usage and cost").

Before a model call the worker reserves the call's worst case (its prompt's tokens bounded
from above, plus ``max_tokens`` of output, at the model's prices) against ``max_cost_usd`` of
the run and, for a run in a tree (a subworkflow, a body), of its root; after the call the
reservation is replaced by what the call cost. So a limit is never overshot, however many
calls of one tree run at once (LiteLLM's check-then-charge lets concurrent calls overshoot it
together).

Invariants:

- A reservation is held on the attempt's row (``StepRun.reserved_usd``): the rows are the
  ledger, nothing else is. A reservation that fits is written in the transaction that checked
  it, with the run's row (and its root's) locked, so two reservations of one tree take turns
  and the second sees the first. Locks go root first, then the run: the order every other
  writer takes a parent before its children (``ending.py``). With no limit on the run nor
  on its root nothing is checked and nothing written: no check would read it.
- What a run has spent counts its attempts of the current generation (the planner's rule
  for ``max_cost_usd``: a retried run's limits count afresh), and for a root, the attempts
  of the runs below it started since; what it has reserved counts every held reservation,
  also on attempts that have ended, until they are released.
- Settling and charging are additive updates by the row's id, not fenced by the claim: an
  attempt given up meanwhile (timed out, its lease lapsed) still made the call, and what it
  cost is the run's. The worker settles an attempt's calls in the transaction that records
  it (``calls.calls_record``).
- A call cut short (the attempt's time limit struck during it) is charged its worst case: the
  provider may still answer and bill it. A reservation still held when its attempt is
  recorded is released (the worker writes 0); one held by an attempt that ended without
  that (its worker lost during a call) is charged by the reconciler, also at its worst case
  (:func:`release_ended`).
- An account with a budget (an ``Account`` row, CONTRACT section 17) is a limit too: the
  worst case is added to its ``reserved_usd`` by one conditional update that fits it to
  ``budget_usd`` (``spent_usd`` of the current period + ``reserved_usd`` + the call), so two
  calls racing for the last of an account's budget take turns on its row and the second
  sees the first (Postgres re-checks the condition on the row the first committed). The
  attempt's row holds the same amount (the reconciler releases it should the worker be
  lost). Settling adds the cost to ``spent_usd`` and takes the worst case off
  ``reserved_usd``, in the attempt's record. Locks go runs, attempt, then account. An
  account with no row costs one statement that updates nothing and one that finds nothing.
- A period (``day``, ``month``: UTC boundaries) starts afresh at the first reservation or
  settle in it: ``spent_usd`` counts from ``period_start``, moved to the period's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import lru_cache, partial
from typing import Any

from django.db import transaction
from django.db.models import Case, DateTimeField, F, Q, Sum, Value, When
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from ..models import Account, AccountPeriod, Run, StepRun
from ..status import StepStatus
from .isolation import guarded, in_backoff
from .journal import document_of

# The reconciler's release of reservations, as its failures are named (isolation.py).
RELEASE = "reconcile.reservations_released"

ZERO = Decimal(0)
CENT_MILLIONTHS = Decimal("0.000001")


class OverBudget(Exception):
    """The call's worst case does not fit a limit: it must not be made. The message names
    the limit, the worst case and what was spent and reserved. ``wait`` is what an attempt
    waiting for it records (``StepRun.budget_wait``: the limit, whose, the amount asked
    for, the period's end); None when waiting would not help (the model has no price)."""

    def __init__(self, message: str, wait: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.wait = None if wait is None else {**wait, "message": message}


@dataclass(frozen=True)
class Reservation:
    step_run_id: int
    run_id: Any
    amount: Decimal
    # Written on the attempt's row (a limit counts it); a run and root without limits hold
    # nothing there: no check would read it.
    held: bool = True
    # The account whose budget holds it too (its row's reserved_usd), "" for none.
    account: str = field(default="")


def reserve(
    *, step_run_id: int, run_id: Any, amount: Decimal | None, what: str = "the model"
) -> Reservation:
    """Hold ``amount`` for a call the attempt is about to make, or raise OverBudget. None is
    a call whose cost cannot be known (``what`` has no price): it fits no limit, and
    holds nothing where there is none."""
    if amount is not None:
        amount = amount.quantize(CENT_MILLIONTHS)
    row = _tree_of(str(run_id))
    if row is None:
        raise OverBudget(f"run {run_id} does not exist")
    root_id, version_id, root_version_id, account = row
    now = timezone.now()
    if _limit_of(version_id) is None and (
        root_version_id is None or _limit_of(root_version_id) is None
    ):
        # No limit on the run nor on its root (documents never change): no check counts
        # this reservation on the run, so no lock is taken (a step's cost on the path of
        # every call). The amount is kept: a call cut short is charged it.
        with transaction.atomic():
            held = _hold_account(account, step_run_id, amount, now, what=what)
        return Reservation(
            step_run_id, run_id, amount or ZERO, held=held, account=account if held else ""
        )
    with transaction.atomic():
        root = _locked(root_id) if root_id is not None else None
        run = _locked(run_id)
        if run is None:
            raise OverBudget(f"run {run_id} does not exist")
        # The tree's limit (its root's, counting every run of the tree), then a child's own.
        checks = [(run, True, "the run's")]
        if root is not None:
            checks = [(root, True, f"its root run's ({root.id})"), (run, False, "the run's")]
        for limited, tree, whose in checks:
            if amount is None:
                _unpriced(limited, whose, what)
            else:
                _check(limited, amount, tree=tree, whose=whose)
        reservation = _hold(step_run_id, run_id, amount or ZERO)
        if _hold_account(account, step_run_id, amount, now, what=what, on_step=False):
            reservation = Reservation(step_run_id, run_id, reservation.amount, account=account)
        return reservation


@lru_cache(maxsize=1024)
def _tree_of(run_id: str) -> tuple[Any, int, int | None, str] | None:
    """A run's root, the versions of both and its account: they never change, so a worker
    asks once per run, not once per call."""
    row = (
        Run.objects.filter(id=run_id)
        .values_list("root_run_id", "version_id", "root_run__version_id", "account")
        .first()
    )
    return None if row is None else (row[0], row[1], row[2], row[3])


def on_budget(*, run_id: Any) -> str:
    """The run's ``limits.on_budget``: "wait" (the default) or "fail"."""
    row = _tree_of(str(run_id))
    if row is None:
        return "fail"
    limits = document_of(row[1]).get("limits") or {}
    return str(limits.get("on_budget") or "wait")


def period_start(period: str, now: datetime) -> datetime | None:
    """The start of the period ``now`` is in (UTC): midnight, the first of the month; None
    for a budget in total."""
    now = now.astimezone(UTC)
    if period == AccountPeriod.DAY:
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == AccountPeriod.MONTH:
        return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return None


def period_end(period: str, now: datetime) -> datetime | None:
    """When the period ``now`` is in ends (the next one starts), None for none."""
    start = period_start(period, now)
    if start is None:
        return None
    if period == AccountPeriod.DAY:
        return start + timedelta(days=1)
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


def _current_start(now: datetime) -> Any:
    """The row's current period start, as SQL: what ``period_start`` becomes now."""
    day, month = period_start("day", now), period_start("month", now)
    return Greatest(
        F("period_start"),
        Case(
            When(period=AccountPeriod.DAY, then=Value(day)),
            When(period=AccountPeriod.MONTH, then=Value(month)),
            default=F("period_start"),
            output_field=DateTimeField(),
        ),
    )


def _current_spent(now: datetime) -> Any:
    """The row's ``spent_usd`` in the current period, as SQL (0 once a new one began)."""
    return Case(
        When(period_start__lt=_current_start(now), then=Value(ZERO)),
        default=F("spent_usd"),
    )


def _hold_account(
    account: str,
    step_run_id: int,
    amount: Decimal | None,
    now: datetime,
    *,
    what: str,
    on_step: bool = True,
) -> bool:
    """Hold ``amount`` against the account's budget, or raise OverBudget; False when the
    account has no row (no budget: nothing counted). With ``on_step``, the attempt's row
    holds it too (the caller's run limits did not). Call inside a transaction."""
    if not account:
        return False
    rows = Account.objects.filter(name=account)
    asked = amount if amount is not None else ZERO
    fits = Q(budget_usd__isnull=True)
    if amount is not None:
        fits |= Q(budget_usd__gte=_current_spent(now) + F("reserved_usd") + Value(asked))
    moved = rows.filter(fits).update(
        spent_usd=_current_spent(now),
        period_start=_current_start(now),
        reserved_usd=F("reserved_usd") + Value(asked),
    )
    if moved:
        if on_step and asked:
            StepRun.objects.filter(id=step_run_id).update(reserved_usd=F("reserved_usd") + asked)
        return True
    found = rows.first()
    if found is None:
        return False
    if amount is None:
        raise OverBudget(
            f"account {account}'s budget ({found.budget_usd} USD) cannot be kept: {what} has "
            "no price (give it one in DJFLOW_PRICES)"
        )
    start = period_start(found.period, now)
    spent = ZERO if start is not None and found.period_start < start else found.spent_usd
    per = {"day": " a day", "month": " a month"}.get(found.period, "")
    until = period_end(found.period, now)
    raise OverBudget(
        f"account {account}'s budget (${found.budget_usd}{per}) would be exceeded: the "
        f"call's worst case is ${asked}, ${spent} is spent and ${found.reserved_usd} is "
        "reserved by calls in flight",
        wait={
            "limit": "account",
            "account": account,
            "asked_usd": str(asked),
            "until": until.isoformat() if until is not None else None,
        },
    )


def _hold(step_run_id: int, run_id: Any, held: Decimal) -> Reservation:
    if held:
        StepRun.objects.filter(id=step_run_id).update(reserved_usd=F("reserved_usd") + held)
    return Reservation(step_run_id, run_id, held)


def settle(reservation: Reservation, *, actual: Decimal | None) -> None:
    """Replace the reservation by what the call cost (None: nothing known to charge; the
    price table does not know the model, or the call failed before the provider answered)."""
    settle_all([(reservation, actual)])


def settle_all(settled: Sequence[tuple[Reservation, Decimal | None]]) -> None:
    """Settle the calls of one attempt at once: two statements however many calls."""
    if not settled:
        return
    first = settled[0][0]
    charge = sum(((actual or ZERO) for _, actual in settled), ZERO).quantize(CENT_MILLIONTHS)
    held = sum((r.amount for r, _ in settled if r.held), ZERO)
    account = next((r.account for r, _ in settled if r.account), "")
    on_account = sum((r.amount for r, _ in settled if r.account), ZERO)
    # Inside a caller's transaction (the attempt's record) it joins it: a savepoint would
    # cost two round trips and buy nothing, since a failure here fails the caller too.
    with transaction.atomic(savepoint=False):
        # The run row first: the order every advance locks them in.
        if charge:
            Run.objects.filter(id=first.run_id).update(cost_usd=F("cost_usd") + charge)
        if charge or held:
            StepRun.objects.filter(id=first.step_run_id).update(
                # Never below zero: the reconciler may have charged it already (the
                # attempt was given up as lost while the call went on).
                reserved_usd=Greatest(F("reserved_usd") - held, Value(ZERO)),
                cost_usd=F("cost_usd") + charge,
            )
        if account:
            _charge_account(account, charge, on_account)


def _charge_account(account: str, charge: Decimal, held: Decimal) -> None:
    """The account's ledger: what a call cost is spent (in the current period), what it
    held released. Additive, never below zero (the reconciler may have charged it)."""
    now = timezone.now()
    Account.objects.filter(name=account).update(
        spent_usd=_current_spent(now) + Value(charge),
        period_start=_current_start(now),
        reserved_usd=Greatest(F("reserved_usd") - Value(held), Value(ZERO)),
    )


def release_ended(batch: int) -> int:
    """Settle the reservations still held by attempts that have ended (their worker was lost
    during a call): the reconciler's part. The call may have been answered, and billed, after
    its worker died, so what was reserved is charged, its worst case: a limit is kept, never
    overshot by a retry reserving into room the lost call used. Returns how many attempts it
    settled."""
    found = StepRun.objects.filter(reserved_usd__gt=0).exclude(in_backoff(RELEASE, timezone.now()))
    rows = list(_ended(found)[:batch])
    # Each attempt on its own: one that fails is logged, counted and marked (isolation.py).
    return sum(
        guarded(RELEASE, run_id, partial(_settle_one, step_run_id, run_id, held), failed=0)
        for step_run_id, run_id, held in rows
    )


def release_expired(step_run_ids: Sequence[int]) -> int:
    """``release_ended`` for attempts the engine just gave up (their lease lapsed, their
    deadline passed), in the transaction that gave them up: the run goes on (a retry may
    reserve) with what the lost call may have cost already charged, as the reconciler
    charged it when it was the one that found the lapsed lease."""
    return _settle(StepRun.objects.filter(id__in=step_run_ids, reserved_usd__gt=0), None)


def _ended(found: Any) -> Any:
    return found.exclude(status__in=[StepStatus.RUNNING, StepStatus.SCHEDULED]).values_list(
        "id", "run_id", "reserved_usd"
    )


def _settle(found: Any, batch: int | None) -> int:
    ended = _ended(found)
    rows = list(ended[:batch] if batch is not None else ended)
    return sum(_settle_one(step_run_id, run_id, held) for step_run_id, run_id, held in rows)


def _settle_one(step_run_id: int, run_id: Any, held: Decimal) -> int:
    with transaction.atomic():
        # Conditional on the amount read: a settle that came meanwhile is not charged twice.
        moved = StepRun.objects.filter(id=step_run_id, reserved_usd=held).update(
            reserved_usd=ZERO, cost_usd=F("cost_usd") + held
        )
        if moved:
            Run.objects.filter(id=run_id).update(cost_usd=F("cost_usd") + held)
            # The account's hold too, when the account has a budget (an account row): the
            # attempt's row held the same amount.
            account = Run.objects.filter(id=run_id).values_list("account", flat=True).first()
            if account:
                _charge_account(account, held, held)
    return moved


def _locked(run_id: Any) -> Run | None:
    return (
        Run.objects.select_for_update()
        .only(
            "id",
            "version_id",
            "body",
            "generation",
            "started_at",
            "root_run_id",
            "budget_added_usd",
        )
        .filter(id=run_id)
        .first()
    )


def _check(run: Run, amount: Decimal, *, tree: bool, whose: str) -> None:
    limit = _limit(run)
    if limit is None:
        return
    own = Q(run_id=run.id)
    spent_in = own & Q(generation=run.generation)
    runs = own
    if tree:
        below = Q(run__root_run_id=run.id)
        runs = own | below
        # The runs below it started in the root's current generation (a retried root's
        # limits count afresh, as its own attempts do).
        if run.started_at is not None:
            below &= Q(run__created_at__gte=run.started_at)
        spent_in |= below
    spent = _sum("cost_usd", spent_in)
    held = _sum("reserved_usd", runs)
    if spent + held + amount <= limit:
        return
    raise OverBudget(
        f"limits.max_cost_usd ({limit}) of {whose} would be exceeded: the call's worst case is "
        f"${amount}, ${spent} is spent and ${held} is reserved by calls in flight",
        wait={"limit": "run", "run": str(run.id), "asked_usd": str(amount), "until": None},
    )


def _unpriced(run: Run, whose: str, what: str) -> None:
    limit = _limit(run)
    if limit is not None:
        raise OverBudget(
            f"limits.max_cost_usd ({limit}) of {whose} cannot be kept: {what} has no price "
            "(give it one in DJFLOW_PRICES)"
        )


def _limit(run: Run) -> Decimal | None:
    """The run's limits.max_cost_usd, plus what operators added (POST /runs/{id}/budget)."""
    limit = _limit_of(run.version_id)
    return None if limit is None else limit + (run.budget_added_usd or ZERO)


def limit_of_version(version_id: int) -> Decimal | None:
    """A version's limits.max_cost_usd (documents never change: cached per process)."""
    return _limit_of(version_id)


def _limit_of(version_id: int) -> Decimal | None:
    limits = document_of(version_id).get("limits") or {}
    value = limits.get("max_cost_usd")
    return None if value is None else Decimal(str(value))


def _sum(column: str, where: Q) -> Decimal:
    total = StepRun.objects.filter(where).aggregate(total=Coalesce(Sum(column), ZERO))["total"]
    return Decimal(total)
