"""Runs and the step journal: Postgres is the only source of truth for what a run did.

A run pins one workflow version. Every attempt of every step is its own ``StepRun`` row:
claimed, completed and expired by conditional updates (see ``runs.engine.apply`` and
``workers.execution``), never read-modify-written without a lock or a condition.
"""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from workflows.models import Workflow, WorkflowVersion

from .status import RUN_TERMINAL, DeliveryStatus, RunStatus, StepStatus

# Every status but the ends, as the partial indexes name them (in the table's order).
RUN_NOT_ENDED = [str(status) for status in RunStatus if status not in RUN_TERMINAL]


class Effect(models.TextChoices):
    AT_LEAST_ONCE = "at_least_once"
    AT_MOST_ONCE = "at_most_once"


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow = models.ForeignKey(
        Workflow, on_delete=models.PROTECT, related_name="runs", db_index=False
    )
    version = models.ForeignKey(WorkflowVersion, on_delete=models.PROTECT, related_name="runs")
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.PENDING)
    # Stored with its secrets (writeOnly fields) replaced by tokens; see workflows.secrets.
    input = models.JSONField(null=True, blank=True)
    # The only place a secret's plaintext is kept: token -> value, encrypted (runs.vault).
    # A child run's holds its parent's too, since its input may carry the parent's tokens.
    # A database default too: raw inserts (benchmarks, bulk tools) need not name it.
    secrets = models.TextField(blank=True, default="", db_default="", editable=False)
    output = models.JSONField(null=True, blank=True)
    # {"class", "message", "step"} once the run has failed, timed out or been cancelled.
    error = models.JSONField(null=True, blank=True)
    # NULL, not "", means "none given": the unique constraint below only binds given keys.
    correlation = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # Indexed by the partial indexes below, not by a full foreign-key index each: most runs
    # have no parent, and every run insert wrote those NULLs into two more indexes.
    parent_run = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="children",
        db_index=False,
    )
    parent_step_run = models.ForeignKey(
        "StepRun",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    # The run at the top of this run's tree (null for a root run), and how many subworkflows
    # below it this run is (a body run is as deep as the run it is a body of): the root's
    # max_steps counts the attempts of the whole tree, and chains are at most 8 deep.
    root_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="+", db_index=False
    )
    # A database default too: raw inserts of runs (a benchmark, a test) need not name it.
    depth = models.PositiveSmallIntegerField(default=0, db_default=0)
    # For an anonymous child run (a branch, item or iteration whose body is a list of steps):
    # where its steps are in the version's document, "<composite step id>.do" or
    # "<parallel step id>.branches.<name>". Its input is then the scope it runs in:
    # {"input", "steps", "default", and "item"/"index" or "iter"}.
    body = models.CharField(max_length=300, blank=True, default="")
    # A retry from the failed step starts a new generation: attempt budgets and limits count
    # within one generation, and what earlier generations completed is kept.
    generation = models.PositiveIntegerField(default=1)
    # Each retry from a step (runs.services.run_retry with from_step), oldest first:
    # [{"generation": g, "from_step": <top-level step id>}]. The planner reads it to leave
    # out the attempts it superseded (that step's and every later top-level step's, of
    # generations before g), which stay in the journal.
    reruns = models.JSONField(default=list, blank=True, db_default=[])
    attempts = models.PositiveIntegerField(default=0)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    # Bytes of values this run has stored (compact JSON: its attempts' inputs, outputs, errors
    # and spans, its children's inputs), a running total kept in the statements that write
    # them and checked against DJFLOW_MAX_RUN_BYTES (runs.engine.store.charging).
    stored_bytes = models.BigIntegerField(default=0, db_default=0)
    # Who the run's model calls count against (CONTRACT section 10: the per-account model
    # concurrency): the start's ``account``, else the starter's username; a child run has its
    # root's.
    account = models.CharField(max_length=150, blank=True, default="", db_default="")
    # What operators added to the run's limits.max_cost_usd (POST /runs/{id}/budget): the
    # run's limit is the document's plus this (runs.engine.costs).
    budget_added_usd = models.DecimalField(
        max_digits=14, decimal_places=6, default=Decimal("0"), db_default=Decimal("0")
    )
    # 0 (lowest) to 9 (highest), from the start (POST /runs): sent with the run's messages
    # as the broker's priority, and the order runs waiting for a concurrency slot of one key
    # are admitted in (higher first, then arrival).
    priority = models.PositiveSmallIntegerField(default=5, db_default=5)
    # The document's ``concurrency`` key resolved over the run's input ("" for a limit per
    # workflow); NULL for a run no concurrency limit applies to (runs.engine.slots).
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # When a run with a concurrency key was given a slot; NULL while it waits for one
    # (``pending``, nothing planned, no worker held). It holds the slot until it ends.
    admitted_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # When the run times out (limits.run_timeout_ms from the start of this generation); a
    # run-deadline timer fires then.
    deadline_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # A fork (POST /runs/{id}/fork, CONTRACT section 16): the run it was forked from, and the
    # top-level step it began at ("" for a fork from the start). The journal rows of the steps
    # before it are copies of the source's (runs.forks), never run here.
    forked_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks"
    )
    fork_step = models.CharField(max_length=100, blank=True, default="", db_default="")
    # Recipe versions this run's recipe steps use whatever their step pins ({name: version}):
    # a fork's ``recipes``. Read with the claim (workers.claims), applied by the worker.
    recipe_pins = models.JSONField(default=dict, blank=True, db_default={})

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [
            ("choose_account", "Can start runs on behalf of any account (model concurrency)")
        ]
        indexes = [
            models.Index(fields=["-created_at", "-id"], name="run_newest"),
            models.Index(fields=["status", "-created_at", "-id"], name="run_status_newest"),
            models.Index(fields=["workflow", "-created_at", "-id"], name="run_workflow_newest"),
            models.Index(
                fields=["workflow", "status", "-created_at", "-id"], name="run_wf_status_newest"
            ),
            # The reconciler's look for runs that need the engine without a message.
            models.Index(
                fields=["updated_at"],
                name="run_active_updated",
                condition=Q(status__in=["pending", "running", "waiting", "pending_approval"]),
            ),
            models.Index(
                fields=["parent_run"], name="run_parent", condition=Q(parent_run__isnull=False)
            ),
            # Deleting a step run sets this to NULL where it is the step run (SET_NULL).
            models.Index(
                fields=["parent_step_run"],
                name="run_parent_step_run",
                condition=Q(parent_step_run__isnull=False),
            ),
            # Counting a tree's attempts (runs.engine.journal.tree_budget).
            models.Index(fields=["root_run"], name="run_root", condition=Q(root_run__isnull=False)),
            # The runs page (/runs/): its account filter, newest first, and its exact search
            # by correlation or idempotency key (the unique constraints below lead with the
            # workflow, so they serve no search across workflows). Partial: most runs have
            # neither, and those rows cost these indexes nothing.
            models.Index(fields=["account", "-created_at", "-id"], name="run_account_newest"),
            models.Index(
                fields=["correlation"],
                name="run_correlation",
                condition=Q(correlation__isnull=False),
            ),
            models.Index(
                fields=["idempotency_key"],
                name="run_idempotency_key",
                condition=Q(idempotency_key__isnull=False),
            ),
            # Runs waiting for a concurrency slot, in the order a key admits them
            # (runs.engine.slots); partial: only waiting runs are in it.
            models.Index(
                "workflow",
                "concurrency_key",
                models.F("priority").desc(),
                "created_at",
                "id",
                name="run_slot_queue",
                condition=Q(
                    status="pending", concurrency_key__isnull=False, admitted_at__isnull=True
                ),
            ),
            # The runs holding a slot of a key: counted under the key's gate lock.
            models.Index(
                fields=["workflow", "concurrency_key"],
                name="run_slot_holders",
                condition=Q(
                    concurrency_key__isnull=False,
                    admitted_at__isnull=False,
                    status__in=RUN_NOT_ENDED,
                ),
            ),
        ]
        constraints = [
            # Idempotency keys are scoped to (workflow, caller) (CONTRACT section 8): one
            # user's key can neither find nor block another's run. Two partial constraints,
            # because NULLs are distinct in a unique index (and SQLite has no NULLS NOT
            # DISTINCT): starts by trusted code (no user) share one scope.
            models.UniqueConstraint(
                fields=["workflow", "created_by", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False, created_by__isnull=False),
                name="run_idempotency_key_per_user",
            ),
            models.UniqueConstraint(
                fields=["workflow", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False, created_by__isnull=True),
                name="run_idempotency_key_no_user",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow_id} run {self.id}"


class StepRun(models.Model):
    """One attempt of one step of a run."""

    # Indexed by step_run_journal, which leads with it.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    step_id = models.CharField(max_length=100)
    # Where the step sits when it runs more than once in a run (a foreach item, a loop
    # iteration); empty for a step of the top-level list or a condition's branch.
    path = models.CharField(max_length=500, blank=True, default="")
    kind = models.CharField(max_length=32)
    attempt = models.PositiveIntegerField()
    generation = models.PositiveIntegerField(default=1)
    status = models.CharField(max_length=20, choices=StepStatus.choices)
    # For a condition: the branch taken ("then" or "else").
    branch = models.CharField(max_length=100, blank=True, default="")
    input = models.JSONField(null=True, blank=True)
    output = models.JSONField(null=True, blank=True)
    # {"class", "message", "traceback"?}
    error = models.JSONField(null=True, blank=True)
    effect = models.CharField(max_length=20, choices=Effect.choices, default=Effect.AT_LEAST_ONCE)
    queue = models.CharField(max_length=200, default="default")
    timeout_ms = models.BigIntegerField(default=60000)
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    worker = models.CharField(max_length=255, blank=True, default="")
    # The fencing token of the claim: a completion must present it, so a worker whose lease
    # expired (and whose attempt was given up or offered again) cannot record a result.
    claim = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    # For a sleep, when it is over; for a wait_event, when it times out; for an in_doubt
    # attempt, when its doubt expires and it fails (unless an operator resolved it first).
    not_before = models.DateTimeField(null=True, blank=True)
    # For a wait_event: digest of its (event name, resolved key), what deliveries look up.
    wait_key = models.CharField(max_length=64, blank=True, default="")
    # For a wait_event that took an event: that event (taken at most once per run).
    # Almost always NULL: a partial index (below) instead of a full foreign-key index, which
    # every attempt's insert wrote to.
    event = models.ForeignKey(
        "Event", null=True, blank=True, on_delete=models.PROTECT, related_name="+", db_index=False
    )
    # Times a worker without the handler handed the attempt back (class unservable).
    refusals = models.PositiveIntegerField(default=0)
    # While no live worker serves the attempt's handler on its queue: that handler, and when
    # this was first seen; an ``unservable`` timer fails the attempt UNSERVABLE_SECONDS
    # after, unless a worker that serves it shows up (``runs.engine.unservable``).
    waiting_for = models.CharField(max_length=200, blank=True, default="")
    waiting_since = models.DateTimeField(null=True, blank=True)
    usage = models.JSONField(default=dict, blank=True)
    spans = models.JSONField(default=list, blank=True)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    # The worst case of the model call this attempt is making now, held against the run's
    # (and its root's) limits.max_cost_usd until the call is settled (runs.engine.costs);
    # an attempt that ended with some still held (its worker lost) has it released by the
    # reconciler.
    reserved_usd = models.DecimalField(
        max_digits=14, decimal_places=6, default=Decimal("0"), db_default=Decimal("0")
    )
    # A scheduled attempt whose model call did not fit a budget (limits.on_budget "wait"):
    # {"limit": "run"|"account", "asked_usd", "message", "run"?, "account"?, "until"?}. It is
    # not offered (the reconciler leaves it) until a top-up, a raised account budget or the
    # period's end (``until``) clears it (runs.engine.budgets); the run shows budget_exceeded.
    budget_wait = models.JSONField(null=True, blank=True)
    celery_task_id = models.CharField(max_length=255, blank=True, default="")
    scheduled_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "path", "step_id", "attempt"], name="step_run_attempt_unique"
            ),
            # An event is consumed at most once per run (contract section 5).
            models.UniqueConstraint(
                fields=["run", "event"],
                condition=Q(event__isnull=False),
                name="step_run_event_once",
            ),
        ]
        indexes = [
            # A run's journal in order, and its rows after a settled prefix (journal_of(after=)):
            # on the run alone, reading a 2,000-step run's last rows visited all 2,000.
            models.Index(fields=["run", "id"], name="step_run_journal"),
            # Deleting an event checks no step run took it (PROTECT).
            models.Index(fields=["event"], name="step_run_event", condition=Q(event__isnull=False)),
            models.Index(
                fields=["lease_expires_at"],
                name="step_run_lease",
                condition=Q(status="running"),
            ),
            models.Index(
                fields=["scheduled_at"],
                name="step_run_scheduled",
                condition=Q(status="scheduled"),
            ),
            # "Is anything else of this run in flight?", asked at each completion in a fan-out.
            models.Index(
                fields=["run"],
                name="step_run_busy",
                condition=Q(status__in=["scheduled", "running"]),
            ),
            models.Index(
                fields=["wait_key"],
                name="step_run_waiting_event",
                condition=Q(status="waiting", kind="wait_event"),
            ),
        ]

    def __str__(self) -> str:
        where = f"{self.path}/" if self.path else ""
        return f"{where}{self.step_id} #{self.attempt} ({self.status})"


