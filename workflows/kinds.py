"""The step-kind registry: what the validator, the planner, the applier and the worker need of
each step kind, declared in one place per kind (DESIGN rule 6).

A kind is one module that builds a :class:`Kind` and calls :func:`register`. The engine's own
kinds live in ``runs.kinds`` (registered when the planner is imported); ``approvals`` registers
``approval`` and ``handoff`` from its ``AppConfig.ready()``; a deployment (or a test) may
register more from any module its processes import (``WORKFLOW_MODULES`` for workers). The
README's "Adding a step kind" walks through one.

This module is the bottom layer: it imports nothing of the engine, Django or Celery. The
hooks a kind gives are plain callables; their arguments are the engine's objects (rows of
``runs``, the planner's scope), which the kind module imports itself.

What the roles mean to the engine:

- ``worker``: a worker process runs the step's body (:attr:`Kind.body`), with attempts,
  leases, time-outs and retries; the row is ``scheduled``, then ``running``.
- ``wait``: the step waits in the engine: a ``waiting`` row and a timer, no process alive
  (:attr:`Kind.open`, :attr:`Kind.due`).
- ``people``: like ``wait``, but what the row opens involves people (a request to decide, a
  notice to send): its :attr:`Kind.opened` hook runs in the transaction that writes the row.
  A ``people`` kind whose open status is ``waiting`` shows the run ``pending_approval``.
- ``child``: the step runs a child run; the row waits while it runs and ends as it ends.
- ``composite`` and ``branch``: steps that hold other steps (``parallel``, ``foreach``,
  ``loop``; ``condition``). Their semantics are the planner's own walk; the registry says only
  that they are such steps.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol


class Role(StrEnum):
    WORKER = "worker"
    WAIT = "wait"
    PEOPLE = "people"
    CHILD = "child"
    COMPOSITE = "composite"
    BRANCH = "branch"


# Roles whose row waits in the engine (``waiting``) until its time comes or something ends it.
WAITING_ROLES = frozenset({Role.WAIT, Role.PEOPLE})


class Refused(Exception):
    """A field of a step resolved to a value the step cannot use: the new attempt fails with
    class ``invalid_input``, and the message names the field."""


class Scope(Protocol):
    """What the planner offers a kind whose step it has reached (pure: no database)."""

    @property
    def now(self) -> datetime: ...

    @property
    def depth(self) -> int:
        """How many subworkflows below its root run the run is."""
        ...

    def resolve(self, template: Any, field: str) -> Any:
        """A field's template resolved against the run's context, bounded (else Refused)."""
        ...

    def input(self, step: Mapping[str, Any]) -> Any:
        """The step's input: its ``input`` template resolved, else the default input."""
        ...

    def after(self, timeout_ms: int | None) -> datetime | None:
        """When a wait of ``timeout_ms`` from now times out (None: it does not)."""
        ...


@dataclass(frozen=True)
class PreflightScope:
    """What pre-flight offers a kind about the document around the step it checks."""

    # The steps before this one in the document's order (nested ones included), as
    # pre-flight walked them: e.g. a knowledge base named by a recipe's ``context`` may be
    # one an earlier ``write_kb`` step writes.
    earlier: tuple[Mapping[str, Any], ...] = ()
    # Every step of the document, in the same order: a check that waits on the network asks
    # for all the steps of its kind at once (an MCP server's tools), so one start waits for
    # the slowest server it names, not for their sum.
    steps: tuple[Mapping[str, Any], ...] = ()
    # What the checks of this one start learnt, shared by every step's check (keyed by the
    # kind's own name).
    memo: dict[str, Any] = field(default_factory=dict, compare=False)

    def earlier_of(self, kind: str) -> list[Mapping[str, Any]]:
        return [step for step in self.earlier if step.get("kind") == kind]

    def every_of(self, kind: str) -> list[Mapping[str, Any]]:
        return [step for step in self.steps if step.get("kind") == kind]


@dataclass(frozen=True)
class Opening:
    """How a reached step's row opens (the planner writes it): ``waiting`` (with a timer of
    purpose ``timer`` at ``not_before`` when both are set), ``running`` (ended by the kind's
    ``opened`` hook), or already ``succeeded`` / ``failed`` when the step is over at once."""

    status: str = "waiting"
    input: Any = None
    output: Any = None
    error: Mapping[str, Any] | None = None
    not_before: datetime | None = None
    timer: str | None = None
    # What event deliveries look up (a wait_event's digest of its event name and key).
    wait_key: str = ""
    # A child run to start: {"workflow", "version", "input"}.
    start: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Ending:
    """How an open row ends: a waiting row whose time came (``Kind.due``), or a row the
    ``opened`` hook ended at once."""

    status: str
    error: Mapping[str, Any] | None = None
    output: Any = None


