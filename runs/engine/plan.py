"""The planner: a pure function from (document, run, journal, now) to actions.

It holds the workflow semantics of contract sections 1-5 at run time: step order, guards,
templates resolved per attempt, retry policies and back-off, ``on_error``, the run's limits,
the output template and ``condition`` branches. It imports no Django and touches no
database: ``runs.engine.apply`` is the only writer, and the journal it is given is the whole
truth about what happened so far.

Invariants:

- Planning is idempotent: the actions it returns, once applied, make the next plan over the
  new journal return no action for the same step (a second ``advance`` finds nothing to do).
- A step's guard is evaluated once, when the step is first reached; a retry re-resolves the
  input template but never re-evaluates the guard.
- Back-off is deterministic: jitter is derived from the run, the step and the attempt, so
  two planners given the same journal agree on when a retry is due.
- Planning is bounded (contract section 9). With ``max_actions`` the walk stops once it has
  decided that many actions (re-asked back-off timers aside) and says so (``Plan.more``): the
  caller applies them and plans again later, from the journal they made. A parallel's
  branches are never split, so all are still journaled before any is offered. Every value a
  step passes on is at most ``MAX_VALUE_BYTES``: a resolved input or field over it fails the
  step (class ``invalid_input``) and is refused while its template renders, never built
  first. ``max_steps`` (default 1,000) counts the run's attempts and, through
  ``RunView.tree_used``, those of the whole tree of runs it belongs to; a subworkflow more
  than ``MAX_SUBWORKFLOW_DEPTH`` deep fails.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import Enum
from functools import partial
from itertools import islice
from typing import Any

from workflows import kinds
from workflows.guards import evaluate
from workflows.kinds import Opening, Role
from workflows.schema import DEFAULT_MAX_ITEMS
from workflows.templates import TooLarge, check_size, resolve

# The engine's own kinds register themselves on import; their helpers are re-exported here.
from ..kinds.subworkflow import MAX_SUBWORKFLOW_DEPTH
from ..kinds.time import parse_until
from ..kinds.wait_event import key_text, wait_key

__all__ = ["MAX_SUBWORKFLOW_DEPTH", "key_text", "parse_until", "plan", "wait_key"]

# The step id of the row that stands for a body of several steps (an anonymous child run),
# and that row's kind.
BODY = "_body"
BODY_KIND = "subworkflow"
# How a child run's end becomes its subworkflow step's end.
CHILD_FAILED = frozenset({"failed", "cancelled", "timed_out"})
# limits.max_steps when a document gives none.
DEFAULT_MAX_STEPS = 1000
# The largest value a step takes or gives (a resolved input or field, an output), as compact
# UTF-8 JSON: 1 MiB.
MAX_VALUE_BYTES = 1_048_576
DEFAULT_RUN_TIMEOUT_MS = 300_000
DEFAULT_STEP_TIMEOUT_MS = 60_000
DEFAULT_INITIAL_MS = 2_000
DEFAULT_MAX_MS = 30_000
# Share of the back-off added at most as jitter.
JITTER_SHARE = 0.2

# Error classes (contract section 5), plus the two the engine itself assigns.
RETRYABLE = "retryable"
TIMEOUT = "timeout"
LOST = "lost"  # the worker vanished (its lease expired) before recording a result
LIMIT = "limit"
INVALID_INPUT = "invalid_input"
REJECTED = "rejected"  # an approver rejected an approval step
UNSUPPORTED = "unsupported"
# An in_doubt attempt that failed: its deadline passed, or an operator resolved it so. Never
# retried (the body may have had its effect), whatever the step's retry policy.
IN_DOUBT = "in_doubt"

IN_FLIGHT = frozenset({"scheduled", "running", "waiting", IN_DOUBT})
# Where the rows of a document's ``on_failure`` handler live: ``_on_failure[<generation>]/``.
# No step id starts with "_", so no path of a main step (which starts with its top-level
# step's id) can be one of these, and each generation (a retry of the run) gets its own.
ON_FAILURE = "_on_failure"
# The roles of steps that hold other steps: their rows are not attempts.
HOLDERS = frozenset({Role.COMPOSITE, Role.BRANCH})


# --- what the planner reads ---------------------------------------------------------------


@dataclass(frozen=True)
class RunView:
    id: str
    status: str
    input: Any
    correlation: str | None
    generation: int
    started_at: datetime | None
    deadline_at: datetime | None
    # An anonymous child run's scope (its steps are a body of its parent's document):
    # {"input", "steps", "default", "item"/"index" or "iter"}; None for a run of a workflow.
    scope: Mapping[str, Any] | None = None
    # How many subworkflows below its root run this run is (a body run is as deep as the run
    # it is a body of).
    depth: int = 0
    # Attempts counted (as max_steps counts them) by the other runs of its tree: its root and
    # every run below the root. And the root's max_steps, None for a root.
    tree_used: int = 0
    tree_limit: int | None = None
    # The retries from a step, oldest first: (the generation it began, the top-level step it
    # reran from). An attempt of a generation before g, of that step or a later top-level one
    # (anything inside them included), is superseded: kept in the journal, not planned on.
    reruns: tuple[tuple[int, str], ...] = ()
    # What operators added to limits.max_cost_usd (POST /runs/{id}/budget).
    budget_added_usd: float = 0.0


@dataclass(frozen=True)
class AttemptView:
    """One journal row."""

    id: int
    step_id: str
    attempt: int
    status: str
    kind: str = "task"
    path: str = ""
    generation: int = 1
    branch: str = ""
    output: Any = None
    error: Mapping[str, Any] | None = None
    effect: str = "at_least_once"
    finished_at: datetime | None = None
    lease_expires_at: datetime | None = None
    deadline_at: datetime | None = None
    # A waiting row's due time: a sleep's end, a wait_event's time-out.
    not_before: datetime | None = None
    cost_usd: float = 0.0
    # For a waiting subworkflow row: its child run's {"id", "status", "output", "error"}.
    child: Mapping[str, Any] | None = None
    # The stored JSON bytes of its output and error (for Prefix.size); 0 when not known.
    size: int = 0
    # A scheduled attempt waiting for budget (StepRun.budget_wait): {"until": ISO time or
    # None}, the end of the account's period that lets it go on; None when it does not wait.
    budget: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Prefix:
    """The settled beginning of a run, as one plan found it, for the next plan of the same
    run (its caller keeps it): the first ``steps`` top-level steps are over for good. Every
    journal row of theirs has ended (an ended row never changes: runs.status.STEP_MOVES), and
    their ids are at most ``through_id``, below every row of a later step. So the next plan is
    given only the rows after ``through_id`` and starts its walk at step ``steps``, with the
    context those steps left: a step of a long run costs what a step of a short one does,
    instead of a read and a walk of the whole journal.

    Valid for the same document and generation only, and never used with a retry from a step
    or a cost limit (both read settled rows again); a plan that cannot tell returns none.
    """

    steps: int
    through_id: int
    generation: int
    # What the steps put in the template context (step id -> {"output", "status", "error"}),
    # and the default input and "a step ran" flag they left for the next step.
    context: Mapping[str, Any]
    previous_output: Any
    ran_before: bool
    # Their rows that max_steps counts (of this generation), and whether one started a child
    # run (then the tree's count is read: journal.run_view).
    counted: int
    children: bool
    # The JSON bytes of their outputs and errors: what a cache of prefixes holds in memory.
    size: int = 0


# --- what the planner decides -------------------------------------------------------------


@dataclass(frozen=True)
class StartRun:
    """pending → running (or a new generation after a retry): the clock starts."""

    started_at: datetime
    deadline_at: datetime


@dataclass(frozen=True)
class Schedule:
    """A new attempt of a worker step, offered to a worker on commit."""

    step_id: str
    path: str
    kind: str
    attempt: int
    generation: int
    input: Any
    effect: str
    queue: str
    timeout_ms: int


@dataclass(frozen=True)
class Skip:
    """A false guard: the step is written ``skipped`` and the run goes on."""

    step_id: str
    path: str
    kind: str
    generation: int
    # Above the step's superseded attempts (a retry from a step), else 1.
    attempt: int = 1


@dataclass(frozen=True)
class Open:
    """An engine step's row: a condition (``running`` while its branch runs), or a sleep or
    wait (``waiting``, with a timer at ``not_before`` when that is set); ``succeeded`` or
    ``failed`` already when the step is over within the same plan."""

    step_id: str
    path: str
    kind: str
    attempt: int
    generation: int
    branch: str = ""
    status: str = "running"
    input: Any = None
    output: Any = None
    error: Mapping[str, Any] | None = None
    not_before: datetime | None = None
    # The timer's purpose when a timer must fire at ``not_before``.
    timer: str | None = None
    # A wait_event's digest of (event name, resolved key): what deliveries look up.
    wait_key: str = ""
    # A subworkflow's child run to start: {"workflow", "version", "input"}.
    start: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Close:
    """An engine step's open row is done."""

    attempt_id: int
    status: str
    output: Any = None
    error: Mapping[str, Any] | None = None
    # The row's kind, for the kind's hooks when it ends so (a timed-out approval's request).
    kind: str = ""


