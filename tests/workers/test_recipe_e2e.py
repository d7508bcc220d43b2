"""The ``recipe`` step end to end: real worker and beat processes call a local server that
speaks OpenAI's and Anthropic's wire formats (tests/model_server.py) through the official
SDKs, unmocked.

Each test starts its processes once and runs several workflows in turn (process tests are
the suite's dearest), each workflow one behaviour the contract names: a text and a JSON
recipe, a bad JSON reply repaired by the re-ask, 429 with Retry-After honoured, a 400 never
retried, a time-out retried, usage and cost recorded per attempt; cost reserved before the
call; the per-account model concurrency, failing open when its Redis stops; a worker killed
mid-call releasing its reservation and its slot.
"""

from __future__ import annotations

import signal
import time
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings

from runs import services
from runs.engine import contents
from runs.models import ModelCall, Run, StepRun
from tests.model_server import Answer, ModelServer
from tests.processes import wait_for
from tests.runs.test_recovery_e2e import PrivateRedis
from workflows.services import definition_save, recipe_save

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
# Quick recovery for the kill test: a lost lease is noticed within a few seconds.
KNOBS = {
    "DJFLOW_LEASE_SECONDS": "3",
    "DJFLOW_RECONCILE_SECONDS": "2",
    "DJFLOW_LOST_MESSAGE_SECONDS": "2",
    "DJFLOW_DEADLINE_GRACE_SECONDS": "2",
}
QUICK_RETRY = {"max_attempts": 3, "backoff": "fixed", "initial_ms": 100, "jitter": False}


def finished(run_id: Any, logs: Any, timeout: float = 40.0) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def save(workflow_id: str, *steps: dict[str, Any], **limits: Any) -> None:
    definition_save(
        document={
            "id": workflow_id,
            "limits": {"run_timeout_ms": 120_000, **limits},
            "steps": list(steps),
        }
    )


def start(workflow_id: str, input: Any = None, **kwargs: Any) -> Run:
    return services.run_start(workflow=workflow_id, input=input, **kwargs).run