class TimerPurpose(models.TextChoices):
    SLEEP = "sleep"
    WAIT_TIMEOUT = "wait_timeout"
    STEP_DEADLINE = "step_deadline"
    RUN_DEADLINE = "run_deadline"
    RETRY_BACKOFF = "retry_backoff"
    APPROVAL_TIMEOUT = "approval_timeout"
    # Mails the approvers who have not decided; fires without advancing the run.
    APPROVAL_REMINDER = "approval_reminder"
    # Fails a scheduled attempt no live worker has served since its waiting_since.
    UNSERVABLE = "unservable"
    # Fails an in_doubt attempt nobody resolved within DJFLOW_IN_DOUBT_SECONDS.
    IN_DOUBT = "in_doubt"
    # A child run whose tree starts runs faster than DJFLOW_MAX_TREE_RUNS_PER_MINUTE: its
    # first steps are planned when this fires (runs.engine.trees).
    TREE_PACE = "tree_pace"
    # A period of an account's budget ends: the attempts that waited for it are offered again.
    BUDGET_PERIOD = "budget_period"


class Timer(models.Model):
    """A moment the engine must look at a run without any message arriving.

    The 1-second tick (``runs.engine.timers``) claims due timers with ``SKIP LOCKED`` and a
    conditional update of ``fired_at``, then advances their runs: durable time is a row here,
    never a Celery ETA or a beat entry per timer.
    """

    # No index of its own: timer_run_key_unique (run, key) finds a run's timers (its cascade
    # included), and timer_unfired_run its timers not fired yet (see there).
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="timers", db_index=False)
    step_run = models.ForeignKey(
        StepRun, null=True, blank=True, on_delete=models.CASCADE, related_name="timers"
    )
    purpose = models.CharField(max_length=20, choices=TimerPurpose.choices)
    # What makes a timer the same timer: planning twice over one journal asks for the same
    # key, and the unique constraint keeps one row.
    key = models.CharField(max_length=200)
    fire_at = models.DateTimeField()
    fired_at = models.DateTimeField(null=True, blank=True)
    # Times the tick claimed it: the claim is conditional, so this is 0 or 1 (tests check it).
    fires = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["fire_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "key"], name="timer_run_key_unique"),
        ]
        indexes = [
            models.Index(fields=["fire_at"], name="timer_due", condition=Q(fired_at__isnull=True)),
            # A run's unfired timers (reconcile's look for a retry's, an end's delete off
            # Postgres). On Postgres a run's end finds them through timer_run_key_unique:
            # with statistics that counted few unfired timers, a generic plan took
            # timer_due for ``fired_at IS NULL`` over this index, and read every pending
            # timer of every run on each end (runs.engine.ending._drop_timers_sql).
            models.Index(
                fields=["run"], name="timer_unfired_run", condition=Q(fired_at__isnull=True)
            ),
            models.Index(
                fields=["fired_at"], name="timer_fired", condition=Q(fired_at__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.purpose} of run {self.run_id} at {self.fire_at:%Y-%m-%d %H:%M:%S}"


class Event(models.Model):
    """An event delivered through ``POST /api/v1/events``: kept, so a wait reached after it
    arrived (but after its run started) still takes it."""

    name = models.CharField(max_length=200)
    key = models.CharField(max_length=500)
    # Digest of (name, key), what waits look events up by.
    wait_key = models.CharField(max_length=64)
    payload = models.JSONField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    # An event from a caller who operates only some workflows resumes only waits of those
    # (CONTRACT section 8), now and later: its EventScope rows name them. Unscoped events
    # (from trusted code or a global operator) may resume any wait.
    scoped = models.BooleanField(default=False)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["wait_key", "created_at", "id"], name="event_oldest")]

    def __str__(self) -> str:
        return f"{self.name} [{self.key}]"


