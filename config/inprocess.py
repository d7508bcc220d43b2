"""The engine in the test's own process, for the ``djflow`` fixture (``workflows.testing``,
contract section 16): no broker, no beat, no network, a virtual clock.

It lives in ``config`` because it drives every app (runs, workers, approvals), and only
``config`` sits above them all (DESIGN rule 6); ``workflows.testing`` imports it inside the
fixture, so a test session that never asks for the fixture never imports it.

Only transport and time are replaced; the planner, the applier, the kinds and the worker's
execution are the engine's own:

- transport: every message the engine sends goes through ``current_app`` of the modules that
  send (``runs.dispatch``, ``approvals.outbox``, ``runs.bulk``, ``workflows.knowledge``).
  Each is given a :class:`Transport` that keeps the messages, and :meth:`Djflow.settle` runs
  them here, in order, through the tasks' own functions (ids in, as a worker would);
- time: ``time_machine`` holds the clock still; :meth:`Djflow.advance` moves it to each
  instant a timer or a schedule falls due, in turn, and fires them with the beat's own
  ``fire_due`` and ``schedule_fire``.

Invariant: every public call returns with the engine idle, no message left and no timer due.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx2
import time_machine
from celery import current_app as celery_app
from celery.exceptions import Retry
from django.db import connection
from django.test import TestCase
from django.utils import timezone

from approvals.models import ApprovalRequest
from approvals.services import Origin, approval_decide
from runs import services
from runs.engine import timers
from runs.models import Run as RunRow
from runs.models import Timer
from runs.serializers import StepRunSerializer
from runs.tracing import current_attempt
from schedules.models import Schedule
from schedules.services import schedule_fire
from workers import providers
from workers import slots as model_slots
from workers.kinds import http, mcp_tool
from workers.mcp import pool as mcp_pool
from workflows import registry
from workflows.failures import KindFailure, StepFailure
from workflows.services import definition_save

# Modules that send Celery messages through ``current_app``: the transport replaces it in
# each (tests/workflows/test_testing_plugin.py's socket guard proves no connection is made).
SENDERS = ("runs.dispatch", "approvals.outbox", "runs.bulk", "workflows.knowledge")
# Where the tasks those messages name are declared (a worker's autodiscovery imports them).
TASK_MODULES = ("runs.tasks", "workers.tasks", "approvals.tasks", "schedules.tasks")
# Not run here: the clock is fired by advance(), and a run-end webhook would reach the
# network.
SKIPPED = frozenset({"runs.wake_timers", "workers.deliver_notification"})
# A guard against a workflow that never stops doing work at one instant (a loop without
# a bound the document would refuse anyway): the call fails instead of hanging the test.
MAX_MESSAGES = 20_000
UNSTUBBED = "unstubbed"
_MISSING: Any = object()


class _Every(frozenset[str]):
    def __contains__(self, name: object) -> bool:
        return True


_EVERY = _Every()


class NotIdle(AssertionError):
    """The engine kept working at one instant past :data:`MAX_MESSAGES` messages."""


@dataclass
class _Message:
    transport: Transport
    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def apply_async(self, *args: Any, **options: Any) -> None:
        # A countdown or an ETA is for a broker's redelivery: the durable time is the
        # engine's (timers, leases), so the message runs now.
        self.transport.sent.append(self)

    def freeze(self, *args: Any, **kwargs: Any) -> None:
        """Chords are switched off (FAN_OUT_CHORDS); nothing to freeze."""


class _Producer:
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield


class Transport:
    """What the senders call ``current_app``: keeps each message for :meth:`Djflow.settle`."""

    def __init__(self) -> None:
        self.sent: deque[_Message] = deque()
        self.conf = SimpleNamespace(
            broker_url="memory://", result_backend=None, result_chord_retry_interval=1.0
        )
        self.backend = None
        self.control = SimpleNamespace(revoke=lambda *args, **kwargs: None)

    def signature(self, name: str, args: Any = (), kwargs: Any = None, **options: Any) -> _Message:
        return _Message(self, name, tuple(args or ()), dict(kwargs or {}))

    @contextlib.contextmanager
    def producer_or_acquire(self, *args: Any, **kwargs: Any) -> Iterator[_Producer]:
        yield _Producer()


class Run:
    """A run as the fixture hands it out, refreshed in place after every call of the fixture:
    ``status``, ``output``, ``error``, ``cost_usd`` and ``steps`` (the journal, each attempt
    as ``GET /runs/{id}`` shows it)."""

    def __init__(self, row: RunRow) -> None:
        self.id = row.id
        self.refresh()

    def refresh(self) -> None:
        row = RunRow.objects.get(id=self.id)
        self.row = row
        self.status: str = row.status
        self.output: Any = row.output
        self.error: Any = row.error
        self.cost_usd = Decimal(row.cost_usd)
        attempts = row.steps.order_by("id").prefetch_related("model_calls", "tool_calls")
        self.steps: list[dict[str, Any]] = list(StepRunSerializer(attempts, many=True).data)

    def step(self, step_id: str) -> dict[str, Any]:
        """The last attempt of ``step_id``; a KeyError naming the steps there are when none."""
        found = [attempt for attempt in self.steps if attempt["step_id"] == step_id]
        if not found:
            there = sorted({attempt["step_id"] for attempt in self.steps})
            raise KeyError(f"run {self.id} has no step '{step_id}' (its steps: {there})")
        return found[-1]

    def __repr__(self) -> str:
        return f"<djflow Run {self.id} {self.status}>"


def _reply_text(reply: Any) -> str:
    return reply if isinstance(reply, str) else json.dumps(reply)


class _Answers:
    """Canned answers for one kind of call: one for all, a list in turn, or one per step.
    Each answer is a value or a callable given the call (and raising to fail it)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.one: Any = _MISSING
        self.queue: deque[Any] = deque()
        self.by_step: dict[str, Any] = {}

    def set(self, *, one: Any, many: Any, by_step: Any) -> None:
        if sum(value is not _MISSING for value in (one, many, by_step)) != 1:
            raise TypeError(f"djflow.{self.what}: give exactly one of reply, replies, by_step")
        if one is not _MISSING:
            self.one = one
        elif many is not _MISSING:
            self.queue.extend(many)
        else:
            self.by_step.update(by_step)

    def answer(self, naming: str, call: Any) -> Any:
        attempt = current_attempt.get()
        step_id = attempt.step_id if attempt is not None else None
        if step_id in self.by_step:
            found = self.by_step[step_id]
        elif self.queue:
            found = self.queue.popleft()
        elif self.one is not _MISSING:
            found = self.one
        else:
            raise KindFailure(
                f"{naming}: no answer stubbed (djflow.{self.what}(...)); a test never "
                "reaches the network",
                UNSTUBBED,
            )
        return found(call) if callable(found) else found


