"""Concurrency keys and priority (CONTRACT section 13; runs.engine.slots) on the real
database: who waits, who is admitted when a run ends, in which order, what the run says, the
reconciler's re-check, and two starts at once racing for the last slot."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from runs import services
from runs.engine import slots
from runs.engine.advance import run_advance
from runs.engine.reconcile import reconcile
from runs.models import ConcurrencyGate, Run
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


def per_customer(limit: int = 2, **changes: Any) -> dict[str, Any]:
    """Runs that hold their slot while they wait for an event named by their own id."""
    document = {
        "id": "per_customer",
        "concurrency": {"key": "${input.customer}", "limit": limit},
        "steps": [{"id": "hold", "kind": "wait_event", "event": "go", "key": "${input.n}"}],
    }
    document.update(changes)
    return document


def start(customer: str, n: str, **kwargs: Any) -> Run:
    run = services.run_start(
        workflow="per_customer", input={"customer": customer, "n": n}, **kwargs
    ).run
    run.refresh_from_db()
    return run


def admitted(run: Run) -> bool:
    run.refresh_from_db()
    return run.admitted_at is not None


def test_runs_over_the_limit_wait_pending_with_nothing_planned_and_say_why(
    api: APIClient,
) -> None:
    definition_save(document=per_customer(limit=2))
    first, second, third = (start("acme", str(n)) for n in range(3))
    other = start("globex", "9")
    assert [r.status for r in (first, second, third, other)] == [
        "waiting",
        "waiting",
        "pending",
        "waiting",
    ]
    assert third.concurrency_key == "acme" and third.admitted_at is None
    assert not third.steps.exists()
    shown = api.get(f"/api/v1/runs/{third.id}").json()
    assert shown["status"] == "pending"
    assert shown["reason"] == "waiting for a concurrency slot of key 'acme' (2 of 2 running)"
    assert shown["concurrency_key"] == "acme"
    # A run that holds its slot says nothing of the sort.
    assert api.get(f"/api/v1/runs/{first.id}").json()["reason"] is None
    # An advance of a waiting run (a stray message) plans nothing.
    run_advance(run_id=third.id)
    third.refresh_from_db()
    assert third.status == "pending" and not third.steps.exists()


def test_a_limit_without_a_key_is_one_per_workflow(api: APIClient) -> None:
    definition_save(document=per_customer(limit=1, concurrency={"limit": 1}))
    first, second = start("acme", "1"), start("globex", "2")
    assert (first.status, second.status) == ("waiting", "pending")
    assert second.concurrency_key == ""
    reason = api.get(f"/api/v1/runs/{second.id}").json()["reason"]
    assert reason == "waiting for a concurrency slot of workflow per_customer (1 of 1 running)"


def test_an_end_admits_the_highest_priority_then_the_first_come(
    django_capture_on_commit_callbacks,
) -> None:
    definition_save(document=per_customer(limit=1))
    holder = start("acme", "0")
    waiting = {
        "a5": start("acme", "a5", priority=5),
        "b9": start("acme", "b9", priority=9),
        "c5": start("acme", "c5", priority=5),
        "d0": start("acme", "d0", priority=0),
        "e9": start("acme", "e9", priority=9),
    }
    assert not any(admitted(run) for run in waiting.values())
    order = []
    current = holder
    for _ in waiting:
        with (
            mock.patch.object(slots.dispatch, "advance_on_commit") as advance,
            django_capture_on_commit_callbacks(execute=True),
        ):
            services.run_cancel(run_id=current.id)
        nxt = [name for name, run in waiting.items() if name not in order and admitted(run)]
        assert len(nxt) == 1, nxt  # one slot freed, one run admitted
        order.append(nxt[0])
        current = waiting[nxt[0]]
        # Sent its advance, at its priority.
        advance.assert_called_once_with(current.id, priority=current.priority)
    assert order == ["b9", "e9", "a5", "c5", "d0"]


def test_every_end_frees_the_slot_and_the_admitted_run_starts() -> None:
    """A run that completes (an event ends its wait) admits the next; that run's advance
    plans its first step."""
    definition_save(document=per_customer(limit=1))
    first, second = start("acme", "1"), start("acme", "2")
    assert second.status == "pending"
    services.event_send(name="go", key="1", payload={"ok": True})
    first.refresh_from_db()
    assert first.status == "completed"
    assert admitted(second)
    run_advance(run_id=second.id)  # the message sent on commit
    second.refresh_from_db()
    assert second.status == "waiting" and second.steps.get().step_id == "hold"


def test_an_admitted_run_whose_advance_message_was_lost_is_advanced_by_the_reconciler() -> None:
    definition_save(document=per_customer(limit=1))
    holder, waiting = start("acme", "0"), start("acme", "1")
    # The end admits the waiting run in its transaction; its advance message never arrives
    # (on-commit callbacks do not run in this test's transaction).
    services.run_cancel(run_id=holder.id)
    assert admitted(waiting) and waiting.status == "pending" and not waiting.steps.exists()
    Run.objects.filter(id=waiting.id).update(updated_at=timezone.now() - timedelta(hours=1))
    reconcile(budget_seconds=30)
    waiting.refresh_from_db()
    assert waiting.status == "waiting" and waiting.steps.get().step_id == "hold"


def test_a_cancelled_waiting_run_leaves_the_queue_and_frees_nothing() -> None:
    definition_save(document=per_customer(limit=1))
    holder, first, second = start("acme", "0"), start("acme", "1"), start("acme", "2")
    services.run_cancel(run_id=first.id)
    assert not admitted(second)
    services.run_cancel(run_id=holder.id)
    assert admitted(second)
    first.refresh_from_db()
    assert first.status == "cancelled" and first.admitted_at is None


def test_a_waiting_run_cannot_be_paused(api: APIClient) -> None:
    definition_save(document=per_customer(limit=1))
    start("acme", "0")
    waiting = start("acme", "1")
    response = api.post(f"/api/v1/runs/{waiting.id}/pause")
    assert response.status_code == 409
    assert "concurrency slot" in response.json()["errors"][0]["message"]


def test_a_retry_takes_a_slot_like_a_start_or_is_refused(api: APIClient) -> None:
    definition_save(document=per_customer(limit=1))
    ended = start("acme", "0")
    services.run_cancel(run_id=ended.id)

    def retry() -> Any:
        return api.post(f"/api/v1/runs/{ended.id}/retry", {"from_step": "hold"}, format="json")

    holder = start("acme", "1")
    response = retry()
    assert response.status_code == 409
    assert response.json()["errors"] == [
        {
            "field": "status",
            "message": "no concurrency slot of key 'acme' for a retry now: every slot is "
            "taken (1 of 1 running); retry once one is free",
        }
    ]
    # A free slot with runs waiting is theirs (a slot freed without its end's admission).
    queued = start("acme", "2")
    Run.objects.filter(id=holder.id).update(status="cancelled")
    response = retry()
    assert response.status_code == 409
    assert "1 run(s) wait for a slot and go first (0 of 1 running)" in str(response.json())
    reconcile(budget_seconds=30)
    assert admitted(queued)
    services.run_cancel(run_id=queued.id)
    response = retry()
    assert response.status_code == 200, response.json()
    assert slots.holders("per_customer", "acme") == 1
    # The retried run holds the slot: the next start waits.
    assert start("acme", "3").status == "pending"


def test_the_reconciler_admits_a_run_left_waiting_beside_a_free_slot_and_leaves_others() -> None:
    definition_save(document=per_customer(limit=1))
    holder, waiting = start("acme", "0"), start("acme", "1")
    full = start("globex", "0")
    queued = start("globex", "1")
    old = timezone.now() - timedelta(hours=1)
    Run.objects.filter(id__in=[waiting.id, queued.id]).update(updated_at=old)
    # The reconciler's look for stuck runs leaves quiet waiting runs alone.
    counts = reconcile(budget_seconds=30)
    assert counts["admitted"] == 0
    assert not admitted(waiting) and not admitted(queued)
    waiting.refresh_from_db()
    assert not waiting.steps.exists()
    # A slot freed without its end's admission (as a document's raised limit would leave).
    Run.objects.filter(id=holder.id).update(status="cancelled")
    with mock.patch.object(slots.dispatch, "advance_on_commit") as advance:
        counts = reconcile(budget_seconds=30)
    assert counts["admitted"] == 1
    assert admitted(waiting) and not admitted(queued)
    advance.assert_called_once_with(waiting.id, priority=5)
    assert full.admitted_at is not None


def test_the_reconcilers_pass_serves_the_keys_in_turn_longest_unserved_first() -> None:
    """Round robin: each key gets one admission per round, the key whose turn came longest
    ago first, so a key with a long queue does not take the whole batch."""
    version = definition_save(document=per_customer(limit=5)).version
    # Runs left waiting with free slots (as an end that failed to admit would leave them).
    made = timezone.now()
    names: dict[Any, str] = {}
    for key, count in (("a", 4), ("b", 2), ("c", 2)):
        for n in range(count):
            run = Run.objects.create(
                workflow_id="per_customer",
                version=version,
                input={"customer": key, "n": str(n)},
                concurrency_key=key,
                created_at=made + timedelta(seconds=n),
            )
            names[run.id] = f"{key}{n}"
    now = timezone.now()
    gate = ConcurrencyGate.objects.create
    gate(workflow_id="per_customer", key="a", waiting=True, turn_at=now - timedelta(days=1))
    gate(workflow_id="per_customer", key="b", waiting=True, turn_at=now - timedelta(seconds=1))
    gate(workflow_id="per_customer", key="c", waiting=True, turn_at=now - timedelta(hours=1))
    # A key whose runs all started is not visited.
    gate(workflow_id="per_customer", key="idle", waiting=False)
    with mock.patch.object(slots.dispatch, "advance_on_commit") as advance:
        assert slots.admit_waiting(now, batch=6) == 6
    order = [names[call.args[0]] for call in advance.call_args_list]
    # a (a day ago), then c (an hour ago), then b (a second ago); round after round.
    assert order == ["a0", "c0", "b0", "a1", "c1", "b1"]
    gates = {g.key: g for g in ConcurrencyGate.objects.all()}
    assert all(gates[key].turn_at == now for key in "abc")
    # a still has runs waiting; b and c have none left.
    assert [gates[key].waiting for key in ("a", "b", "c", "idle")] == [True, False, False, False]


def test_the_reconcilers_pass_visits_keys_in_turn_even_when_their_slots_stay_taken() -> None:
    """Keys whose slots stay taken have their turn too, and go to the back: a later pass
    visits the keys after them, so a pass's batch never sticks on the same full keys."""
    definition_save(document=per_customer(limit=1))
    for key in ("a", "b", "c"):
        start(key, "0")
        start(key, "1")  # waits: the key's one slot is taken
    now = timezone.now()
    with mock.patch.object(slots.dispatch, "advance_on_commit") as advance:
        assert slots.admit_waiting(now, batch=2) == 0
        first = set(ConcurrencyGate.objects.filter(turn_at=now).values_list("key", flat=True))
        later = now + timedelta(seconds=30)
        assert slots.admit_waiting(later, batch=2) == 0
        second = set(ConcurrencyGate.objects.filter(turn_at=later).values_list("key", flat=True))
    advance.assert_not_called()
    assert len(first) == 2 and (set("abc") - first) <= second


