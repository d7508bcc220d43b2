"""Writes for runs: start, cancel, pause, resume, retry. Views, admin, the builder and tasks
call these; none of them changes a status without a lock on the run row."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from workflows import access, secrets, selectors
from workflows.errors import FieldError, InvalidInput, NotFound, echo
from workflows.preflight import start_problems

from . import dispatch, tracing, vault
from .engine import delivery
from .engine.advance import advance_locked
from .engine.ending import cancelled_error, end_run
from .models import Event, Run, RunAction
from .moves import move_run
from .status import IllegalTransition, RunStatus, check_run_move


@dataclass(frozen=True)
class StartResult:
    run: Run
    created: bool


def run_start(
    *,
    workflow: str,
    input: Any = None,
    version: int | None = None,
    idempotency_key: str | None = None,
    correlation: str | None = None,
    account: str | None = None,
    user: AbstractBaseUser | None = None,
) -> StartResult:
    """Start a run of ``workflow`` (its latest version unless pinned).

    ``user`` must be a starter of the workflow (404 when they may not see it, 403 when they
    may but not start it). The same ``idempotency_key`` for the same workflow and caller
    returns the run it started first (``created`` false), whatever the rest of the call says.
    An input that fails the version's ``input_schema``, or a ``task``/``agent`` handler no
    live worker serves (when ``START_CHECKS_WORKERS``), is refused, every problem named at
    once. The run is created
    and its first step planned in one transaction; the attempt is offered to a worker after
    commit (and offered again by the reconciler should that message be lost).
    """
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
    # Secrets are stored as tokens, their plaintext encrypted on the run (workflows.secrets);
    # this request holds them until it ends, so its logs and error reports mask them.
    stored_input, registry = vault.seal_input(pinned.document.get("input_schema"), input)
    secrets.expose(secrets.plaintexts(registry))
    try:
        with transaction.atomic():
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
                created_by=person,
            )
            # Plan the first step in the same transaction: a run costs no advance message
            # to start, and its first attempt is offered on commit.
            advance_locked(run)
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent start with the same idempotency key won the insert.
        return StartResult(same_key.get(), created=False)
    # The request's trace points to the run's own (runs.tracing), when traced.
    tracing.link_to_run(run.id)
    return StartResult(run, created=True)


def _locked(run_id: Any, user: AbstractBaseUser | None = None) -> Run:
    """The run, locked, once ``user`` may operate it (404 when they may not see it, 403
    when they may see but not operate it; ``None`` is trusted code)."""
    try:
        run_id = uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = Run.objects.select_for_update().filter(id=run_id).first()
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
    *, run_id: Any, reason: str = "cancelled by an operator", user: AbstractBaseUser | None = None
) -> Run:
    """Cancel the run and, transitively, its children. Scheduled attempts are cancelled;
    running ones are revoked best-effort and their results will be refused. ``user`` must
    operate the run; its children follow whoever may operate them."""
    run = _locked(run_id, user)
    check_run_move(run.status, RunStatus.CANCELLED)
    if user is not None:
        record_action(run.id, "cancel", user)
    # A child cancelled on its own fails its subworkflow step (class cancelled).
    end_run(run, RunStatus.CANCELLED, now=timezone.now(), error=cancelled_error(reason))
    return run


@transaction.atomic
def run_pause(*, run_id: Any, user: AbstractBaseUser | None = None) -> Run:
    """Stop scheduling new steps. Attempts already running finish and are recorded."""
    run = _locked(run_id, user)
    check_run_move(run.status, RunStatus.PAUSED)
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
    dispatch.advance_on_commit(run.id)
    return run


@transaction.atomic
def run_retry(*, run_id: Any, user: AbstractBaseUser | None = None) -> Run:
    """Retry a failed run from its failed step, keeping what succeeded.

    A new generation starts: the failed step gets a fresh attempt budget, and the run's
    limits (max_steps, max_cost_usd, run_timeout_ms) count afresh from now.
    """
    run = _locked(run_id, user)
    if run.status != RunStatus.FAILED:
        raise IllegalTransition(
            errors=[
                FieldError("status", f"only a failed run can be retried; this one is {run.status}")
            ]
        )
    check_run_move(run.status, RunStatus.RUNNING)
    record_action(run.id, "retry", user, {"generation": run.generation + 1})
    move_run(
        run,
        RunStatus.RUNNING,
        generation=run.generation + 1,
        error=None,
        output=None,
        finished_at=None,
        started_at=timezone.now(),
        deadline_at=None,  # set by the next advance from the document's limits
    )
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