class Djflow:
    """The ``djflow`` fixture's object. Every public method returns with the engine idle."""

    def __init__(self, traveller: Any) -> None:
        self._clock = traveller
        self.transport = Transport()
        self._runs: list[Run] = []
        self._models = _Answers("model")
        self._tools = _Answers("tool")
        self._http = _Answers("http")

    # --- the workflows -------------------------------------------------------------------

    def define(self, workflow: Any) -> str:
        """Save a JSON document or a builder workflow; returns its id. A builder's handlers
        are in the process's registry already (the builder registered them)."""
        document = workflow.document() if hasattr(workflow, "document") else workflow
        with self._settling():
            definition_save(document=document)
        return str(document["id"])

    def start(self, workflow: Any, input: Any = None, **start_fields: Any) -> Run:
        """Start a run of ``workflow`` (an id, a document or a builder, saved first when it
        is not an id) and run it until it waits for time or people."""
        if not isinstance(workflow, str):
            workflow = self.define(workflow)
        with self._settling():
            row = services.run_start(workflow=workflow, input=input, **start_fields).run
        run = Run(row)
        self._runs.append(run)
        return run

    # --- time and people -----------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock by ``seconds``, firing each timer at its own instant in order (a
        retry's back-off that falls due sets the next one, which may fall due before the
        end)."""
        end = timezone.now() + timedelta(seconds=seconds)
        while (due := _next_due(end)) is not None:
            if due > timezone.now():
                self._clock.move_to(due)
            with self._settling():
                pass
        self._clock.move_to(end)
        with self._settling():
            pass

    def approve(self, run: Run, step_id: str, *, by: Any, comment: str | None = None) -> None:
        self._decide(run, step_id, "approved", by, comment)

    def reject(self, run: Run, step_id: str, *, by: Any, comment: str | None = None) -> None:
        self._decide(run, step_id, "rejected", by, comment)

    def _decide(self, run: Run, step_id: str, decision: str, by: Any, comment: Any) -> None:
        request = (
            ApprovalRequest.objects.filter(run_id=run.id, step_run__step_id=step_id)
            .order_by("-id")
            .first()
        )
        if request is None:
            raise AssertionError(f"run {run.id} has no approval request at step '{step_id}'")
        with self._settling():
            if isinstance(by, str):
                approver = request.people.filter(email__iexact=by).first() or (
                    request.people.filter(user__email__iexact=by).first()
                )
                if approver is None:
                    shown = [person.label for person in request.people.all()]
                    raise AssertionError(
                        f"'{by}' is not among the approvers of step '{step_id}': {shown}"
                    )
                approval_decide(
                    request_id=request.id,
                    decision=decision,
                    comment=comment or "",
                    origin=Origin("link"),
                    user=approver.user,
                    approver_id=approver.id,
                )
            else:
                approval_decide(
                    request_id=request.id,
                    decision=decision,
                    comment=comment or "",
                    origin=Origin("api"),
                    user=by,
                )

    def send_event(self, name: str, key: str, payload: Any = None) -> int:
        """Deliver an event; returns how many waits it resumed."""
        with self._settling():
            _, resumed = services.event_send(name=name, key=key, payload=payload)
        return resumed

    # --- stubs ---------------------------------------------------------------------------

    def stub(
        self,
        handler_name: str,
        *,
        returns: Any = _MISSING,
        raises: BaseException | None = None,
        side_effect: Callable[..., Any] | None = None,
    ) -> None:
        """Replace the ``task``/``agent`` handler ``handler_name`` (a ``handler`` name or
        ``<workflow>.<step>``) for this test. ``side_effect`` is called as the handler is,
        with ``(ctx, input)``."""
        if sum(x is not _MISSING and x is not None for x in (returns, raises, side_effect)) != 1:
            raise TypeError("djflow.stub: give exactly one of returns, raises, side_effect")

        def stubbed(ctx: Any, given: Any, prior: Any = None) -> Any:
            if raises is not None:
                raise raises
            if side_effect is not None:
                return side_effect(ctx, given)
            return returns

        registry.override(handler_name, stubbed)

    def model(
        self, *, reply: Any = _MISSING, replies: Any = _MISSING, by_step: Any = _MISSING
    ) -> None:
        """Answer ``recipe`` calls: a text (or a JSON value, sent as its text), priced as
        the model named would be, for the usage the offline stand-in would report."""
        self._models.set(one=reply, many=replies, by_step=by_step)

    def tool(
        self, *, reply: Any = _MISSING, replies: Any = _MISSING, by_step: Any = _MISSING
    ) -> None:
        """Answer ``mcp_tool`` steps: the step's output."""
        self._tools.set(one=reply, many=replies, by_step=by_step)

    def http(
        self, *, reply: Any = _MISSING, replies: Any = _MISSING, by_step: Any = _MISSING
    ) -> None:
        """Answer ``http`` steps: the step's output (``{"status", "headers", "body"}``)."""
        self._http.set(one=reply, many=replies, by_step=by_step)

    def _model_call(self, name: str, request: providers.ModelRequest) -> providers.ModelReply:
        try:
            text = _reply_text(self._models.answer(f"model '{name}'", request))
        except StepFailure as failure:
            raise providers.ModelError(str(failure), error_class=failure.error_class) from None  # type: ignore[arg-type]
        return providers.ModelReply(
            text=text,
            model=request.model,
            input_tokens=providers.estimate_input_tokens(request),
            output_tokens=math.ceil(len(text.encode("utf-8")) / 4),
            stop_reason="end_turn",
            request_id="djflow-stub",
        )

    def _tool_call(self, ctx: Any, given: Any, prior: Any = None) -> Any:
        naming = f"mcp_tool '{given.get('server')}.{given.get('tool')}'"
        return self._tools.answer(naming, given)

    def _http_call(self, ctx: Any, given: Any, prior: Any = None) -> Any:
        naming = f"http {given.get('method', 'GET')} {given.get('url')}"
        answer = self._http.answer(naming, given)
        if isinstance(answer, Mapping) and isinstance(answer.get("status"), int):
            # A stubbed 4xx or 5xx fails the step as the server's would (retryable or not,
            # its Retry-After honoured): the kind's own judgement of the answer.
            headers = answer.get("headers") or {}
            response = httpx2.Response(answer["status"], headers=headers)
            http._raise_for_status(http._Request.from_input(given), response)
        return answer

    def lookup_with(self, lookup: Callable[..., Any]) -> Callable[..., Any]:
        """The registry's lookup under the fixture: a stub or a registered handler, else a
        body that fails with class ``unstubbed``."""
        return _handler_or_unstubbed(lookup)

    # --- the loop ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _settling(self) -> Iterator[None]:
        """Run the block, then everything it set going, until the engine is idle; refresh
        the runs handed out."""
        with _on_commit():
            yield
        self.settle()

    def settle(self) -> None:
        """Run the messages sent and fire the timers due, until neither is left."""
        ran = 0
        while True:
            if self.transport.sent:
                ran += 1
                if ran > MAX_MESSAGES:
                    raise NotIdle(
                        f"the engine sent more than {MAX_MESSAGES} messages without the clock "
                        f"moving (the last: {self.transport.sent[0].name})"
                    )
                message = self.transport.sent.popleft()
                with _on_commit():
                    _run(message)
                continue
            with _on_commit():
                fired = timers.fire_due(budget_seconds=60.0) + _fire_schedules()
            if not fired and not self.transport.sent:
                break
        for run in self._runs:
            run.refresh()