class AdvanceRequest(models.Model):
    """A pending request to advance a run, made by a completion inside a fan-out. At most one
    per run: completions that find one pending only record their result (see
    ``workers.execution._record_inside``), so a thousand items cost a few advances."""

    run = models.OneToOneField(Run, primary_key=True, on_delete=models.CASCADE, related_name="+")
    requested_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"advance of run {self.run_id} requested at {self.requested_at}"


class RunTree(models.Model):
    """The operator's cap on one tree of runs (CONTRACT section 9; ``runs.engine.trees``):
    how many runs were started under its root (subworkflow children and body runs, at every
    depth) and the pace they were started at, kept on a row of their own beside the root.

    ``runs`` only grows, by a conditional ``UPDATE`` (``runs < DJFLOW_MAX_TREE_RUNS``) that
    decides each start, so concurrent starts in one tree never pass the cap together and no
    start counts the tree. ``paced_until`` is the pace's theoretical arrival time (GCRA):
    each start pushes it one interval (60 s / DJFLOW_MAX_TREE_RUNS_PER_MINUTE) later, and a
    start it puts more than a minute ahead waits for its turn. Not on the root's own row: a
    descendant starting a child would then lock its root, which the root's advance holds
    while it ends that descendant (a deadlock)."""

    root_run = models.OneToOneField(
        Run, primary_key=True, on_delete=models.CASCADE, related_name="+"
    )
    runs = models.PositiveIntegerField(default=0)
    paced_until = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"tree of run {self.root_run_id}: {self.runs} runs"