@dataclass(frozen=True)
class Expire:
    """A running attempt is given up: past its deadline (``timed_out``, class timeout) or its
    worker's lease lapsed (``failed``, class lost); either way ``in_doubt`` for an at_most_once
    attempt, which waits for an operator until ``not_before``, when a timer fails it. Its
    worker can no longer record a result."""

    attempt_id: int
    status: str
    error: Mapping[str, Any]
    not_before: datetime | None = None


@dataclass(frozen=True)
class Cancel:
    """Attempts in flight inside a composite step that failed: cancelled, never recorded."""

    attempt_ids: tuple[int, ...]


@dataclass(frozen=True)
class Wake:
    """Nothing is in flight but something falls due at ``at`` (a retry back-off): a timer.
    ``key`` names it, so planning twice over one journal asks for the same timer."""

    at: datetime
    purpose: str = "retry_backoff"
    key: str = ""


@dataclass(frozen=True)
class Unblock:
    """An attempt that waited for budget is offered again: the period it waited for has
    ended (a new day or month of its account's budget). Should it still not fit, it waits
    again."""

    attempt_id: int


@dataclass(frozen=True)
class Finish:
    """The run ends: ``completed``, ``failed`` or ``timed_out``."""

    status: str
    output: Any = None
    error: Mapping[str, Any] | None = None