def _next_due(until: datetime) -> datetime | None:
    """The first instant up to ``until`` at which a timer or a schedule falls due."""
    instants = [
        Timer.objects.filter(fired_at__isnull=True, fire_at__lte=until)
        .order_by("fire_at")
        .values_list("fire_at", flat=True)
        .first(),
        _schedules_due(until).order_by("next_run_at").values_list("next_run_at", flat=True).first(),
    ]
    return min((instant for instant in instants if instant is not None), default=None)


def _schedules_due(until: datetime) -> Any:
    return Schedule.objects.filter(task__enabled=True, next_run_at__lte=until)


def _fire_schedules() -> int:
    """Fire the schedules due now, as beat's ``schedules.fire`` message would."""
    due = list(_schedules_due(timezone.now()).values_list("pk", flat=True))
    return sum(schedule_fire(schedule_id=schedule_id) is not None for schedule_id in due)


def _run(message: _Message) -> None:
    """The message's task, called here as a worker would (the task's own function)."""
    if message.name in SKIPPED:
        return
    task = _tasks()[message.name]
    # A hand-back (a slot wait) is offered again by the engine itself, as a message.
    with contextlib.suppress(Retry):
        task(*message.args, **message.kwargs)


@functools.cache
def _tasks() -> dict[str, Any]:
    """The engine's tasks by name, their modules imported (as a worker's autodiscovery
    imports them)."""
    for module in TASK_MODULES:
        importlib.import_module(module)
    return dict(celery_app.tasks)