class EventScope(models.Model):
    """A workflow whose runs a scoped event may resume."""

    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="scope")
    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="+")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["event", "workflow"], name="event_scope_unique")
        ]

    def __str__(self) -> str:
        return f"event {self.event_id} may resume runs of {self.workflow_id}"


class ConcurrencyGate(models.Model):
    """One concurrency key of a workflow (``concurrency.key`` resolved, "" for a limit per
    workflow): the row admissions of that key lock, so two starts or ends at once count the
    key's runs in turn and never both take its last slot (runs.engine.slots).

    ``waiting``: the key has runs waiting for a slot (written under the lock by every
    admission). ``turn_at``: when the key last admitted a run or had its turn in the
    reconciler's pass (its first run's start until then), which visits the keys with runs
    waiting in that order."""

    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    waiting = models.BooleanField(default=False)
    # From the key's first run: a new key takes its turn after those that had theirs first.
    turn_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["workflow", "key"], name="concurrency_gate_key")
        ]
        indexes = [
            # The reconciler's pass: keys with runs waiting, their turns in order.
            models.Index(
                fields=["turn_at", "id"], name="concurrency_gate_turn", condition=Q(waiting=True)
            )
        ]

    def __str__(self) -> str:
        return f"{self.workflow_id} concurrency key {self.key!r}"


