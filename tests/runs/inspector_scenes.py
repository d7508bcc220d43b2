"""Runs for the inspector's tests, built straight into the tables in the state each test needs
(no worker): a finished run with a condition and parallel branches, a failed run whose step
was retried (with model calls whose prompts changed), a foreach of 50 items, and a run of
many attempts."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone

from runs.engine import calls
from runs.models import Content, ModelCall, Run, StepRun
from runs.status import RunStatus, StepStatus
from workflows.services import definition_save

from ..moves import unchecked
from .factories import RunFactory, StepRunFactory

BRANCHY = {
    "id": "ticket_flow",
    "steps": [
        {"id": "classify", "kind": "task"},
        {
            "id": "route",
            "kind": "condition",
            "if": {"path": "steps.classify.output.kind", "op": "eq", "value": "bug"},
            "then": [{"id": "triage", "kind": "task"}],
            "else": [{"id": "answer", "kind": "task"}],
        },
        {
            "id": "notify",
            "kind": "parallel",
            "branches": {
                "mail": {"id": "mail", "kind": "task"},
                "chat": {"id": "chat", "kind": "task"},
            },
        },
        {"id": "close", "kind": "task"},
    ],
}

RETRIED = {
    "id": "drafting",
    "steps": [
        {"id": "fetch", "kind": "task"},
        {
            "id": "draft",
            "kind": "task",
            "retry": {"max_attempts": 3, "backoff": "fixed", "initial_ms": 1000},
        },
        {"id": "publish", "kind": "task"},
    ],
}

FANOUT = {
    "id": "fanout",
    "steps": [
        {"id": "load", "kind": "task"},
        {
            "id": "each",
            "kind": "foreach",
            "items": "${steps.load.output.items}",
            "do": {"id": "work", "kind": "task"},
            "on_error": "continue",
        },
        {"id": "report", "kind": "task"},
    ],
}


def saved(document: dict[str, Any]) -> Any:
    return definition_save(document=document).version


def _attempt(run: Run, step_id: str, start: datetime, ms: int, **fields: Any) -> StepRun:
    """An attempt queued at ``start`` for 40 ms that ran ``ms``."""
    started = start + timedelta(milliseconds=40)
    status = fields.pop("status", StepStatus.SUCCEEDED)
    values: dict[str, Any] = {
        "run": run,
        "step_id": step_id,
        "status": status,
        "scheduled_at": start,
        "started_at": started,
        "finished_at": started + timedelta(milliseconds=ms),
        "worker": "celery@worker-1",
        "input": {"ticket": "T-1"},
        "output": {"ok": True} if status == StepStatus.SUCCEEDED else None,
    }
    values.update(fields)
    return StepRunFactory(**values)


def finished_run(**run_fields: Any) -> Run:
    """Completed: classify → route (else: answer) → notify (mail, chat) → close."""
    start = timezone.now() - timedelta(seconds=20)
    run = RunFactory(
        version=saved(BRANCHY),
        status=RunStatus.COMPLETED,
        created_at=start,
        started_at=start,
        finished_at=start + timedelta(seconds=6),
        input={"ticket": "T-1"},
        output={"closed": True},
        **run_fields,
    )
    _attempt(run, "classify", start, 900, output={"kind": "question"})
    t = start + timedelta(seconds=1)
    _attempt(run, "route", t, 2600, kind="condition", branch="else", output={"sent": 1})
    _attempt(run, "answer", t + timedelta(milliseconds=50), 2400, output={"text": "Try again"})
    t += timedelta(seconds=2.8)
    _attempt(run, "notify", t, 1500, kind="parallel", output={"mail": 1, "chat": 1})
    _attempt(run, "mail", t, 1200, path="notify[mail]/")
    _attempt(run, "chat", t, 700, path="notify[chat]/")
    _attempt(run, "close", t + timedelta(seconds=1.6), 300)
    return run


PROMPT = "Draft an answer to ticket {n}. Be brief."


def content(body: Any) -> Content:
    content, _ = Content.objects.get_or_create(
        digest=calls.digest(body), defaults={"body": body, "size": len(str(body))}
    )
    return content


def _call(attempt: StepRun, prompt: str, reply: str | None, status: str = "ok") -> ModelCall:
    """A model call recorded on ``attempt`` (as ``runs.engine.calls`` records them)."""
    return ModelCall.objects.create(
        step_run=attempt,
        run_id=attempt.run_id,
        provider="openai",
        model="gpt-4o-mini",
        prompt=content(
            {"system": "You answer tickets.", "messages": [{"role": "user", "content": prompt}]}
        ),
        reply=content({"text": reply}) if reply is not None else None,
        status=status,
        input_tokens=40,
        output_tokens=12 if reply else 0,
        latency_ms=850,
        cost_usd=Decimal("0.000021") if reply else None,
        retrieved={
            "kb": "answers",
            "query": "parcel",
            "hits": [{"key": "T-9", "version": 2, "score": 0.7}],
        },
    )


def failed_run(**run_fields: Any) -> Run:
    """Failed: ``draft`` failed three times (retryable, retryable, fatal), one second of
    back-off between tries, each try's prompt a little different."""
    start = timezone.now() - timedelta(seconds=30)
    run = RunFactory(
        version=saved(RETRIED),
        status=RunStatus.FAILED,
        created_at=start,
        started_at=start,
        finished_at=start + timedelta(seconds=8),
        error={"class": "fatal", "message": "the model refused", "step": "draft"},
        **run_fields,
    )
    _attempt(run, "fetch", start, 500)
    t = start + timedelta(milliseconds=600)
    errors = ["retryable", "retryable", "fatal"]
    for n in (1, 2, 3):
        attempt = _attempt(
            run,
            "draft",
            t,
            900,
            attempt=n,
            status=StepStatus.FAILED,
            error={
                "class": errors[n - 1],
                "message": f"try {n} failed <b>badly</b>",
                "traceback": f"Traceback (most recent call last):\n  File 'draft.py', line {n}\n"
                f"FRAME-{n}",
            },
            usage={"input_tokens": 40, "output_tokens": 12},
            spans=[{"name": "lookup", "ms": 12}],
            cost_usd=Decimal("0.000021"),
        )
        _call(
            attempt,
            PROMPT.format(n=n) + ("" if n < 3 else " <script>alert(1)</script>"),
            f"Reply {n}",
        )
        t = attempt.finished_at + timedelta(seconds=1)
    return run