def configured(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    """The providers' variables for the workers and for this process, which starts the
    runs: a start checks that each model's provider is configured (pre-flight)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def attempts(run: Run, step_id: str) -> list[StepRun]:
    return list(run.steps.filter(step_id=step_id).order_by("attempt"))


def test_recipes_on_both_providers_retries_and_records(
    model_server: ModelServer, celery_worker, celery_beat, celery_processes, monkeypatch
) -> None:
    env = configured(monkeypatch, {**model_server.openai_env(), **model_server.anthropic_env()})
    # The AI example too, its steps naming no model: the offline stand-in answers them.
    monkeypatch.setitem(settings.DJFLOW, "DEFAULT_MODEL", "standin:echo")
    celery_worker(
        env={**env, "DJFLOW_DEFAULT_MODEL": "standin:echo"},
        workflow_modules=["workflows.examples.ticket_triage"],
    )
    celery_beat()  # the retries' back-offs are timers
    logs = celery_processes.logs

    # 0. The example: a JSON recipe feeding a condition, a text recipe drafting the reply.
    run = finished(start("ticket_triage", {"ticket": "Export crashes"}).id, logs)
    assert run.status == "completed", run.error
    # The stand-in's JSON is the schema's first choices: a bug, of low urgency.
    assert run.output["kind"] == "bug" and run.output["urgency"] == "low"
    assert run.output["reply"].startswith("[stand-in model]")
    assert [s.step_id for s in run.steps.filter(kind="recipe").order_by("id")] == [
        "classify",
        "draft_bug_reply",
    ]
    assert ModelCall.objects.filter(run=run, provider="standin").count() == 2
    assert model_server.requests == []

    # 1. A text recipe, inline, on OpenAI: the reply, its usage and its cost, per attempt.
    save(
        "rx_text",
        {
            "id": "ask",
            "kind": "recipe",
            "model": "openai:gpt-4o-mini",
            "system": "Be brief.",
            "prompt": "Say hello to ${input.name}.",
            "max_tokens": 50,
        },
    )
    run = finished(start("rx_text", {"name": "Ada"}).id, logs)
    assert run.status == "completed", run.error
    assert run.output == "echo: Say hello to Ada."
    [attempt] = attempts(run, "ask")
    [call] = attempt.model_calls.select_related("prompt", "reply")
    assert (call.provider, call.model, call.status) == ("openai", "gpt-4o-mini", "ok")
    # A prompt is stored as its messages (runs.engine.contents): read back whole.
    assert contents.body(call.prompt) == {
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello to Ada."}],
    }
    assert call.reply.body == {"text": "echo: Say hello to Ada."}
    assert call.input_tokens > 0 and call.output_tokens > 0 and call.latency_ms >= 0
    assert call.cost_usd is not None and call.cost_usd > 0
    assert attempt.cost_usd == call.cost_usd and run.cost_usd == call.cost_usd
    assert attempt.reserved_usd == 0
    assert attempt.usage["input_tokens"] == call.input_tokens
    [sent] = model_server.requests
    assert sent.body["max_tokens"] == 50 or sent.body.get("max_completion_tokens") == 50

    # 2. A named JSON recipe on Anthropic; its first reply is not JSON: asked again once.
    recipe_save(
        document={
            "name": "triage",
            "prompt": "Classify this ticket: ${input.ticket}",
            "model": "anthropic:claude-sonnet-4-5",
            "output": "json",
            "output_schema": {
                "type": "object",
                "required": ["kind"],
                "properties": {"kind": {"enum": ["bug", "question"]}},
            },
        },
        user=None,
    )
    save("rx_json", {"id": "triage", "kind": "recipe", "recipe": "triage"})
    model_server.enqueue(Answer(text="It is a bug, I think."), Answer(json={"kind": "bug"}))
    before = len(model_server.requests)
    run = finished(start("rx_json", {"ticket": "the app crashes"}).id, logs)
    assert run.status == "completed", run.error
    assert run.output == {"kind": "bug"}
    [attempt] = attempts(run, "triage")
    assert attempt.model_calls.count() == 2
    first, again = model_server.requests[before:]
    assert first.api == "anthropic"
    assert [m["role"] for m in again.body["messages"]] == ["user", "assistant", "user"]
    assert "not JSON" in again.last_user_message()

    # 3. Still not the JSON asked for after the re-ask: invalid_output, not retried.
    model_server.enqueue(Answer(json={"kind": "praise"}), Answer(json={"kind": "praise"}))
    run = finished(start("rx_json", {"ticket": "great app"}).id, logs)
    assert run.status == "failed"
    assert run.error["class"] == "invalid_output", run.error
    assert len(attempts(run, "triage")) == 1

    # 4. 429 with Retry-After: 2 s, then an answer: the retry waits the 2 s the server asked
    # for, although the step's own back-off is 100 ms.
    definition_save(
        document={
            "id": "rx_busy",
            "limits": {"run_timeout_ms": 120_000},
            "steps": [
                {
                    "id": "ask",
                    "kind": "recipe",
                    "model": "openai:gpt-4o-mini",
                    "prompt": "hi",
                    "retry": QUICK_RETRY,
                }
            ],
        }
    )
    model_server.enqueue(Answer(status=429, headers={"Retry-After": "2"}))
    before = len(model_server.requests)
    run = finished(start("rx_busy").id, logs)
    assert run.status == "completed", run.error
    refused, answered = model_server.requests[before:]
    assert answered.received_at - refused.received_at >= 2.0
    first, second = attempts(run, "ask")
    assert first.error["class"] == "retryable" and first.error["retry_after_ms"] == 2000
    assert first.model_calls.get().status == "retryable"

    # 5. A 400 is fatal: never retried, whatever the policy.
    model_server.enqueue(Answer(status=400, error_message="no such model, friend"))
    before = len(model_server.requests)
    run = finished(start("rx_busy").id, logs)
    assert run.status == "failed"
    assert run.error["class"] == "fatal" and "no such model, friend" in run.error["message"]
    assert len(model_server.requests) - before == 1

    # 6. A call that hangs past the step's time-out is retried, and the retry answers.
    definition_save(
        document={
            "id": "rx_slow",
            "limits": {"run_timeout_ms": 120_000},
            "steps": [
                {
                    "id": "ask",
                    "kind": "recipe",
                    "model": "anthropic:claude-sonnet-4-5",
                    "prompt": "hi",
                    "timeout_ms": 2500,
                    "retry": QUICK_RETRY,
                }
            ],
        }
    )
    model_server.enqueue(Answer(hang=True))
    run = finished(start("rx_slow").id, logs)
    # What each attempt was, in every assertion's message: this part depends on timing.
    seen = [(a.status, a.error, a.reserved_usd) for a in attempts(run, "ask")]
    assert run.status == "completed", (run.error, seen)
    first, second = attempts(run, "ask")
    assert first.error["class"] in ("retryable", "timeout"), seen
    assert second.status == "succeeded", seen
    # No reservation is left held by any attempt of these runs.
    held = list(StepRun.objects.filter(reserved_usd__gt=0).values("step_id", "status", "error"))
    assert not held, held


def test_cost_is_reserved_before_each_call_and_never_overshot(
    model_server: ModelServer, celery_worker, celery_processes, monkeypatch
) -> None:
    configured(monkeypatch, model_server.openai_env())
    # A made-up model at $1,000 per million tokens: a call of ~40 tokens in and 10 out
    # costs a few cents, and its worst case (~60 tokens) about 6 cents.
    prices = '{"openai:dear": {"input": 1000, "output": 1000}}'
    celery_worker(env={**model_server.openai_env(), "DJFLOW_PRICES": prices}, concurrency=8)
    logs = celery_processes.logs

    # 1. The worst case does not fit: the server never hears of it; under on_budget "fail"
    # (the default waits: tests/runs/test_budgets.py) the run fails naming it.
    save(
        "rx_poor",
        {"id": "ask", "kind": "recipe", "model": "openai:dear", "prompt": "hi", "max_tokens": 500},
        max_cost_usd=0.05,
        on_budget="fail",
    )
    run = finished(start("rx_poor").id, logs)
    assert run.status == "failed"
    assert run.error["class"] == "budget_exceeded", run.error
    assert "limits.max_cost_usd (0.05)" in run.error["message"]
    assert model_server.requests == []

    # 2. Eight slow calls at once against room for about three: never over the limit.
    model_server.default = lambda request: Answer(text="ok", delay_s=0.8, output_tokens=5)
    save(
        "rx_fan",
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.items}",
            "do": {
                "id": "ask",
                "kind": "recipe",
                "model": "openai:dear",
                "prompt": "item ${input}",
                "max_tokens": 10,
                "on_error": "continue",
            },
        },
        max_cost_usd=0.20,
        on_budget="fail",
    )
    run = finished(start("rx_fan", {"items": list(range(8))}).id, logs, timeout=60)
    # The calls that did not fit failed their steps (class budget_exceeded, which their
    # on_error continue passes); those made are recorded when they end, charged to the run.
    assert run.status == "completed", run.error
    made = ModelCall.objects.filter(run=run)
    held = StepRun.objects.filter(run=run, reserved_usd__gt=0)
    # Every reservation settled: each call made was answered and recorded.
    wait_for(lambda: not held.exists() and model_server.in_flight == 0, timeout=20, message=logs)
    assert made.count() == len(model_server.requests)
    worst = max(call.reserved_usd for call in made)
    room = int(Decimal("0.20") / worst)
    assert 1 <= len(model_server.requests) <= room
    assert model_server.max_in_flight <= room
    run.refresh_from_db()
    assert run.cost_usd == sum(call.cost_usd for call in made) <= Decimal("0.20")
    refused = StepRun.objects.filter(run=run, kind="recipe", error__class="budget_exceeded")
    assert refused.exists()


def test_model_calls_per_account_are_capped_and_fail_open_without_redis(
    model_server: ModelServer, celery_worker, celery_processes, tmp_path, monkeypatch
) -> None:
    configured(monkeypatch, model_server.openai_env())
    slots_redis = PrivateRedis(tmp_path)
    slots_redis.start()
    env = {
        **model_server.openai_env(),
        "DJFLOW_MODEL_CONCURRENCY": "3",
        "DJFLOW_MODEL_SLOTS_REDIS_URL": slots_redis.url(0),
        "DJFLOW_MODEL_SLOT_WAIT_SECONDS": "0.5",
    }
    celery_worker(env=env, concurrency=8)
    logs = celery_processes.logs
    model_server.default = lambda request: Answer(text="ok", delay_s=0.5)
    save(
        "rx_many",
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.items}",
            "do": {"id": "ask", "kind": "recipe", "model": "openai:gpt-4o-mini", "prompt": "x"},
        },
    )
    run = finished(start("rx_many", {"items": list(range(30))}).id, logs, timeout=90)
    assert run.status == "completed", run.error
    assert len(model_server.requests) == 30
    assert model_server.max_in_flight == 3
    # Attempts that found every slot taken were handed back, not failed: each item ran one
    # attempt, and the worker said so.
    assert "waits for a model slot" in logs()
    assert all(a.attempt == 1 for a in StepRun.objects.filter(run=run, kind="recipe"))

    # Redis stops mid-run: the calls go on uncounted, and the run completes.
    second = start("rx_many", {"items": list(range(12))})
    model_server.wait_for_requests(33, timeout=30)
    slots_redis.kill()
    run = finished(second.id, logs, timeout=90)
    assert run.status == "completed", run.error
    # The worker said it goes on uncounted (fail-open), naming the account.
    assert "goes ahead without counting it against DJFLOW_MODEL_CONCURRENCY" in logs()


def test_a_worker_killed_mid_call_releases_its_reservation_and_its_slot(
    model_server: ModelServer, celery_worker, celery_beat, celery_processes, monkeypatch
) -> None:
    configured(monkeypatch, model_server.openai_env())
    env = {
        **model_server.openai_env(),
        **KNOBS,
        "DJFLOW_MODEL_CONCURRENCY": "1",
        "DJFLOW_MODEL_SLOT_TTL_SECONDS": "4",
    }
    doomed = celery_worker(env=env, concurrency=1)
    celery_beat(env=KNOBS)
    logs = celery_processes.logs
    save(
        "rx_doomed",
        {"id": "ask", "kind": "recipe", "model": "openai:gpt-4o-mini", "prompt": "x"},
        max_cost_usd=1.0,
    )
    model_server.enqueue(Answer(hang=True))
    run = start("rx_doomed")
    model_server.wait_for_requests(1, timeout=20)
    [held] = StepRun.objects.filter(run=run, step_id="ask")
    assert held.reserved_usd > 0
    doomed.kill(signal.SIGKILL)
    killed_at = time.time()
    celery_worker(env=env, concurrency=1)
    run = finished(run.id, logs, timeout=60)
    assert run.status == "completed", run.error
    lost, _again = attempts(run, "ask")
    assert lost.error["class"] == "lost"
    assert lost.reserved_usd == 0  # released by the reconciler
    # The second call waited for the dead worker's slot to lapse (its TTL), no longer.
    second = model_server.requests[1]
    assert second.received_at - killed_at < 4 + 3 + 2 + 5
    assert not StepRun.objects.filter(reserved_usd__gt=0).exists()


def test_two_runs_of_one_account_race_for_the_last_of_its_budget(
    model_server: ModelServer, celery_worker, celery_processes, monkeypatch
) -> None:
    """Eight runs of one account, on eight worker processes at once, against room for
    three calls in the account's budget: three are made, the rest wait (budget_exceeded)
    and nothing overshoots; raising the budget lets them go on."""
    from runs.models import Account

    configured(monkeypatch, model_server.openai_env())
    prices = '{"openai:dear": {"input": 1000, "output": 1000}}'
    celery_worker(env={**model_server.openai_env(), "DJFLOW_PRICES": prices}, concurrency=8)
    logs = celery_processes.logs
    model_server.default = lambda request: Answer(text="ok", delay_s=0.5, output_tokens=5)
    save(
        "rx_acct",
        {"id": "ask", "kind": "recipe", "model": "openai:dear", "prompt": "hi", "max_tokens": 10},
    )
    # About $0.013 worst case per call: room for three.
    services.account_save(name="team", budget_usd=Decimal("0.045"), period="day", user=None)
    runs = [start("rx_acct", account="team") for _ in range(8)]
    wait_for(
        lambda: (
            Run.objects.filter(id__in=[r.id for r in runs], status="completed").count()
            + Run.objects.filter(id__in=[r.id for r in runs], status="budget_exceeded").count()
            == 8
        ),
        timeout=60,
        message=logs,
    )
    done = Run.objects.filter(id__in=[r.id for r in runs], status="completed").count()
    assert 1 <= done <= 3
    account = Account.objects.get(name="team")
    assert account.reserved_usd == 0
    assert account.spent_usd <= Decimal("0.045")
    assert len(model_server.requests) == done
    waiting = StepRun.objects.filter(run__in=runs, status="scheduled", budget_wait__isnull=False)
    assert waiting.count() == 8 - done

    services.account_save(name="team", budget_usd=Decimal("10"), period="day", user=None)
    for run in runs:
        assert finished(run.id, logs, timeout=60).status == "completed"
    account.refresh_from_db()
    assert account.reserved_usd == 0
    assert account.spent_usd == sum(Run.objects.get(id=r.id).cost_usd for r in runs)