class RunAction(models.Model):
    """Who did what to a run, and when (CONTRACT section 8): every operator action (cancel,
    pause, resume, retry) and every event that resumed one of its waits. Append-only."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="actions")
    action = models.CharField(max_length=20)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The actor's name when it acted: kept should the user be deleted. Empty for trusted
    # code acting for no one (the engine, a management command without --user).
    actor_name = models.CharField(max_length=150, blank=True, default="")
    detail = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["run", "created_at", "id"]
        indexes = [models.Index(fields=["run", "created_at"], name="run_action_run")]

    def __str__(self) -> str:
        return f"{self.action} of run {self.run_id} by {self.actor_name or 'the system'}"


class RunFault(models.Model):
    """A periodic pass (the reconciler's parts, the clock, retention) that failed on this run
    (``runs.engine.isolation``): which pass, why, how often in a row, and until when the pass
    leaves the run alone. One row per (run, pass), updated on each failure; every failure
    also appends a ``pass_failed`` :class:`RunAction`, which the run's resource shows."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="faults", db_index=False)
    pass_name = models.CharField(max_length=60)
    error = models.TextField()
    failures = models.PositiveIntegerField(default=1)
    first_failed_at = models.DateTimeField(default=timezone.now)
    last_failed_at = models.DateTimeField(default=timezone.now)
    # The pass skips the run until then (a back-off doubling with each failure in a row).
    retry_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "pass_name"], name="run_fault_run_pass")
        ]

    def __str__(self) -> str:
        return f"{self.pass_name} failed on run {self.run_id} ({self.failures}x)"