def test_a_key_is_text_and_a_long_one_keeps_its_digest() -> None:
    limit = slots.Limit(key="${input.customer}", limit=1)
    assert slots.key_for(limit, {"customer": 42}) == "42"
    assert slots.key_for(limit, {}) == ""
    assert slots.key_for(slots.Limit(key="t-${input.a}-${input.b}", limit=1), {"a": "x"}) == "t-x-"
    long_a, long_b = (
        slots.key_for(limit, {"customer": "x" * 400 + "a"}),
        slots.key_for(limit, {"customer": "x" * 400 + "b"}),
    )
    assert len(long_a) == slots.KEY_MAX and long_a != long_b


def test_a_key_that_would_render_over_a_mib_is_a_400_naming_it_not_a_500(
    api: APIClient,
) -> None:
    # The key's template may read the input many times: an input within the body's limit
    # rendered over the template's 1 MiB bound (a TooLarge that reached the view as a 500).
    definition_save(document=per_customer(concurrency={"key": "${input.customer}" * 4, "limit": 1}))
    body = {"workflow": "per_customer", "input": {"customer": "x" * 300_000, "n": "1"}}
    answer = api.post("/api/v1/runs", body, format="json")
    assert answer.status_code == 400, answer.content[:300]
    assert [e["field"] for e in answer.json()["errors"]] == ["input"]
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_starts_at_once_never_both_take_the_last_slot() -> None:
    """The race: one start holds the key's gate in an open transaction; a second start at
    the same moment waits for that lock, then counts the first's run and waits pending.
    Neither transaction can admit past the limit, whichever commits first."""
    definition_save(document=per_customer(limit=1))
    # The key's gate exists (a key seen before): its row lock, not the insert of a new
    # gate, is what the second start waits for.
    ConcurrencyGate.objects.create(workflow_id="per_customer", key="acme")
    inside = threading.Event()
    release = threading.Event()
    results: dict[str, Any] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                results["first"] = start("acme", "1").id
                inside.set()
                release.wait(10)
        finally:
            connection.close()

    def second() -> None:
        try:
            inside.wait(10)
            results["second"] = start("acme", "2").id
            results["second_done"] = timezone.now()
        finally:
            connection.close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert inside.wait(10)
    # The second start is blocked on the gate's row lock while the first is uncommitted.
    threads[1].join(1.0)
    assert threads[1].is_alive(), "the second start did not wait for the first's lock"
    released = timezone.now()
    release.set()
    for thread in threads:
        thread.join(10)
    assert results["second_done"] >= released
    runs = {name: Run.objects.get(id=results[name]) for name in ("first", "second")}
    assert runs["first"].admitted_at is not None and runs["first"].status == "waiting"
    assert runs["second"].admitted_at is None and runs["second"].status == "pending"
    assert slots.holders("per_customer", "acme") == 1