Action = StartRun | Schedule | Skip | Open | Close | Expire | Cancel | Wake | Unblock | Finish


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    # The run is held only by sleeps and waits (no attempt in flight, no back-off): it shows
    # ``waiting``, and no process is alive for it.
    waiting: bool = False
    # Among what holds it, an approval: it shows ``pending_approval``.
    approval: bool = False
    # Among what holds it, an attempt waiting for budget: it shows ``budget_exceeded``
    # (unless an approval holds it too).
    budget: bool = False
    # The walk stopped at its ``max_actions``: plan again to go on.
    more: bool = False
    # The settled beginning of the run for its next plan; None when this plan cannot tell
    # more than the prefix it was given (or was given none and found none).
    prefix: Prefix | None = None

    def of(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def finish(self) -> Finish | None:
        found = self.of(Finish)
        return found[0] if found else None


@dataclass(frozen=True)
class Settings:
    """Engine tunables the planner needs (``settings.DJFLOW`` in production)."""

    # How long past an attempt's deadline the engine waits for the worker's own time-out
    # report before it expires the attempt itself.
    deadline_grace: timedelta = timedelta(seconds=5)
    # How long an in_doubt attempt waits for an operator before it fails (IN_DOUBT_SECONDS).
    in_doubt: timedelta = timedelta(days=1)
    # The most limits.max_steps counts, whatever a document says (MAX_STEPS_CEILING).
    max_steps_ceiling: int = 100_000


# --- the walk -----------------------------------------------------------------------------


class _Go(Enum):
    CONTINUE = "continue"  # this step is settled; go on to the next
    BLOCKED = "blocked"  # something is in flight or not yet due; plan no further
    FAILED = "failed"  # a step failed with fail_run: its container fails (self.failure says why)
    STOP = "stop"  # the run ends (a Finish was emitted)


def plan(
    document: Mapping[str, Any],
    run: RunView,
    journal: Sequence[AttemptView],
    now: datetime,
    settings: Settings | None = None,
    *,
    max_actions: int | None = None,
    prefix: Prefix | None = None,
    positions: Mapping[str, int] | None = None,
) -> Plan:
    """Decide what to do next for ``run``, at most about ``max_actions`` actions of it (at
    least one). See the module docstring for the invariants.

    With ``prefix`` (a previous plan's ``Plan.prefix`` for this run), ``journal`` holds only
    the rows after ``prefix.through_id``; the plan is the one the whole journal gives.
    ``positions`` is :func:`positions_of` the document's steps, when the caller keeps it.
    """
    planner = _Planner(
        document,
        run,
        journal,
        now,
        settings or Settings(),
        prefix=prefix,
        positions=positions if positions is not None else positions_of(document["steps"]),
    )
    planner.max_actions = None if max_actions is None else max(max_actions, 1)
    return planner.run()


# A field of a step resolved to a value too large to use: its attempt fails (class
# invalid_input), and the message names the field. Kinds raise it too.
_Refused = kinds.Refused


class _Planner:
    def __init__(
        self,
        document: Mapping[str, Any],
        run: RunView,
        journal: Sequence[AttemptView],
        now: datetime,
        settings: Settings,
        *,
        prefix: Prefix | None = None,
        positions: Mapping[str, int],
    ) -> None:
        self.document = document
        self.run_view = run
        self.positions = positions
        self.given = journal
        self.now = now
        self.settings = settings
        self.limits = document.get("limits", {})
        self.out = Plan()
        # The highest attempt number of each (path, step id) among the superseded attempts:
        # a step run again numbers its attempts on from there (the journal keeps both).
        self.superseded: dict[tuple[str, str], int] = {}
        self.journal = self._current(journal)
        self.by_step: dict[tuple[str, str], list[AttemptView]] = {}
        self.context: dict[str, Any] = {
            "input": run.input,
            "steps": {},
            "run": {"id": run.id, "correlation": run.correlation},
        }
        self.previous_output: Any = run.input
        self.ran_before = False  # has any step (not skipped) come before this one?
        if run.scope is not None:
            # A body run sees what its branch, item or iteration saw in the parent.
            scope = dict(run.scope)
            self.context = {
                **{k: v for k, v in scope.items() if k not in ("steps", "default")},
                "steps": dict(scope.get("steps") or {}),
                "run": self.context["run"],
            }
            self.previous_output, self.ran_before = scope.get("default"), True
        # The context entries before the run's own steps' (a body run's scope): a prefix
        # keeps only its steps' own.
        self._base = len(self.context["steps"])
        if prefix is not None and not self._prefixable(prefix):
            # The journal given lacks the prefix's rows: planning on would be wrong.
            raise ValueError("a prefix that does not apply to this run (prefix_applies)")
        self.prefix = prefix
        if self.prefix is not None:
            self.context["steps"].update(self.prefix.context)
            self.previous_output = self.prefix.previous_output
            self.ran_before = self.prefix.ran_before
        # For each top-level step the walk visited: (its index, the context entries, the
        # default input and ran_before before it), from which the next prefix is cut.
        self._marks: list[tuple[int, int, Any, bool]] = []
        # The first top-level step the walk did not settle (len(steps) when it settled all).
        self._stopped = 0
        self.counted = self.prefix.counted if self.prefix is not None else 0
        # What blocked the walk: a sleep or wait (waiting), or work in flight or due (busy).
        self.waiting = False
        self.busy = False
        self.approval = False
        self.budget = False
        # Why the last _Go.FAILED failed: {"class", "message", "step"}.
        self.failure: dict[str, Any] = {}
        # Where in the document the body being visited is ("fan.do"), for body runs.
        self._body_ref = ""
        # The planning budget (see plan()); Wakes are asked for again on every plan and are
        # no progress, so they do not count.
        self.max_actions: int | None = None
        self._wakes = 0
        # The step about to be visited heads a parallel's branch: never stopped before.
        self._branch_head = False
        # Opens a new run of the body being visited (set by _body_run), for _after_failure.
        self._reopen: Callable[[int], _Go] | None = None

    def _prefixable(self, prefix: Prefix | None = None) -> bool:
        view = self.run_view
        return prefix_applies(self.document, view.generation, view.reruns, prefix)

    def _current(self, journal: Sequence[AttemptView]) -> list[AttemptView]:
        """The journal without the attempts a retry from a step superseded."""
        if not self.run_view.reruns:
            return list(journal)
        is_superseded = superseded(self.document["steps"], self.run_view.reruns)
        current = []
        for attempt in journal:
            if is_superseded(attempt.path, attempt.step_id, attempt.generation):
                key = (attempt.path, attempt.step_id)
                self.superseded[key] = max(self.superseded.get(key, 0), attempt.attempt)
            else:
                current.append(attempt)
        return current

    def _fresh(self, path: str, step_id: str) -> int:
        """The number of a step's first attempt in this journal (1 unless superseded)."""
        return self.superseded.get((path, step_id), 0) + 1

    # entry

    def run(self) -> Plan:
        if self.run_view.status in ("completed", "failed", "cancelled", "timed_out"):
            return self.out
        deadline = self._start()
        if self.now >= deadline:
            timeout = self.limits.get("run_timeout_ms", DEFAULT_RUN_TIMEOUT_MS)
            self.out.actions.append(
                Finish(
                    "timed_out",
                    error={
                        "class": TIMEOUT,
                        "message": f"limits.run_timeout_ms ({timeout} ms) reached",
                        "step": None,
                    },
                )
            )
            return self.out
        if self.run_view.status == "paused":
            # A paused run only watches its deadline (its timer is set); resuming plans on.
            return self.out
        self._expire_attempts()
        self._index()
        if self._over_cost():
            return self.out
        go = self._walk_top()
        if go is _Go.FAILED and self._handled():
            go = self._on_failure()
        if go is _Go.CONTINUE:
            self._complete()
        elif go is _Go.FAILED:
            self.out.actions.append(Finish("failed", error=self.failure))
        elif go is _Go.BLOCKED:
            self.out.waiting = self.waiting and not self.busy
            self.out.approval = self.out.waiting and self.approval
            self.out.budget = self.out.waiting and self.budget
            self.out.prefix = self._next_prefix()
        return self.out

    def _handled(self) -> bool:
        """Whether the document's ``on_failure`` handler runs for this failure: a step's
        failure that fails the run (whatever its class, a step's time-out included), but not
        a run limit (``max_steps``, ``max_cost_usd``: the handler would run into it too). A
        body run (part of its parent's document) has no handler of its own; a run's deadline
        and an operator's cancel end the run without planning, so never reach here."""
        return (
            bool(self.document.get("on_failure"))
            and self.run_view.scope is None
            and self.failure.get("class") != LIMIT
        )

    def _on_failure(self) -> _Go:
        """Walk the ``on_failure`` steps, which read ``${error}`` (the failure: class,
        message, step) besides the run's input and steps; the first one's default input is the
        error. Done: the run completes with the last handler step's output (a STOP, its Finish
        planned). Failed: the run fails with the original error, the handler's alongside
        (``error.on_failure``)."""
        original = dict(self.failure)
        path = f"{ON_FAILURE}[{self.run_view.generation}]/"
        # What held the main walk before it failed holds the run no longer.
        self.waiting = self.busy = self.approval = self.budget = False
        self.context = {**self.context, "error": original, "steps": dict(self.context["steps"])}
        self.previous_output, self.ran_before = original, True
        position = len(self.out.actions)
        go, output = self._walk_branch(self.document["on_failure"], path)
        if go is _Go.CONTINUE:
            self.out.actions.append(Finish("completed", output=output))
            return _Go.STOP
        if go is _Go.FAILED:
            self.failure = {**original, "on_failure": dict(self.failure)}
        elif go is _Go.STOP:
            # The handler ran into a run limit (max_steps) or an unknown kind, which ended
            # the run at once: still the original error first, the handler's beside it.
            for index in range(position, len(self.out.actions)):
                ended = self.out.actions[index]
                if isinstance(ended, Finish) and ended.status == "failed" and ended.error:
                    error = {**original, "on_failure": dict(ended.error)}
                    self.out.actions[index] = replace(ended, error=error)
        return go

    def _walk_top(self) -> _Go:
        """The walk of the top-level steps, from the first one the prefix does not cover."""
        steps = self.document["steps"]
        for index in range(self.prefix.steps if self.prefix is not None else 0, len(steps)):
            marks = (index, len(self.context["steps"]), self.previous_output, self.ran_before)
            self._marks.append(marks)
            go = self._visit(steps[index], "")
            if go is not _Go.CONTINUE:
                self._stopped = index
                return go
        self._stopped = len(steps)
        return _Go.CONTINUE

    def _next_prefix(self) -> Prefix | None:
        """The settled beginning after this plan: the top-level steps before the first one
        that the walk did not settle, has a row in flight, or gets an action now; None when
        it is no longer than the prefix given, or the rows are not in step order."""
        if not self._prefixable() or not self._marks:
            return None
        start = self._marks[0][0]
        limit = self._stopped
        for attempt in self.given:
            if attempt.status in IN_FLIGHT:
                limit = min(limit, self.positions.get(_head(attempt.path, attempt.step_id), -1))
        for action in self.out.actions:
            if isinstance(action, Schedule | Skip | Open):
                limit = min(limit, self.positions.get(_head(action.path, action.step_id), -1))
        if limit <= start or limit - start >= len(self._marks):
            return None
        old = self.prefix
        through = old.through_id if old is not None else 0
        counted = old.counted if old is not None else 0
        children = old.children if old is not None else False
        size = old.size if old is not None else 0
        later = None
        generation = self.run_view.generation
        for attempt in self.given:
            position = self.positions.get(_head(attempt.path, attempt.step_id))
            if position is None:
                return None  # a row of no step of this document: never skip it
            if position < limit:
                through = max(through, attempt.id)
                counted += attempt.generation == generation and _counts_as_attempt(attempt)
                children = children or kinds.role_of(attempt.kind) is Role.CHILD
                size += attempt.size
            elif later is None or attempt.id < later:
                later = attempt.id
        if later is not None and later <= through:
            return None  # a later step's row older than a settled one's: read them all
        _, entries, previous_output, ran_before = self._marks[limit - start]
        return Prefix(
            steps=limit,
            through_id=through,
            generation=generation,
            context=dict(islice(self.context["steps"].items(), self._base, entries)),
            previous_output=previous_output,
            ran_before=ran_before,
            counted=counted,
            children=children,
            size=size,
        )

    def _start(self) -> datetime:
        view = self.run_view
        if view.started_at is not None and view.deadline_at is not None:
            return view.deadline_at
        timeout = self.limits.get("run_timeout_ms", DEFAULT_RUN_TIMEOUT_MS)
        started = view.started_at or self.now
        deadline = started + timedelta(milliseconds=timeout)
        self.out.actions.append(StartRun(started_at=started, deadline_at=deadline))
        return deadline

    def _expire_attempts(self) -> None:
        """Give up running attempts past their deadline or whose worker's lease lapsed, and
        plan on as if they had failed so; an at_most_once one becomes in_doubt instead."""
        grace = self.settings.deadline_grace
        for index, attempt in enumerate(self.journal):
            if attempt.status != "running" or kinds.role_of(attempt.kind) is not Role.WORKER:
                continue
            past_deadline = (
                attempt.deadline_at is not None and self.now >= attempt.deadline_at + grace
            )
            lapsed = attempt.lease_expires_at is not None and self.now >= attempt.lease_expires_at
            if (past_deadline or lapsed) and attempt.effect == "at_most_once":
                # It started (the claim committed before the body ran) and its worker never
                # reported: lost, or hung past its time limit (a lease never outlives the
                # deadline plus grace, so a worker lost during a step shorter than the lease
                # lapses here too). It may have had its effect: not run again, not failed
                # blindly; an operator says which, or its deadline fails it.
                why = "hung past its timeout_ms" if past_deadline else "was lost"
                expired = Expire(
                    attempt.id,
                    IN_DOUBT,
                    {
                        "class": LOST,
                        "message": f"the worker {why} after the attempt started, and never "
                        "reported: it may or may not have had its effect; an operator resolves "
                        "it (check its idempotency key with the third party), or it fails at "
                        "its deadline",
                    },
                    not_before=self.now + self.settings.in_doubt,
                )
            elif past_deadline:
                expired = Expire(
                    attempt.id,
                    "timed_out",
                    {"class": TIMEOUT, "message": "the attempt ran past its timeout_ms"},
                )
            elif lapsed:
                expired = Expire(
                    attempt.id,
                    "failed",
                    {"class": LOST, "message": "the worker was lost while running the attempt"},
                )
            else:
                continue
            self.out.actions.append(expired)
            self.journal[index] = replace(
                attempt,
                status=expired.status,
                error=expired.error,
                finished_at=None if expired.status == IN_DOUBT else self.now,
                not_before=expired.not_before,
            )

    def _index(self) -> None:
        # (self.counted starts at what the prefix's rows count.)
        generation = self.run_view.generation
        for attempt in self.journal:
            self.by_step.setdefault((attempt.path, attempt.step_id), []).append(attempt)
            if attempt.generation == generation and _counts_as_attempt(attempt):
                self.counted += 1
        for attempts in self.by_step.values():
            attempts.sort(key=lambda a: a.attempt)

    def _over_cost(self) -> bool:
        limit = self.limits.get("max_cost_usd")
        if limit is None:
            return False
        # Operators' top-ups raise it (POST /runs/{id}/budget).
        limit += self.run_view.budget_added_usd
        generation = self.run_view.generation
        spent = sum(a.cost_usd for a in self.journal if a.generation == generation)
        if spent <= limit:
            return False
        last = max(
            (a for a in self.journal if a.generation == generation and a.cost_usd),
            key=lambda a: a.id,
            default=None,
        )
        self.out.actions.append(
            Finish(
                "failed",
                error={
                    "class": LIMIT,
                    "message": f"limits.max_cost_usd ({limit}) exceeded: the steps reported "
                    f"${spent:.6f}",
                    "step": last.step_id if last else None,
                },
            )
        )
        return True

    def _complete(self) -> None:
        if "output" in self.document:
            try:
                output = resolve(self.document["output"], self.context, max_bytes=MAX_VALUE_BYTES)
            except TooLarge as error:
                message = f"output: the resolved output is {error}; the limit is 1 MiB"
                failure = {"class": INVALID_INPUT, "message": message, "step": None}
                self.out.actions.append(Finish("failed", error=failure))
                return
        else:
            output = self.previous_output if self.ran_before else None
        self.out.actions.append(Finish("completed", output=output))

    # steps

    def _walk(self, steps: Sequence[Mapping[str, Any]], path: str) -> _Go:
        for step in steps:
            go = self._visit(step, path)
            if go is not _Go.CONTINUE:
                return go
        return _Go.CONTINUE

    def _over_budget(self) -> bool:
        head, self._branch_head = self._branch_head, False
        if head or self.max_actions is None:
            return False
        return len(self.out.actions) - self._wakes >= self.max_actions

    def _visit(self, step: Mapping[str, Any], path: str) -> _Go:
        if self._over_budget():
            # Stop here; what is planned so far is applied, and the next plan goes on.
            self.out.more = self.busy = True
            return _Go.BLOCKED
        role = kinds.role_of(step["kind"])
        if role is Role.BRANCH:
            return self._condition(step, path)
        if role is Role.COMPOSITE:
            return self._composite(step, path)
        attempts = self.by_step.get((path, step["id"]), [])
        latest = attempts[-1] if attempts else None
        if latest is None:
            return self._first(step, path)
        if latest.status == "waiting":
            held_by = kinds.role_of(latest.kind)
            if held_by in kinds.WAITING_ROLES:
                return self._waiting(step, path, attempts, latest)
            if held_by is Role.CHILD:
                return self._child_waiting(step, path, attempts, latest)
            if held_by is None:
                # Its kind's module is not loaded here (removed, or not imported by this
                # process): nothing would ever end the wait, so the run fails saying so.
                return self._unsupported(step, f"step kind '{latest.kind}' is not registered")
        if latest.status == IN_DOUBT:
            return self._in_doubt(step, path, attempts, latest)
        if latest.budget is not None and latest.status == "scheduled":
            return self._budget_wait(latest)
        if latest.status in IN_FLIGHT:
            self.busy = True
            return _Go.BLOCKED
        if latest.status == "succeeded":
            self._settle(step, "succeeded", latest.output, None)
            return _Go.CONTINUE
        if latest.status == "skipped":
            self._settle_skipped(step)
            return _Go.CONTINUE
        return self._after_failure(step, path, attempts, latest)

    def _budget_wait(self, latest: AttemptView) -> _Go:
        """An attempt waiting for budget holds the run with no process alive for it; when
        the period it waits for ends (a timer at ``until`` plans the run then), it is
        offered again. A top-up or a raised budget offers it without the planner
        (runs.engine.budgets)."""
        until = (latest.budget or {}).get("until")
        due = datetime.fromisoformat(until) if until else None
        if due is not None and due <= self.now:
            self.out.actions.append(Unblock(latest.id))
            self.busy = True
            return _Go.BLOCKED
        if due is not None:
            self.out.actions.append(Wake(due, "budget_period", f"budget:{latest.id}:{until}"))
            self._wakes += 1
        self.waiting = self.budget = True
        return _Go.BLOCKED

    def _in_doubt(
        self,
        step: Mapping[str, Any],
        path: str,
        attempts: list[AttemptView],
        latest: AttemptView,
    ) -> _Go:
        """An at_most_once attempt whose worker was lost after it started: the run waits for
        an operator (who moves the row to succeeded or failed) until ``not_before``, when the
        attempt fails (class in_doubt, never retried) and the step's on_error applies."""
        if latest.not_before is None or self.now < latest.not_before:
            self.waiting = True
            return _Go.BLOCKED
        error = {
            "class": IN_DOUBT,
            "message": "in doubt since its worker was lost, and not resolved by an operator "
            f"before its deadline ({latest.not_before.isoformat()})",
        }
        self.out.actions.append(Close(latest.id, "failed", error=error))
        over = replace(latest, status="failed", error=error, finished_at=self.now)
        return self._after_failure(step, path, [*attempts[:-1], over], over)

    def _first(self, step: Mapping[str, Any], path: str) -> _Go:
        guard = step.get("when")
        if guard is not None and not evaluate(guard, self.context):
            self._skip(step, path)
            return _Go.CONTINUE
        return self._schedule(step, path, attempt=self._fresh(path, step["id"]))

    def _skip(self, step: Mapping[str, Any], path: str) -> None:
        generation = self.run_view.generation
        attempt = self._fresh(path, step["id"])
        self.out.actions.append(Skip(step["id"], path, step["kind"], generation, attempt))
        self._settle_skipped(step)

    def _after_failure(
        self,
        step: Mapping[str, Any],
        path: str,
        attempts: list[AttemptView],
        latest: AttemptView,
    ) -> _Go:
        generation = self.run_view.generation
        error = dict(latest.error or {"class": "fatal", "message": latest.status})
        continues = step.get("on_error", "fail_run") == "continue"
        if error.get("class") == LIMIT and latest.generation == generation:
            # A run limit the attempt ran into (a model call that would exceed
            # limits.max_cost_usd was never made): the run fails, whatever on_error says.
            return self._fail(step, error)
        if latest.generation < generation:
            # The run was retried from its failed step: this step starts a fresh budget,
            # unless an earlier generation already went on past it.
            if continues:
                # As that generation saw it: a rejected approval's decision stays its output.
                self._settle(step, "failed", latest.output, error)
                return _Go.CONTINUE
            if step["id"] == BODY and self._reopen is not None:
                # A body run: a new one (see _body_run).
                return self._reopen(latest.attempt + 1)
            return self._schedule(step, path, attempt=latest.attempt + 1)
        due = self._retry_due(step, path, attempts, latest, error)
        if due is not None:
            if due <= self.now:
                return self._schedule(step, path, attempt=latest.attempt + 1)
            self.out.actions.append(Wake(due, "retry_backoff", f"retry:{latest.id}"))
            self._wakes += 1
            self.busy = True
            return _Go.BLOCKED
        if continues:
            # A rejected approval keeps its decision as its output for the steps after it.
            self._settle(step, "failed", latest.output, error)
            return _Go.CONTINUE
        return self._fail(step, error)

    def _fail(self, step: Mapping[str, Any], error: Mapping[str, Any]) -> _Go:
        """The step failed and does not go on: its container (the run, a branch) fails."""
        self.failure = {
            "class": error.get("class", "fatal"),
            "message": error.get("message", ""),
            "step": error.get("step") or step["id"],
        }
        return _Go.FAILED

    def _retry_due(
        self,
        step: Mapping[str, Any],
        path: str,
        attempts: list[AttemptView],
        latest: AttemptView,
        error: Mapping[str, Any],
    ) -> datetime | None:
        """When the next attempt is due, or None when the step is not tried again."""
        error_class = error.get("class")
        at_most_once = step.get("effect", "at_least_once") == "at_most_once"
        finished = latest.finished_at or self.now
        if error_class == LOST:
            # A lost at_least_once attempt is offered again without using the budget; an
            # at_most_once one may have had its effect, so it is never run twice.
            return None if at_most_once else finished
        if error_class not in (RETRYABLE, TIMEOUT):
            return None
        if at_most_once and error_class == TIMEOUT:
            # A timed-out body may have done its effect before the limit hit it.
            return None
        policy = step.get("retry", {})
        kind = kinds.get(step["kind"])
        max_attempts = policy.get("max_attempts", kind.max_attempts if kind else 1)
        generation = self.run_view.generation
        used = sum(
            1
            for a in attempts
            if a.generation == generation and (a.error or {}).get("class") != LOST
        )
        if used >= max_attempts:
            return None
        delay_ms = backoff_ms(policy, used, seed=f"{self.run_view.id}/{path}/{step['id']}/{used}")
        delay_ms = max(delay_ms, int(error.get("retry_after_ms") or 0))
        return finished + timedelta(milliseconds=delay_ms)

    def _schedule(self, step: Mapping[str, Any], path: str, *, attempt: int) -> _Go:
        kind = step["kind"]
        if kinds.get(kind) is None:
            message = f"step kind '{kind}' is not supported by this engine yet"
            return self._unsupported(step, message)
        if self._out_of_steps(step["id"]):
            return _Go.STOP
        self.counted += 1
        try:
            return self._begin(step, path, attempt)
        except _Refused as refused:
            error = {"class": INVALID_INPUT, "message": str(refused)}
            return self._fail_new(step, path, attempt, error)

    def _unsupported(self, step: Mapping[str, Any], message: str) -> _Go:
        """The run fails: the step's kind has no module in the registry."""
        error = {"class": UNSUPPORTED, "message": message, "step": step["id"]}
        self.out.actions.append(Finish("failed", error=error))
        return _Go.STOP

    def _out_of_steps(self, step_id: str) -> bool:
        """Whether limits.max_steps is reached, by this run or by its tree of runs (then the
        run fails: a Finish is planned)."""
        ceiling = self.settings.max_steps_ceiling
        own = min(self.limits.get("max_steps", DEFAULT_MAX_STEPS), ceiling)
        view = self.run_view
        tree = own if view.tree_limit is None else min(view.tree_limit, ceiling)
        if self.counted >= own:
            message = f"limits.max_steps ({own}) reached"
        elif self.counted + view.tree_used >= tree:
            message = (
                f"limits.max_steps ({tree}) reached by the run, its subworkflows and their "
                f"bodies together ({self.counted + view.tree_used} attempts)"
            )
        else:
            return False
        if ceiling in (own, tree):
            message += f"; the deployment counts at most {ceiling} (DJFLOW_MAX_STEPS_CEILING)"
        error = {"class": LIMIT, "message": message, "step": step_id}
        self.out.actions.append(Finish("failed", error=error))
        return True

    def _fail_new(
        self, step: Mapping[str, Any], path: str, attempt: int, error: Mapping[str, Any]
    ) -> _Go:
        """A new attempt that fails before it starts: its row is written failed, and the step
        goes on as after any failure (invalid_input is never retried)."""
        self._open(step, path, attempt, status="failed", error=error)
        view = AttemptView(
            id=0,
            step_id=step["id"],
            attempt=attempt,
            status="failed",
            kind=step["kind"],
            path=path,
            generation=self.run_view.generation,
            error=error,
            finished_at=self.now,
        )
        attempts = [*self.by_step.get((path, step["id"]), []), view]
        return self._after_failure(step, path, attempts, view)

    def _resolve(self, template: Any, field: str) -> Any:
        """A step field's template resolved, at most MAX_VALUE_BYTES (else _Refused)."""
        try:
            return resolve(template, self.context, max_bytes=MAX_VALUE_BYTES)
        except TooLarge as error:
            raise _Refused(f"{field}: the resolved value is {error}; the limit is 1 MiB") from None

    def _begin(self, step: Mapping[str, Any], path: str, attempt: int) -> _Go:
        """The new attempt of a step, by its kind's role (counted already)."""
        kind = kinds.get(step["kind"])
        assert kind is not None  # _schedule refused an unknown kind
        if kind.role is not Role.WORKER:
            assert kind.open is not None  # Kind requires it of every other role reaching here
            return self._opened(step, path, attempt, kind, kind.open(step, self))
        step_input = kind.prepare(step, self) if kind.prepare else self._input(step)
        # Work offered now: the run shows running even when a sibling branch waits.
        self.busy = True
        self.out.actions.append(
            Schedule(
                step_id=step["id"],
                path=path,
                kind=kind.name,
                attempt=attempt,
                generation=self.run_view.generation,
                input=step_input,
                effect=step.get("effect", "at_least_once"),
                queue=step.get("queue", "default"),
                timeout_ms=step.get(
                    "timeout_ms", self.limits.get("step_timeout_ms", DEFAULT_STEP_TIMEOUT_MS)
                ),
            )
        )
        return _Go.BLOCKED

    def _opened(
        self, step: Mapping[str, Any], path: str, attempt: int, kind: kinds.Kind, row: Opening
    ) -> _Go:
        """Write the row a kind opened and go on as its status says: a wait holds the run, a
        running row (a hand-off, ended by its kind when applied) keeps it busy, a row over at
        once is settled or failed like any."""
        self._open(
            step,
            path,
            attempt,
            status=row.status,
            input=row.input,
            output=row.output,
            error=row.error,
            not_before=row.not_before,
            timer=row.timer,
            wait_key=row.wait_key,
            start=row.start,
        )
        if row.status == "waiting":
            self.waiting = True
            # Waiting for people: the run shows pending_approval.
            self.approval = self.approval or kind.role is Role.PEOPLE
            return _Go.BLOCKED
        if row.status == "running":
            self.busy = True
            return _Go.BLOCKED
        if row.status == "succeeded":
            self._settle(step, "succeeded", row.output, None)
            return _Go.CONTINUE
        view = AttemptView(
            id=0,
            step_id=step["id"],
            attempt=attempt,
            status=row.status,
            kind=kind.name,
            path=path,
            generation=self.run_view.generation,
            error=row.error,
            finished_at=self.now,
        )
        attempts = [*self.by_step.get((path, step["id"]), []), view]
        return self._after_failure(step, path, attempts, view)

    def _open(self, step: Mapping[str, Any], path: str, attempt: int, **row: Any) -> None:
        """Open this step's engine row (its kind, in this generation)."""
        self.out.actions.append(
            Open(
                step["id"],
                path,
                step["kind"],
                attempt=attempt,
                generation=self.run_view.generation,
                **row,
            )
        )

    # what a kind opening its step sees (workflows.kinds.Scope)

    @property
    def depth(self) -> int:
        return self.run_view.depth

    def resolve(self, template: Any, field: str) -> Any:
        return self._resolve(template, field)

    def input(self, step: Mapping[str, Any]) -> Any:
        return self._input(step)

    def after(self, timeout_ms: int | None) -> datetime | None:
        """When a wait with this ``timeout_ms`` times out (None: it does not)."""
        return self.now + timedelta(milliseconds=timeout_ms) if timeout_ms is not None else None

    def _waiting(
        self,
        step: Mapping[str, Any],
        path: str,
        attempts: list[AttemptView],
        latest: AttemptView,
    ) -> _Go:
        """A wait already waiting: over, as its kind says, once its time has come. (A
        wait_event that took an event is ``succeeded`` by the delivery, and an approval that
        was decided is ended by the decision, not here.)"""
        kind = kinds.get(latest.kind)
        assert kind is not None and kind.due is not None
        if latest.not_before is None or self.now < latest.not_before:
            self.waiting = True
            self.approval = self.approval or kind.role is Role.PEOPLE
            return _Go.BLOCKED
        ended = kind.due(step, latest)
        self.out.actions.append(
            Close(latest.id, ended.status, output=ended.output, error=ended.error, kind=kind.name)
        )
        if ended.status == "succeeded":
            self._settle(step, "succeeded", ended.output, None)
            return _Go.CONTINUE
        over = replace(latest, status=ended.status, error=ended.error, finished_at=self.now)
        return self._after_failure(step, path, [*attempts[:-1], over], over)

    def _child_waiting(
        self,
        step: Mapping[str, Any],
        path: str,
        attempts: list[AttemptView],
        latest: AttemptView,
    ) -> _Go:
        """A subworkflow's row waits while its child run runs; the child's end is the step's:
        its output, or its failure (with the child's error class)."""
        child = latest.child or {}
        status = child.get("status")
        if status == "completed":
            self.out.actions.append(Close(latest.id, "succeeded", output=child.get("output")))
            self._settle(step, "succeeded", child.get("output"), None)
            return _Go.CONTINUE
        if status not in CHILD_FAILED:
            self.waiting = True
            # A child waiting for people holds the parent for them too.
            self.approval = self.approval or status == "pending_approval"
            return _Go.BLOCKED
        child_error = child.get("error") or {}
        error = {
            "class": child_error.get("class") or status,
            "message": f"child run {child.get('id')} {status}: {child_error.get('message', '')}",
        }
        if step["id"] == BODY and child_error.get("step"):
            # A body's failure names the step inside it that failed.
            error["step"] = child_error["step"]
        ended = "timed_out" if status == "timed_out" else "failed"
        self.out.actions.append(Close(latest.id, ended, error=error))
        failed_view = replace(latest, status=ended, error=error, finished_at=self.now)
        return self._after_failure(step, path, [*attempts[:-1], failed_view], failed_view)

    def _input(self, step: Mapping[str, Any]) -> Any:
        if "input" in step:
            return self._resolve(step["input"], "input")
        # The default: the run input for the first step, else the previous step's output.
        default = self.previous_output if self.ran_before else self.run_view.input
        try:
            check_size(default, MAX_VALUE_BYTES)
        except TooLarge as error:
            raise _Refused(f"input: the default input is {error}; the limit is 1 MiB") from None
        return copy.deepcopy(default)

    def _already_settled(self, step: Mapping[str, Any], latest: AttemptView | None) -> bool:
        """An engine row (a condition's, a composite's) that already ended well: its output,
        or its skip, goes into the context as it is."""
        if latest is not None and latest.status == "succeeded":
            self._settle(step, "succeeded", latest.output, None)
            return True
        if latest is not None and latest.status == "skipped":
            self._settle_skipped(step)
            return True
        return False

    def _condition(self, step: Mapping[str, Any], path: str) -> _Go:
        attempts = self.by_step.get((path, step["id"]), [])
        latest = attempts[-1] if attempts else None
        generation = self.run_view.generation
        if self._already_settled(step, latest):
            return _Go.CONTINUE
        opening = latest is None or (latest.status != "running" and latest.generation < generation)
        if latest is None:
            guard = step.get("when")
            if guard is not None and not evaluate(guard, self.context):
                self._skip(step, path)
                return _Go.CONTINUE
        position = len(self.out.actions)
        if opening:
            branch = "then" if evaluate(step["if"], self.context) else "else"
        elif latest is not None and latest.status == "running":
            branch = latest.branch
        else:
            return _Go.BLOCKED  # a row of this generation that ended without succeeding
        go, output = self._walk_branch(step.get(branch, []), path)
        done = go is _Go.CONTINUE
        # A branch that failed closes the condition's row as failed (inside a composite step
        # with on_error: continue the run goes on without it).
        status = "succeeded" if done else "failed" if go is _Go.FAILED else "running"
        if opening:
            self.out.actions.insert(
                position,
                Open(
                    step["id"],
                    path,
                    step["kind"],
                    attempt=(latest.attempt + 1) if latest else self._fresh(path, step["id"]),
                    generation=generation,
                    branch=branch,
                    status=status,
                    output=output if done else None,
                    error=self.failure if go is _Go.FAILED else None,
                ),
            )
        elif status != "running" and latest is not None:
            error = self.failure if go is _Go.FAILED else None
            self.out.actions.append(Close(latest.id, status, output=output, error=error))
        if done:
            self._settle(step, "succeeded", output, None)
            return _Go.CONTINUE
        return go

    def _walk_branch(self, steps: Sequence[Mapping[str, Any]], path: str) -> tuple[_Go, Any]:
        """Walk a condition's branch; when it is done, also the output of its last step."""
        last = None
        for step in steps:
            go = self._visit(step, path)
            if go is not _Go.CONTINUE:
                return go, None
            last = self.context["steps"][step["id"]]["output"]
        return _Go.CONTINUE, last

    # composite steps: parallel, foreach, loop

    def _composite(self, step: Mapping[str, Any], path: str) -> _Go:
        """A parallel, foreach or loop step: an engine row open while the steps inside run,
        each at a path of its own (``<path><id>[<branch|index|iteration>]/``), so every item
        and iteration has its own journal rows, attempts and retries."""
        attempts = self.by_step.get((path, step["id"]), [])
        latest = attempts[-1] if attempts else None
        generation = self.run_view.generation
        if self._already_settled(step, latest):
            return _Go.CONTINUE
        if latest is not None and latest.status != "running" and latest.generation == generation:
            # Failed in this generation: it went on (continue), or the run has ended.
            error = dict(latest.error or {"class": "fatal", "message": latest.status})
            if _goes_on(step, error):
                self._settle(step, "failed", None, error)
                return _Go.CONTINUE
            return self._fail(step, error)
        if latest is None:
            guard = step.get("when")
            if guard is not None and not evaluate(guard, self.context):
                self._skip(step, path)
                return _Go.CONTINUE
        opening = latest is None or latest.status != "running"
        position = len(self.out.actions)
        inner = f"{path}{step['id']}"
        saved = (self.context, self.previous_output, self.ran_before)
        try:
            if step["kind"] == "parallel":
                go, output = self._parallel(step, inner)
            elif step["kind"] == "foreach":
                go, output = self._foreach(step, inner)
            else:
                go, output = self._loop(step, inner)
            if go is _Go.CONTINUE:
                # The outputs of all its branches, items or iterations: bounded like any.
                try:
                    check_size(output, MAX_VALUE_BYTES)
                except TooLarge as error:
                    message = f"output: the step's output is {error}; the limit is 1 MiB"
                    raise _Refused(message) from None
        except _Refused as refused:
            go, output = self._fail_inside(step, str(refused)), None
        finally:
            self.context, self.previous_output, self.ran_before = saved
        if go is _Go.FAILED:
            self._abandon(inner, position)
        status = {_Go.CONTINUE: "succeeded", _Go.FAILED: "failed"}.get(go, "running")
        failure = dict(self.failure) if go is _Go.FAILED else None
        if opening:
            self.out.actions.insert(
                position,
                Open(
                    step["id"],
                    path,
                    step["kind"],
                    attempt=(latest.attempt + 1) if latest else self._fresh(path, step["id"]),
                    generation=generation,
                    status=status,
                    output=output if go is _Go.CONTINUE else None,
                    error=failure,
                ),
            )
        elif status != "running" and latest is not None:
            self.out.actions.append(Close(latest.id, status, output=output, error=failure))
        if go is _Go.CONTINUE:
            self._settle(step, "succeeded", output, None)
            return _Go.CONTINUE
        if go is _Go.FAILED:
            if _goes_on(step, self.failure):
                self._settle(step, "failed", None, failure)
                return _Go.CONTINUE
            return self._fail(step, self.failure)
        return go

    def _inside(self, body: Mapping[str, Any], path: str, **roots: Any) -> tuple[_Go, Any]:
        """Visit the one step of a branch, item or iteration at ``path``, with the template
        roots of that scope (``item``, ``index``, ``iter``); its default input is
        ``roots["default"]``. Returns how it went and, when settled, its output."""
        default = roots.pop("default")
        if isinstance(body, list) and len(body) > 1:
            if self._over_budget():
                self.out.more = self.busy = True
                return _Go.BLOCKED, None
            return self._body_run(path, roots, default)
        body = _one(body)
        self.context = {**self.context, **roots, "steps": dict(self.context["steps"])}
        self.previous_output, self.ran_before = default, True
        go = self._visit(body, path)
        output = self.context["steps"][body["id"]]["output"] if go is _Go.CONTINUE else None
        return go, output

    def _body_run(self, path: str, roots: dict[str, Any], default: Any) -> tuple[_Go, Any]:
        """A body of several steps runs as an anonymous child run (its own journal, so waits
        and approvals work at any depth): a subworkflow row here, the steps in the child."""
        stand_in = {"id": BODY, "kind": BODY_KIND}
        attempts = self.by_step.get((path, BODY), [])
        latest = attempts[-1] if attempts else None
        if latest is None:
            return self._open_body(path, roots, default, self._fresh(path, BODY)), None
        if (
            latest.status not in IN_FLIGHT
            and latest.status != "succeeded"
            and latest.generation < self.run_view.generation
        ):
            # A body run that failed before a retry of the run starts again as a new body
            # run (it has no workflow of its own to schedule again).
            return self._open_body(path, roots, default, latest.attempt + 1), None
        # The same when its child fails now, in an older generation (see _after_failure).
        self._reopen = partial(self._open_body, path, roots, default)
        saved = self.context
        self.context = {**self.context, "steps": dict(self.context["steps"])}
        try:
            if latest.status == "waiting":
                go = self._child_waiting(stand_in, path, attempts, latest)
            elif latest.status == "succeeded":
                self._settle(stand_in, "succeeded", latest.output, None)
                go = _Go.CONTINUE
            elif latest.status in IN_FLIGHT:
                self.busy = True
                go = _Go.BLOCKED
            else:
                go = self._after_failure(stand_in, path, attempts, latest)
            output = self.context["steps"][BODY]["output"] if go is _Go.CONTINUE else None
        finally:
            self.context, self._reopen = saved, None
        return go, output

    def _open_body(self, path: str, roots: dict[str, Any], default: Any, attempt: int) -> _Go:
        """Open a body run (the subworkflow row that starts it) with the scope it sees."""
        stand_in = {"id": BODY, "kind": BODY_KIND}
        if self._out_of_steps(BODY):
            return _Go.STOP
        scope = {
            "input": self.context["input"],
            "steps": self.context["steps"],
            **roots,
            "default": default,
        }
        try:
            # The body run's input: it is copied into every body run, so it is bounded.
            check_size(scope, MAX_VALUE_BYTES)
        except TooLarge as error:
            message = (
                f"input: the body's scope (the run input, the outputs of the steps before "
                f"it, its item or iteration) is {error}; the limit is 1 MiB"
            )
            return self._fail(stand_in, {"class": INVALID_INPUT, "message": message})
        self.counted += 1
        self.out.actions.append(
            Open(
                BODY,
                path,
                BODY_KIND,
                attempt=attempt,
                generation=self.run_view.generation,
                status="waiting",
                start={"body": self._body_ref, "input": scope},
            )
        )
        self.waiting = True
        return _Go.BLOCKED

    def _started(self, body: Any, path: str) -> bool:
        first = BODY if isinstance(body, list) and len(body) > 1 else _one(body)["id"]
        return (path, first) in self.by_step

    def _parallel(self, step: Mapping[str, Any], inner: str) -> tuple[_Go, Any]:
        """Every branch is planned in the same pass, so all are journaled before any is
        offered. With ``mode`` ``fail_fast`` (the default) a branch that fails with fail_run
        fails the step and the others are cancelled (see _abandon); with ``all_settled``
        every branch runs to its end and the step succeeds once all have, its output
        ``{branch: {status, output, error}}``. A run-level stop (a limit) stops either."""
        settled = step.get("mode", "fail_fast") == "all_settled"
        outputs: dict[str, Any] = {}
        blocked = False
        # Each branch's default input is the parallel step's own (its input template, else the
        # previous step's output).
        scope = (self.context, self._input(step))
        for name, body in step["branches"].items():
            self._body_ref = f"{step['id']}.branches.{name}"
            self.context = scope[0]
            self._branch_head = True
            go, output = self._inside(body, f"{inner}[{name}]/", default=scope[1])
            if go is _Go.CONTINUE:
                outputs[name] = self._branch_outcome(body, output) if settled else output
            elif go is _Go.BLOCKED:
                blocked = True
            elif go is _Go.FAILED and settled:
                # The branch's failure stays its own: the step goes on with the others.
                outputs[name] = {"status": "failed", "output": None, "error": dict(self.failure)}
                self.failure = {}
            else:
                return go, None
        return (_Go.BLOCKED, None) if blocked else (_Go.CONTINUE, outputs)

    def _branch_outcome(self, body: Any, output: Any) -> dict[str, Any]:
        """An all_settled branch that went on: ``{status, output, error}`` as its step
        settled (succeeded, skipped, or failed with ``on_error: continue``); a body of
        several steps (a body run) that went on succeeded."""
        if isinstance(body, list) and len(body) > 1:
            return {"status": "succeeded", "output": output, "error": None}
        settled = self.context["steps"][_one(body)["id"]]
        error = settled.get("error")
        return {
            "status": settled["status"],
            "output": output,
            # The output is read by the run's viewers and starters (and webhooks); a
            # traceback is for the workflow's operators only (CONTRACT section 8).
            "error": {k: v for k, v in error.items() if k != "traceback"} if error else None,
        }

    def _foreach(self, step: Mapping[str, Any], inner: str) -> tuple[_Go, Any]:
        """Items in order; at most ``concurrency`` in flight at any moment (a sliding window:
        a finished item lets the next one start). The output is in item order."""
        items = self._resolve(step["items"], "items")
        if not isinstance(items, list):
            shown = "null" if items is None else type(items).__name__
            return self._fail_inside(step, f"items: expected an array, got {shown}"), None
        limit = step.get("max_items", DEFAULT_MAX_ITEMS)
        if len(items) > limit:
            message = f"items: {len(items)} items exceed max_items ({limit})"
            return self._fail_inside(step, message), None
        cap = step.get("concurrency")
        body = step["do"]
        self._body_ref = f"{step['id']}.do"
        scope = self.context
        outputs: list[Any] = []
        active = 0
        blocked = False
        for index, item in enumerate(items):
            item_path = f"{inner}[{index}]/"
            if cap is not None and active >= cap and not self._started(body, item_path):
                blocked = True
                break
            self.context = scope
            go, output = self._inside(body, item_path, item=item, index=index, default=item)
            if go is _Go.CONTINUE:
                outputs.append(output)
            elif go is _Go.BLOCKED:
                blocked = True
                active += 1
            else:
                return go, None
        return (_Go.BLOCKED, None) if blocked else (_Go.CONTINUE, outputs)

    def _loop(self, step: Mapping[str, Any], inner: str) -> tuple[_Go, Any]:
        """``do`` again and again: iteration k sees ``iter.index`` k and ``iter.previous``
        (the output of iteration k-1, null for the first). After each, ``until`` is evaluated
        with ``iter.index`` k and ``iter.previous`` the output just made; the loop ends when
        it holds or after ``max_iterations``. The output is the last iteration's."""
        body = step["do"]
        self._body_ref = f"{step['id']}.do"
        scope = self.context
        previous: Any = self._input(step)
        output: Any = None
        for index in range(step["max_iterations"]):
            self.context = scope
            go, output = self._inside(
                body,
                f"{inner}[{index}]/",
                iter={"index": index, "previous": output if index else None},
                default=previous,
            )
            if go is not _Go.CONTINUE:
                return go, None
            previous = output
            until = step.get("until")
            after = {**scope, "iter": {"index": index, "previous": output}}
            last = BODY if isinstance(body, list) and len(body) > 1 else _one(body)["id"]
            settled = {"output": output, "status": "succeeded", "error": None}
            after["steps"] = {**scope["steps"], last: settled}
            if until is not None and evaluate(until, after):
                break
        return _Go.CONTINUE, output

    def _fail_inside(self, step: Mapping[str, Any], message: str) -> _Go:
        return self._fail(step, {"class": INVALID_INPUT, "message": message})

    def _abandon(self, inner: str, position: int) -> None:
        """A composite step failed: nothing more inside it starts, and what is in flight
        inside it is cancelled (a running body's result will be refused)."""
        prefix = f"{inner}["
        self.out.actions[position:] = [
            action
            for action in self.out.actions[position:]
            if not isinstance(action, Schedule | Wake)
            and not (isinstance(action, Open) and action.status in ("running", "waiting"))
        ]
        doomed = tuple(
            a.id
            for a in self.journal
            if a.path.startswith(prefix) and a.status in IN_FLIGHT and a.id
        )
        if doomed:
            self.out.actions.append(Cancel(doomed))

    # context

    def _record(
        self, step: Mapping[str, Any], status: str, output: Any, error: Mapping[str, Any] | None
    ) -> None:
        self.context["steps"][step["id"]] = {
            "output": output,
            "status": status,
            "error": dict(error) if error else None,
        }

    def _settle(
        self, step: Mapping[str, Any], status: str, output: Any, error: Mapping[str, Any] | None
    ) -> None:
        self._record(step, status, output, error)
        self.previous_output = output
        self.ran_before = True

    def _settle_skipped(self, step: Mapping[str, Any]) -> None:
        self._record(step, "skipped", None, None)


def superseded(
    steps: Sequence[Mapping[str, Any]], reruns: Sequence[tuple[int, str]]
) -> Callable[[str, str, int], bool]:
    """Whether a journal row (its path, step id and generation) was superseded by a retry from
    a step (``RunView.reruns``): it is of a generation before the retry's, and of the step the
    retry reran from, a later top-level step, or a step inside one of them (the path of a row
    inside a composite step starts with its id). For the planner and for whoever shows the
    journal."""
    order = {step["id"]: index for index, step in enumerate(steps)}
    top = top_level_ids(steps)
    # For each retry, the first top-level position it reran from.
    cuts = [(generation, order.get(step, len(steps))) for generation, step in reruns]

    def check(path: str, step_id: str, generation: int) -> bool:
        head = path.split("[", 1)[0] if path else step_id
        index = order.get(top.get(head, head))
        return index is not None and any(generation < g and at <= index for g, at in cuts)

    return check


def top_level_ids(steps: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The id of every step of a document (nested ones too: ids are unique in a document)
    mapped to the id of the top-level step it is, or is inside."""
    found: dict[str, str] = {}

    def visit(body: Any, top: str) -> None:
        for step in body if isinstance(body, list) else [body]:
            if not isinstance(step, Mapping):
                continue
            found[step["id"]] = top
            for name in ("then", "else", "do"):
                if name in step:
                    visit(step[name], top)
            for branch in (step.get("branches") or {}).values():
                visit(branch, top)

    for step in steps:
        visit(step, step["id"])
    return found


def prefix_applies(
    document: Mapping[str, Any],
    generation: int,
    reruns: Sequence[tuple[int, str]],
    prefix: Prefix | None = None,
) -> bool:
    """Whether a prefix may stand for a run's settled rows (and a plan cut one): not after a
    retry from a step, which supersedes settled rows, nor under a cost limit, which sums every
    row's cost (a model call settled after its attempt was given up still adds to it); and a
    prefix only in the generation it was cut in."""
    if reruns or "max_cost_usd" in document.get("limits", {}):
        return False
    return prefix is None or prefix.generation == generation


def positions_of(steps: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The id of every step of a document (nested ones too) mapped to the index of the
    top-level step it is, or is inside."""
    order = {step["id"]: index for index, step in enumerate(steps)}
    return {step_id: order[top] for step_id, top in top_level_ids(steps).items()}


def _head(path: str, step_id: str) -> str:
    """The step a journal row belongs to at the top of its path: the row's own step at the
    top level or in a condition's branch (no path), else the composite its path starts in."""
    return path.split("[", 1)[0] if path else step_id


def _goes_on(step: Mapping[str, Any], error: Mapping[str, Any]) -> bool:
    """Whether a failed composite step lets its container go on (``on_error: continue``):
    never for a run limit one of its steps ran into (DJFLOW_MAX_RUN_BYTES, a model call over
    ``max_cost_usd``), which fails the run whatever on_error says, as for a plain step."""
    return step.get("on_error", "fail_run") == "continue" and error.get("class") != LIMIT


def _one(body: Any) -> Mapping[str, Any]:
    """A body given as one step, or as a list holding one step, is that step."""
    step: Mapping[str, Any] = body[0] if isinstance(body, list) else body
    return step


def _counts_as_attempt(attempt: AttemptView) -> bool:
    """``max_steps`` counts every attempt of a step body; skips, condition rows and the rows
    of composite steps (which hold other steps) are not."""
    return attempt.status != "skipped" and kinds.role_of(attempt.kind) not in HOLDERS


def backoff_ms(policy: Mapping[str, Any], failures: int, *, seed: str) -> int:
    """The wait before the next attempt after ``failures`` failed ones (contract section 1:
    ``min(max_ms, initial_ms * 2^(failures-1) + jitter)`` for exponential back-off)."""
    backoff = policy.get("backoff", "exponential")
    if backoff == "none":
        return 0
    initial = policy.get("initial_ms", DEFAULT_INITIAL_MS)
    ceiling = policy.get("max_ms", DEFAULT_MAX_MS)
    base = initial if backoff == "fixed" else initial * 2 ** max(failures - 1, 0)
    jitter = 0
    if policy.get("jitter", True) and base > 0:
        digest = hashlib.sha256(seed.encode()).digest()
        fraction = int.from_bytes(digest[:8], "big") / 2**64
        jitter = int(base * JITTER_SHARE * fraction)
    return int(min(ceiling, base + jitter))