@dataclass(frozen=True)
class Kind:
    name: str
    role: Role
    # retry.max_attempts when the step gives none.
    max_attempts: int = 1
    # A worker kind whose body is a registered handler (task, agent): saving and starting
    # check that one exists, and workers advertise the ones they have.
    needs_handler: bool = False
    # The JSON Schema of the step's own fields, for a kind outside the published schema
    # (``workflows/definition.schema.json`` describes the built-in ones).
    schema: Mapping[str, Any] | None = None
    # Planner (pure): the step is reached (wait, people, child kinds).
    open: Callable[[Mapping[str, Any], Scope], Opening] | None = None
    # Planner (pure): a waiting row's ``not_before`` has come; given the step and the row.
    due: Callable[[Mapping[str, Any], Any], Ending] | None = None
    # Applier, in the transaction that wrote an open row: (run, step_run, now) -> an Ending
    # that ends the row now (the run is planned again), or None to leave it open.
    opened: Callable[[Any, Any, datetime], Ending | None] | None = None
    # Applier: open rows of this kind (ids) timed out, or were cancelled; (ids, now). What
    # they return is not used.
    timed_out: Callable[[list[int], datetime], object] | None = None
    cancelled: Callable[[list[int], datetime], object] | None = None
    # Planner (pure), worker kinds: the new attempt's stored input, given the step and the
    # scope (default: ``scope.input(step)``). A kind whose own fields are templates (http's
    # url, headers and body) resolves them here, so the attempt's row shows what it sent
    # and a retry resolves them afresh. Raises Refused to fail the attempt (invalid_input).
    prepare: Callable[[Mapping[str, Any], Scope], Any] | None = None
    # Starting a run: what can be known now to stop the step later, as (field, message)
    # pairs, the field one of the step's own ("recipe", "model"): a named recipe that does
    # not exist, a model whose provider is not configured. POST /runs answers 400 naming
    # each, and nothing starts. Given the step and what the document holds before it
    # (:class:`PreflightScope`). It may read the database; a check that needs the network
    # (an MCP server's tools) bounds its wait and caches its answer briefly.
    preflight: Callable[[Mapping[str, Any], PreflightScope], list[tuple[str, str]]] | None = None
    # Worker: (step, workflow_id) -> the callable ``(ctx, input, prior) -> output`` that runs
    # the attempt, or None when this worker cannot serve it (the attempt is handed back to
    # a worker that can).
    body: Callable[[Mapping[str, Any], str], Callable[..., Any] | None] | None = None

    def __post_init__(self) -> None:
        if self.role == Role.WORKER and self.body is None:
            raise ValueError(f"worker kind '{self.name}' needs a body")
        if self.role in (*WAITING_ROLES, Role.CHILD) and self.open is None:
            raise ValueError(f"{self.role} kind '{self.name}' needs open")
        if self.role == Role.WAIT and self.due is None:
            # Its rows wait for their time: the planner asks due() when it comes.
            raise ValueError(f"wait kind '{self.name}' needs due")


_lock = threading.Lock()
_kinds: dict[str, Kind] = {}
# Bumped on every registration: caches built from the registry (the schema validator) key on it.
_generation = 0


def register(kind: Kind) -> Kind:
    """Register ``kind`` (again: the newer declaration of one name replaces the older, as a
    reloaded module's would)."""
    global _generation
    with _lock:
        _kinds[kind.name] = kind
        _generation += 1
    return kind


def unregister(name: str) -> None:
    """Forget a kind (tests that registered a toy one)."""
    global _generation
    with _lock:
        if _kinds.pop(name, None) is not None:
            _generation += 1


def get(name: str) -> Kind | None:
    return _kinds.get(name)


def role_of(name: str) -> Role | None:
    kind = _kinds.get(name)
    return kind.role if kind is not None else None


def names(*roles: Role) -> frozenset[str]:
    """The registered kinds with one of ``roles`` (all of them when none is given)."""
    return frozenset(k.name for k in list(_kinds.values()) if not roles or k.role in roles)


def handler_kinds() -> frozenset[str]:
    return frozenset(k.name for k in list(_kinds.values()) if k.needs_handler)


def generation() -> int:
    return _generation


def extra_schemas() -> dict[str, Mapping[str, Any]]:
    """The JSON Schemas of registered kinds outside the published schema, by name."""
    return {k.name: copy.deepcopy(dict(k.schema)) for k in list(_kinds.values()) if k.schema}