@pytest.mark.django_db(transaction=True)
def test_many_starts_at_once_admit_exactly_the_limit() -> None:
    """Eight starts in eight threads for a limit of 3: exactly three hold slots."""
    definition_save(document=per_customer(limit=3))
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def go(n: int) -> None:
        try:
            barrier.wait(10)
            start("acme", str(n))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=go, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert Run.objects.filter(admitted_at__isnull=False).count() == 3
    assert Run.objects.filter(admitted_at__isnull=True, status="pending").count() == 5


# --- priority on POST /runs ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [10, -1, "5", True, 1.5, [5]])
def test_a_priority_out_of_range_or_not_an_integer_is_a_400_naming_it(
    api: APIClient, bad: Any
) -> None:
    definition_save(document=per_customer())
    response = api.post(
        "/api/v1/runs",
        {"workflow": "per_customer", "input": {"customer": "a", "n": "1"}, "priority": bad},
        format="json",
    )
    assert response.status_code == 400
    assert [error["field"] for error in response.json()["errors"]] == ["priority"]
    assert not Run.objects.exists()


def test_the_service_refuses_a_bad_priority_too() -> None:
    definition_save(document=per_customer())
    with pytest.raises(services.InvalidInput) as caught:
        start("acme", "1", priority=12)
    assert caught.value.errors[0].field == "priority"