class Content(models.Model):
    """A prompt, a reply, a tool's arguments or result, stored once by the SHA-256 of its
    canonical JSON (``digest``), and ``size``, that JSON's bytes: what the row stands for,
    whether it is stored whole or in parts (CONTRACT section 17, ``runs.engine.contents``).

    A prompt ``{system, messages}`` is stored in parts, so a conversation that grows by a
    message per call stores each message once (whole, every call stored every earlier message
    again: quadratic). Its row (``shape`` "prompt", empty ``body``) refers to its system
    text's row (``head``, a whole row) and to its messages' row (``rest``). A messages row
    (``shape`` "list") stands for the list of messages up to and including its ``body``, the
    last one; ``rest`` is the list before it (None for the first). Lists are keyed by their
    own digest, so every prompt of a thread shares the rows of the messages it repeats. A
    row's parts are never deleted before it (``runs.retention``)."""

    class Shape(models.TextChoices):
        WHOLE = "", "whole"
        PROMPT = "prompt", "prompt"
        LIST = "list", "list"

    digest = models.CharField(max_length=64, primary_key=True)
    body = models.JSONField()
    size = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    shape = models.CharField(
        max_length=6, choices=Shape.choices, blank=True, default="", db_default=""
    )
    # DO_NOTHING: retention deletes a part only once no row refers to it, and a row with
    # its parts in one statement (Django's PROTECT would refuse even that); the database's
    # deferred constraint keeps the rest honest. Indexed where set only: most rows are whole.
    head = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
    )
    rest = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_index=False,
    )

    class Meta:
        indexes = [
            models.Index(
                fields=["head"], name="runs_content_head", condition=Q(head__isnull=False)
            ),
            models.Index(
                fields=["rest"], name="runs_content_rest", condition=Q(rest__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return self.digest[:12]


class ModelCall(models.Model):
    """One call to a model (CONTRACT section 10): what was asked and answered (by reference),
    the tokens, the latency and the cost, on the attempt that made it."""

    step_run = models.ForeignKey(StepRun, on_delete=models.CASCADE, related_name="model_calls")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    provider = models.CharField(max_length=100)
    model = models.CharField(max_length=200)
    # The provider's own name of the model that answered (it may differ: a dated snapshot).
    answered_by = models.CharField(max_length=200, blank=True, default="")
    prompt = models.ForeignKey(Content, on_delete=models.PROTECT, related_name="+")
    reply = models.ForeignKey(
        Content, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    status = models.CharField(max_length=20)  # "ok" or the error class ("retryable", ...)
    error = models.JSONField(null=True, blank=True)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    reasoning_tokens = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    # What the call cost (None: the price table does not know the model), and the worst
    # case that was reserved for it before it was made.
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    reserved_usd = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    request_id = models.CharField(max_length=200, blank=True, default="")
    # The stored recipe whose prompt this was ("" for a step's inline one), and its version:
    # a recipe saved again during a run changes its later attempts, and this says which ran.
    recipe = models.CharField(max_length=100, blank=True, default="")
    recipe_version = models.PositiveIntegerField(null=True, blank=True)
    # What a recipe's context retrieved into the prompt, so an operator sees why the model
    # said what it said: {"kb", "query", "hits": [{"key", "version", "score"}]}; null when
    # the step has no context.
    retrieved = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["step_run", "id"]
        indexes = [models.Index(fields=["run", "id"], name="model_call_run")]

    def __str__(self) -> str:
        return f"{self.provider}:{self.model} ({self.status})"


class ToolCall(models.Model):
    """One call of an MCP tool (CONTRACT section 10, "MCP tools"), on the attempt that made
    it: the server and tool, the arguments sent and the result answered (by reference, stored
    once by digest, like a model call's prompt and reply; a run secret in them is stored as its
    token), how it ended and how long it took."""

    step_run = models.ForeignKey(StepRun, on_delete=models.CASCADE, related_name="tool_calls")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    server = models.CharField(max_length=200)
    tool = models.CharField(max_length=200)
    arguments = models.ForeignKey(Content, on_delete=models.PROTECT, related_name="+")
    # {"is_error": bool, "structured": ...} or {"is_error": bool, "text": ...} (a failed call's
    # text is kept beside its structured content); None when no answer came.
    result = models.ForeignKey(
        Content, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    # "ok", the error's class ("fatal", "retryable", ...), or "interrupted" (the attempt's
    # time limit ended it).
    status = models.CharField(max_length=20)
    error = models.JSONField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["step_run", "id"]
        indexes = [models.Index(fields=["run", "id"], name="tool_call_run")]

    def __str__(self) -> str:
        return f"{self.server}.{self.tool} ({self.status})"


class NotifyDelivery(models.Model):
    """One webhook of a run's end: a ``notify`` entry of its document whose ``events`` list
    the end (contract section 13). Written in the transaction that ends the run
    (``runs.engine.ending``), sent by ``workers.notify`` after commit, at least once.

    ``due_at`` is when the next attempt may be made: an attempt claims the row by moving it
    (and ``attempts``) conditionally, so of two messages for one row one sends; a row still
    pending ``LOST_MESSAGE_SECONDS`` past it has lost its message and the reconciler offers
    it again. ``body`` is the exact bytes sent, rendered at the first attempt and sent again
    as they are by every retry (the signature is of them)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="deliveries")
    # The entry's index in the pinned version's notify (its secret is the version's).
    entry = models.PositiveSmallIntegerField()
    event = models.CharField(max_length=20)
    url = models.TextField()
    status = models.CharField(
        max_length=20, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    due_at = models.DateTimeField()
    body = models.TextField(blank=True, default="")
    # The receiver's last HTTP status (null: none answered) and what went wrong last.
    response_status = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "notify deliveries"
        indexes = [
            # The reconciler's look for pending deliveries whose message was lost.
            models.Index(
                fields=["due_at"], name="notify_pending_due", condition=Q(status="pending")
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} of run {self.run_id} to entry {self.entry}"


class BulkAction(models.Model):
    """A cancel or retry of many runs (``POST /runs/cancel``, ``/runs/retry``, ``manage.py
    cancel|retry``): the list's filters and who asked, done by workers a batch at a time
    (``runs.bulk``).

    The runs it acts on are those its filters match, created before ``requested_at``, newest
    first; ``cursor_*`` is the last run a batch reached and ``batches`` how many batches are
    done. A batch is one transaction that moves both, under this row's lock, so a batch
    message delivered twice (or a re-offer racing the chain) finds its batch done."""

    class Action(models.TextChoices):
        CANCEL = "cancel"
        RETRY = "retry"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    action = models.CharField(max_length=10, choices=Action.choices)
    # The filters as given (datetimes in ISO 8601), the keywords of selectors.run_list.
    filters = models.JSONField(default=dict)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_by_name = models.CharField(max_length=150, blank=True, default="")
    requested_at = models.DateTimeField(default=timezone.now)
    # Counted when it was asked for: the runs matched that the caller may operate.
    affected = models.PositiveIntegerField(default=0)
    # What the batches did: runs cancelled or retried, and runs passed over (counted but
    # ended, retried, or no longer the caller's to operate by the time their batch came).
    done = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    batches = models.PositiveIntegerField(default=0)
    cursor_created_at = models.DateTimeField(null=True, blank=True)
    cursor_id = models.UUIDField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [
            # The reconciler's look for unfinished actions whose next message was lost.
            models.Index(
                fields=["updated_at"],
                name="bulk_action_open",
                condition=Q(finished_at__isnull=True),
            )
        ]

    def __str__(self) -> str:
        return f"bulk {self.action} by {self.requested_by_name or 'the system'} ({self.id})"


class AccountPeriod(models.TextChoices):
    DAY = "day"
    MONTH = "month"


class Account(models.Model):
    """An account's budget for model calls (CONTRACT section 17), the ledger of what its
    runs' calls spent and hold (``runs.engine.costs``).

    A row exists for an account an operator gave a budget (``PUT /accounts/{name}``); an
    account without one is not counted here, and its calls cost no statement more. Periods
    have UTC boundaries: ``day`` from midnight, ``month`` from the first; ``period`` empty is a
    budget in total. ``spent_usd`` is what settled calls cost since ``period_start`` (reset
    by the first reservation or settle of a new period), ``reserved_usd`` the worst cases of
    the calls in flight. Both are the engine's: written only by additive, conditional
    updates of ``runs.engine.costs``, never read-modified-written.
    """

    name = models.CharField(max_length=150, primary_key=True)
    # NULL: no cap (spend is still counted).
    budget_usd = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    period = models.CharField(max_length=5, choices=AccountPeriod.choices, blank=True, default="")
    period_start = models.DateTimeField(default=timezone.now)
    spent_usd = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    reserved_usd = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
