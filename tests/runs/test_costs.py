"""Cost reservations (runs.engine.costs) and model-call records (runs.engine.calls), on the
real database: a call's worst case is held against max_cost_usd of the run and of its root
before it is made, replaced by the actual cost after, and released by the reconciler when
the attempt ended without settling it."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection

from runs.engine import calls, costs
from runs.engine.reconcile import reconcile
from runs.models import Content, ModelCall, Run, StepRun
from runs.status import StepStatus
from tests.runs.factories import (
    RunFactory,
    StepRunFactory,
    WorkflowVersionFactory,
    support_ticket_document,
)

pytestmark = pytest.mark.django_db


def _run(limit: float | None = 0.10, **run: object) -> Run:
    limits: dict[str, object] = {"run_timeout_ms": 691_200_000}
    if limit is not None:
        limits["max_cost_usd"] = limit
    version = WorkflowVersionFactory(document=support_ticket_document(limits=limits))
    return RunFactory(version=version, **run)


def _attempt(run: Run, **row: object) -> StepRun:
    values = {"status": StepStatus.RUNNING, "step_id": "draft", "kind": "recipe", **row}
    return StepRunFactory(run=run, **values)


def test_a_call_that_fits_is_held_then_settled_to_its_actual_cost() -> None:
    run = _run(0.10)
    attempt = _attempt(run)
    held = costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.04"))
    attempt.refresh_from_db()
    assert attempt.reserved_usd == Decimal("0.04")
    costs.settle(held, actual=Decimal("0.013"))
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert (attempt.reserved_usd, attempt.cost_usd) == (Decimal(0), Decimal("0.013"))
    assert run.cost_usd == Decimal("0.013")


def test_a_call_whose_worst_case_does_not_fit_is_refused_naming_the_limit() -> None:
    run = _run(0.10)
    StepRunFactory(run=run, step_id="classify", cost_usd=Decimal("0.07"))
    attempt = _attempt(run)
    with pytest.raises(costs.OverBudget) as over:
        costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.04"))
    message = str(over.value)
    assert "limits.max_cost_usd (0.1)" in message
    assert "$0.040000" in message and "$0.070000 is spent" in message
    attempt.refresh_from_db()
    assert attempt.reserved_usd == 0  # nothing held for a call not made


def test_what_is_held_counts_until_settled_so_two_calls_cannot_overshoot_together() -> None:
    run = _run(0.10)
    first, second = _attempt(run), _attempt(run, step_id="other")
    costs.reserve(step_run_id=first.id, run_id=run.id, amount=Decimal("0.06"))
    with pytest.raises(costs.OverBudget, match=r"\$0.060000 is reserved"):
        costs.reserve(step_run_id=second.id, run_id=run.id, amount=Decimal("0.06"))


def test_a_run_without_a_limit_holds_and_refuses_nothing() -> None:
    run = _run(None)
    attempt = _attempt(run)
    costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("900"))
    costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=None, what="m")


def test_an_unpriced_model_fits_no_limit() -> None:
    run = _run(0.10)
    attempt = _attempt(run)
    with pytest.raises(costs.OverBudget, match="openai:mystery has no price"):
        costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=None, what="openai:mystery")


def test_a_child_run_is_held_to_its_root_runs_limit_too() -> None:
    root = _run(0.10)
    StepRunFactory(run=root, step_id="classify", cost_usd=Decimal("0.05"))
    child = _run(None, root_run=root, parent_run=root, depth=1)
    attempt = _attempt(child)
    # The child has no limit of its own, but the tree's is its root's.
    with pytest.raises(costs.OverBudget, match=r"its root run's \(.*\) would be exceeded"):
        costs.reserve(step_run_id=attempt.id, run_id=child.id, amount=Decimal("0.06"))
    costs.reserve(step_run_id=attempt.id, run_id=child.id, amount=Decimal("0.05"))
    # The root's own next call now meets what its child holds.
    own = _attempt(root, step_id="send")
    with pytest.raises(costs.OverBudget, match=r"\$0.050000 is reserved"):
        costs.reserve(step_run_id=own.id, run_id=root.id, amount=Decimal("0.01"))


def test_a_retried_run_counts_what_it_spent_afresh() -> None:
    run = _run(0.10, generation=2)
    StepRunFactory(run=run, step_id="classify", generation=1, cost_usd=Decimal("0.09"))
    attempt = _attempt(run)
    costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.09"))


def test_the_reconciler_charges_what_an_ended_attempt_still_holds() -> None:
    """A worker lost during a call: the provider may have answered and billed it, so the
    reservation is charged (its worst case), and the room it held is spent, not freed."""
    run = _run(0.10)
    lost = _attempt(run)
    costs.reserve(step_run_id=lost.id, run_id=run.id, amount=Decimal("0.08"))
    live = _attempt(run, step_id="other")
    with pytest.raises(costs.OverBudget):
        costs.reserve(step_run_id=live.id, run_id=run.id, amount=Decimal("0.05"))
    # The engine gave the attempt up as lost (its lease lapsed): it holds 0.08 still.
    StepRun.objects.filter(id=lost.id).update(status=StepStatus.FAILED)
    assert reconcile()["reservations_released"] == 1
    lost.refresh_from_db()
    run.refresh_from_db()
    assert (lost.reserved_usd, lost.cost_usd, run.cost_usd) == (0, Decimal("0.08"), Decimal("0.08"))
    with pytest.raises(costs.OverBudget, match=r"\$0.080000 is spent"):
        costs.reserve(step_run_id=live.id, run_id=run.id, amount=Decimal("0.05"))
    costs.reserve(step_run_id=live.id, run_id=run.id, amount=Decimal("0.02"))
    # Running attempts keep theirs.
    assert reconcile()["reservations_released"] == 0
    assert StepRun.objects.get(id=live.id).reserved_usd == Decimal("0.02")


def test_a_settle_after_the_release_leaves_nothing_negative() -> None:
    run = _run(0.10)
    attempt = _attempt(run)
    held = costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.05"))
    StepRun.objects.filter(id=attempt.id).update(reserved_usd=0)
    costs.settle(held, actual=Decimal("0.01"))
    attempt.refresh_from_db()
    assert (attempt.reserved_usd, attempt.cost_usd) == (Decimal(0), Decimal("0.01"))


def test_a_call_record_stores_each_prompt_once_by_its_digest() -> None:
    run = _run(None)
    attempt = _attempt(run)
    prompt = {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}
    for text in ("hello", "hello again"):
        held = costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.01"))
        calls.call_record(
            reservation=held,
            call=calls.Call(
                provider="openai",
                model="gpt-4o-mini",
                prompt=prompt,
                reply={"text": text},
                status="ok",
                input_tokens=10,
                output_tokens=3,
                cost_usd=Decimal("0.002"),
            ),
        )
    assert ModelCall.objects.filter(step_run=attempt).count() == 2
    assert Content.objects.filter(digest=calls.digest(prompt)).count() == 1
    # One prompt (its row, its system text, its one message: runs.engine.contents), two replies.
    assert Content.objects.count() == 5
    attempt.refresh_from_db()
    assert (attempt.cost_usd, attempt.reserved_usd) == (Decimal("0.004"), Decimal(0))


@pytest.mark.django_db(transaction=True)
def test_concurrent_reservations_of_one_run_never_overshoot() -> None:
    """Eight threads, each on its own connection, reserve 0.03 against 0.10: exactly three
    fit, whatever the interleaving (the run's row lock makes them take turns)."""
    run = _run(0.10)
    attempts = [_attempt(run, step_id=f"s{i}") for i in range(8)]
    fitted: list[int] = []
    barrier = threading.Barrier(len(attempts))

    def one(attempt: StepRun) -> None:
        try:
            barrier.wait()
            costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.03"))
            fitted.append(attempt.id)
        except costs.OverBudget:
            pass
        finally:
            connection.close()

    threads = [threading.Thread(target=one, args=(a,)) for a in attempts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fitted) == 3
    held = sum(StepRun.objects.filter(run=run).values_list("reserved_usd", flat=True))
    assert held == Decimal("0.09")


def test_a_call_cut_short_is_kept_with_the_attempt_and_charged_its_worst_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The attempt's time limit strikes during the call: the provider may still answer and
    bill it, so the call is kept as interrupted and charged what was reserved, and recording
    the attempt settles it."""
    from celery.exceptions import SoftTimeLimitExceeded

    from workers import providers
    from workers.context import StepContext, bound_logger
    from workers.kinds import recipe as recipe_kind

    run = _run(0.10)
    attempt = _attempt(run)
    ctx = StepContext(
        run_id=str(run.id),
        step_id="draft",
        attempt=1,
        idempotency_key="k",
        workflow_id=run.workflow_id,
        logger=bound_logger(str(run.id), "draft", 1),
        step_run_id=attempt.id,
    )

    def struck(name: str, request: providers.ModelRequest) -> providers.ModelReply:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(providers, "call", struck)
    request = providers.ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(SoftTimeLimitExceeded):
        recipe_kind._reserved_call(ctx, "openai", "openai:m", request, Decimal("0.03"), {})
    [(held, call)] = ctx.model_calls
    assert (call.status, call.cost_usd, held.amount) == (
        "interrupted",
        Decimal("0.03"),
        held.amount,
    )
    assert ctx.cost_usd() == Decimal("0.03") and ctx.uncharged_usd() == 0
    attempt.refresh_from_db()
    assert attempt.reserved_usd == Decimal("0.03")  # held while the call was out
    calls.calls_record(ctx.model_calls)
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert (attempt.reserved_usd, attempt.cost_usd, run.cost_usd) == (
        0,
        Decimal("0.03"),
        Decimal("0.03"),
    )