@contextlib.contextmanager
def _on_commit() -> Iterator[None]:
    """Inside a test's transaction (pytest-django's ``db``) nothing commits: the callbacks
    the block registers run at its end, as they would at commit (those they register too).
    Outside one (``transactional_db``) they ran at each commit already."""
    if connection.in_atomic_block:
        with TestCase.captureOnCommitCallbacks(execute=True):
            yield
    else:
        yield


def _handler_or_unstubbed(lookup: Callable[..., Any]) -> Callable[..., Any]:
    """The registry's lookup, but a step whose handler is neither registered nor stubbed
    fails with class ``unstubbed`` naming it: no other worker will ever serve it here."""

    def found(workflow_id: str, step_id: str, handler_name: str | None = None) -> Any:
        handler = lookup(workflow_id, step_id, handler_name)
        if handler is not None:
            return handler
        key = registry.step_handler(workflow_id, step_id, handler_name)

        def unstubbed(ctx: Any, given: Any, prior: Any = None) -> Any:
            raise KindFailure(
                f"handler '{key}': none registered and none stubbed (djflow.stub('{key}', ...))",
                UNSTUBBED,
            )

        return unstubbed

    return found


def _no_embeddings(name: str, texts: Any, **options: Any) -> Any:
    """``providers.embed`` under the fixture: never a request (none is configured here)."""
    message = f"embeddings with {name} are not stubbed: the djflow fixture searches full-text"
    raise providers.ModelError(message, error_class="unstubbed")  # type: ignore[arg-type]