def test_a_priority_is_stored_shown_and_sent_with_the_runs_messages(
    api: APIClient, django_capture_on_commit_callbacks
) -> None:
    """The first step's offer carries the broker's priority for the run's (9: Redis's 0)."""
    from celery.canvas import Signature

    from runs import dispatch

    definition_save(
        document={
            "id": "urgent",
            "steps": [{"id": "work", "kind": "task", "handler": "urgent.work"}],
        }
    )
    with (
        mock.patch.object(Signature, "apply_async", autospec=True) as sent,
        django_capture_on_commit_callbacks(execute=True),
    ):
        response = api.post(
            "/api/v1/runs", {"workflow": "urgent", "input": {}, "priority": 9}, format="json"
        )
        default = api.post("/api/v1/runs", {"workflow": "urgent", "input": {}}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["priority"] == 9 and default.json()["priority"] == 5
    priorities = [call.args[0].options.get("priority") for call in sent.call_args_list]
    assert priorities == [dispatch.broker_priority(9), dispatch.broker_priority(5)]
    assert Run.objects.get(id=response.json()["id"]).priority == 9


# --- validation at save ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("concurrency", "field", "words"),
    [
        ({"key": "${input.customer}", "limit": 0}, "concurrency.limit", "at least 1; got 0"),
        ({"key": "${input.customer}", "limit": 10001}, "concurrency.limit", "at most 10000"),
        ({"key": "${input.customer}"}, "concurrency.limit", "missing"),
        ({"limit": 2, "max": 3}, "concurrency.max", "unknown field"),
        ({"key": "${steps.hold.output}", "limit": 2}, "concurrency.key", "only the run's input"),
        ({"key": "${run.id}", "limit": 2}, "concurrency.key", "only the run's input"),
        ({"key": "${input.customer", "limit": 2}, "concurrency.key", "unclosed reference"),
        ({"key": "${input.nobody}", "limit": 2}, "concurrency.key", "input_schema"),
        ({"key": "", "limit": 2}, "concurrency.key", "non-empty"),
    ],
)
def test_a_bad_concurrency_is_a_400_naming_the_field(
    api: APIClient, concurrency: Any, field: str, words: str
) -> None:
    document = per_customer(
        concurrency=concurrency,
        input_schema={
            "type": "object",
            "properties": {"customer": {"type": "string"}, "n": {"type": "string"}},
            "additionalProperties": False,
        },
    )
    response = api.post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400, response.json()
    errors = response.json()["errors"]
    assert [error["field"] for error in errors] == [field], errors
    assert words in errors[0]["message"]