def foreach_run(items: int = 50, failed: tuple[int, ...] = (7, 31), **run_fields: Any) -> Run:
    """A foreach over ``items`` items that has ended: ``failed`` items failed, the rest
    succeeded; ``report`` ran after."""
    start = timezone.now() - timedelta(seconds=40)
    run = RunFactory(
        version=saved(FANOUT),
        status=RunStatus.COMPLETED,
        created_at=start,
        started_at=start,
        finished_at=start + timedelta(seconds=12),
        **run_fields,
    )
    _attempt(run, "load", start, 200, output={"items": list(range(items))})
    t = start + timedelta(milliseconds=300)
    _attempt(
        run,
        "each",
        t,
        10_000,
        kind="foreach",
        status=StepStatus.FAILED,
        output=None,
        error={"class": "fatal", "message": "2 items failed"},
    )
    rows = []
    for index in range(items):
        begin = t + timedelta(milliseconds=150 * index)
        bad = index in failed
        rows.append(
            StepRun(
                run=run,
                step_id="work",
                path=f"each[{index}]/",
                kind="task",
                attempt=1,
                status=StepStatus.FAILED if bad else StepStatus.SUCCEEDED,
                input=index,
                output=None if bad else index * 2,
                error={"class": "fatal", "message": f"item {index} is bad"} if bad else None,
                worker="celery@worker-2",
                scheduled_at=begin,
                started_at=begin + timedelta(milliseconds=30),
                finished_at=begin + timedelta(milliseconds=400),
            )
        )
    with unchecked():
        StepRun.objects.bulk_create(rows)
    _attempt(run, "report", t + timedelta(seconds=10.5), 300)
    return run


def many_attempts(count: int, value_size: int = 0) -> Run:
    """A run of ``count`` attempts (a foreach's items), each with an output of ``value_size``
    characters."""
    start = timezone.now() - timedelta(minutes=5)
    run = RunFactory(
        version=saved(FANOUT), status=RunStatus.RUNNING, created_at=start, started_at=start
    )
    big = "x" * value_size
    rows = [
        StepRun(
            run=run,
            step_id="work",
            path=f"each[{index}]/",
            kind="task",
            attempt=1,
            status=StepStatus.SUCCEEDED,
            input={"index": index},
            output={"blob": big},
            worker="celery@worker-3",
            scheduled_at=start + timedelta(milliseconds=10 * index),
            started_at=start + timedelta(milliseconds=10 * index + 2),
            finished_at=start + timedelta(milliseconds=10 * index + 8),
        )
        for index in range(count)
    ]
    with unchecked():
        StepRun.objects.bulk_create(rows, batch_size=1000)
    return run


BODIES = {
    "id": "bodies",
    "steps": [
        {"id": "load", "kind": "task"},
        {
            "id": "each",
            "kind": "foreach",
            "items": "${steps.load.output.items}",
            "do": [{"id": "fetch_one", "kind": "task"}, {"id": "store_one", "kind": "task"}],
        },
    ],
}


def body_runs(items: int = 3) -> Run:
    """A foreach whose body has two steps: each item is an anonymous child run (``body``
    ``each.do``) holding them; the last item is still storing."""
    start = timezone.now() - timedelta(seconds=10)
    run = RunFactory(version=saved(BODIES), status=RunStatus.RUNNING, created_at=start)
    _attempt(run, "load", start, 100, output={"items": list(range(items))})
    _attempt(run, "each", start, 0, kind="foreach", status=StepStatus.RUNNING, output=None)
    for index in range(items):
        last = index == items - 1
        stand_in = _attempt(
            run,
            "_body",
            start,
            0,
            kind="subworkflow",
            path=f"each[{index}]/",
            status=StepStatus.WAITING if last else StepStatus.SUCCEEDED,
        )
        child = RunFactory(
            version=run.version,
            status=RunStatus.RUNNING if last else RunStatus.COMPLETED,
            parent_run=run,
            parent_step_run=stand_in,
            root_run=run,
            body="each.do",
            input={"item": index},
        )
        _attempt(child, "fetch_one", start, 50)
        _attempt(
            child,
            "store_one",
            start,
            50,
            status=StepStatus.RUNNING if last else StepStatus.SUCCEEDED,
        )
    return run