# The settings the engine runs under in process (the fixture's and the replay's).
OVERRIDES = {
    # The chord is only a notification (DESIGN rule 5); plain messages run here.
    "FAN_OUT_CHORDS": False,
    # No worker process heartbeats here: the handlers are this process's.
    "START_CHECKS_WORKERS": False,
    # No wake-ups between ticks: advance() fires each timer at its instant.
    "TIMER_RESOLUTION_MS": 0,
    # No embeddings model: knowledge bases are searched full-text, as on a deployment
    # without one, and no document or query is sent to a provider (a test never reaches
    # the network; section 16).
    "EMBEDDINGS_MODEL": "",
    # No model-call slots counted in Redis: a test, or a replay, reaches no server (the
    # slots' instance is made again from these settings, and after them).
    "MODEL_SLOTS_REDIS_URL": "",
}


@contextlib.contextmanager
def installed(
    settings: Any = None,
    *,
    engine: Callable[[Any], Djflow] | None = None,
    start: datetime | None = None,
) -> Iterator[Djflow]:
    """The fixture's life: the transport, the clock and the stubs in, then all out again.

    ``settings`` is pytest-django's fixture (it restores them); without it (``manage.py
    run_replay``) Django's own ``override_settings`` does, and mail stays in memory.
    ``engine`` makes the object that answers the calls (a :class:`Djflow` by default);
    ``start`` is the virtual clock's first instant (now by default)."""
    from django.conf import settings as django_settings
    from django.test import override_settings

    with contextlib.ExitStack() as stack:
        if settings is not None:
            settings.DJFLOW = {**settings.DJFLOW, **OVERRIDES}
        else:
            stack.enter_context(
                override_settings(
                    DJFLOW={**django_settings.DJFLOW, **OVERRIDES},
                    EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend",
                )
            )
        saved = registry.snapshot()
        stack.callback(registry.restore, saved)
        model_slots._instance = None
        stack.callback(setattr, model_slots, "_instance", None)
        first = (start or timezone.now()).replace(microsecond=0)
        traveller = stack.enter_context(time_machine.travel(first, tick=False))
        djflow = (engine or Djflow)(traveller)

        def patch(target: Any, name: str, value: Any) -> None:
            stack.enter_context(mock.patch.object(target, name, value))

        for name in SENDERS:
            patch(importlib.import_module(name), "current_app", djflow.transport)
        patch(registry, "lookup", djflow.lookup_with(registry.lookup))
        patch(providers, "call", djflow._model_call)
        patch(providers, "embed", _no_embeddings)
        patch(providers, "unconfigured", lambda name: None)
        patch(mcp_tool, "call", djflow._tool_call)
        # The start's check asks the server for its tools: every server and tool is there
        # for a test (an unanswered call fails at run time, class unstubbed).
        patch(mcp_pool, "servers", lambda: _EVERY)
        patch(mcp_tool, "_tools_for_start", lambda server, scope: _EVERY)
        patch(http, "call", djflow._http_call)
        yield djflow