def test_the_builder_writes_concurrency_and_starts_with_a_priority() -> None:
    from workflows.sdk import workflow

    built = workflow("built_limited", concurrency={"key": "${input.customer}", "limit": 3})
    built.wait_for("hold", event="go", key="${input.customer}")
    assert built.document()["concurrency"] == {"key": "${input.customer}", "limit": 3}
    run = built.start({"customer": "acme"}, priority=7)
    run.refresh_from_db()
    assert (run.priority, run.concurrency_key, run.status) == (7, "acme", "waiting")


def test_the_admin_shows_why_a_run_waits(admin_user, client) -> None:
    definition_save(document=per_customer(limit=1))
    start("acme", "0")
    waiting = start("acme", "1", priority=7)
    client.force_login(admin_user)
    page = client.get(f"/admin/runs/run/{waiting.id}/change/").content.decode()
    assert "waiting for a concurrency slot of key &#x27;acme&#x27; (1 of 1 running)" in page


def test_the_runs_waiting_for_a_slot_are_a_gauge_by_workflow(settings) -> None:
    from django.test import Client

    from tests.scrape import samples

    settings.DJFLOW_METRICS_TOKEN = "t0k3n-for-the-slot-gauge"
    definition_save(document=per_customer(limit=1))
    for n in range(4):
        start("acme", str(n))
    start("globex", "0")
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t0k3n-for-the-slot-gauge")
    found = samples(response.content)
    assert found[("djflow_runs_waiting_for_slot", (("workflow", "per_customer"),))] == 3


def test_the_inspector_shows_why_a_run_waits_and_offers_no_pause(client, user) -> None:
    definition_save(document=per_customer(limit=1))
    start("acme", "0")
    waiting = start("acme", "1")
    client.force_login(user)
    page = client.get(f"/runs/{waiting.id}/").content.decode()
    assert "waiting for a concurrency slot of key &#x27;acme&#x27; (1 of 1 running)" in page
    assert 'id="run-queued"' in page
    assert "/pause" not in page and "/cancel" in page
