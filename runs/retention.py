"""Retention (CONTRACT section 13): delete ended runs past their age, with everything of
theirs, a bounded batch per transaction.

What is deleted, and why it is safe:

- Only whole trees, from their root: a top-level run that has ended (``RUN_TERMINAL``) with
  its status's age passed since it ended, with every run below it (subworkflows, bodies). A
  tree with any run not ended is kept whole; so is a child whose root is still going (it is
  never a candidate: only roots are).
- The roots are locked (``SKIP LOCKED``: one the engine or an operator holds is left for the
  next pass) and their status checked under the lock, and every run of the tree is locked
  before anything is deleted: a retry, which locks the run first, either comes before (the run
  is no longer ended, and is kept) or finds the run gone.
- Every row that references a deleted run goes with it, by each foreign key's own
  ``on_delete`` (Django's collector): step runs, timers, actions, advance requests, model and
  tool calls, approval requests with their approvers and mails. What would block that on
  purpose is removed first: the runs' links to one another (``PROTECT``, so no run is ever
  deleted from under its tree), and what apps above the engine protect (an approval's
  decisions, ``hooks.on_purge``). Notifications keep existing with their run link cleared
  (their ``on_delete`` is ``SET_NULL``: they are the recipient's, not the run's).
- Stored prompts, replies, tool arguments and results (``Content``) are shared by digest
  between runs: one is deleted only when no model or tool call refers to it any more, and one
  that a writer holds (a call being recorded refers to it) is skipped. A prompt's parts (its
  system text and messages, shared by every prompt of a thread) go only once no call and no
  prompt that stays refers to them.
- An event the deleted runs took is deleted when no other step run took it and no run still
  going could take it (it arrived before every live run started).

- Each tree on its own when a batch fails: should deleting a batch raise (a tree whose rows
  an app's purge cannot take, a constraint), its savepoint is rolled back and its trees are
  deleted one by one, each in a savepoint of its own; a tree that fails again is logged,
  counted and marked on its root (``runs.engine.isolation``) and left out of the candidates
  for its back-off, so one tree never stops retention for the rest.

A dry run does the same work in a transaction it rolls back, so its counts are exactly what
the deletion would be.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from .engine import contents, hooks
from .engine.isolation import guarded, in_backoff
from .models import Content, Event, ModelCall, Run, StepRun, ToolCall
from .status import RUN_TERMINAL, RunStatus

logger = logging.getLogger(__name__)

# Retention's failures on a tree, as counted and marked on its root (isolation.py).
RETENTION = "retention"

# The most runs one transaction deletes (whole trees: one bigger tree is deleted alone).
MAX_RUNS_PER_BATCH = 2000
# The most rounds of looking for runs below a tree's runs by their parent (a tree is at most
# 8 subworkflows deep, and bodies add levels of their own); root_run finds them all at once
# on every run written since it exists.
_MAX_LEVELS = 64


@dataclass
class PurgeReport:
    """What a purge deleted (or, dry, would delete): rows by model label, and the trees it
    kept because a run in them had not ended."""

    deleted: Counter[str] = field(default_factory=Counter)
    kept_live: int = 0
    more: bool = False  # stopped by its time budget with candidates left

    @property
    def runs(self) -> int:
        return self.deleted[Run._meta.label]

    def lines(self) -> list[str]:
        return [f"{label}: {count}" for label, count in sorted(self.deleted.items()) if count]


def retention_ages(days: Mapping[str, int]) -> dict[str, timedelta]:
    """``DJFLOW["RETENTION_DAYS"]`` (status -> days) as ages; statuses not named are kept."""
    return {status: timedelta(days=n) for status, n in days.items() if status in RUN_TERMINAL}


def retention_purge(
    *,
    older_than: Mapping[str, timedelta],
    now: datetime | None = None,
    dry_run: bool = False,
    batch: int = 100,
    seconds: float | None = None,
) -> PurgeReport:
    """Delete (or count, ``dry_run``) the trees whose ended root has been ended longer than
    its status's age in ``older_than``, ``batch`` roots per transaction, oldest first, until
    none is left or ``seconds`` have passed (``more`` then says so)."""
    for status in older_than:
        if status not in RUN_TERMINAL:
            raise ValueError(f"{status} is not an ended status: only ended runs are purged")
    now = now or timezone.now()
    until = time.monotonic() + seconds if seconds is not None else float("inf")
    report = PurgeReport()
    for status, age in older_than.items():
        cut = now - age
        after: tuple[datetime, Any] | None = None
        while True:
            if time.monotonic() >= until:
                report.more = True
                return report
            roots = _candidates(status, cut, after, batch)
            if not roots:
                break
            ids = [run_id for _, run_id in roots]
            reached = _purge_batch(ids, status, cut, report, dry_run=dry_run)
            after = roots[reached - 1]
    return report


def _candidates(
    status: str, cut: datetime, after: tuple[datetime, Any] | None, batch: int
) -> list[tuple[datetime, Any]]:
    """The next ``batch`` roots of ``status`` ended before ``cut``, oldest first. A run ends
    after it is created, so ``created_at < cut`` holds for each: the (status, created_at)
    index finds them."""
    runs = Run.objects.filter(
        Q(finished_at__lt=cut) | Q(finished_at__isnull=True),
        status=status,
        parent_run__isnull=True,
        created_at__lt=cut,
    ).exclude(in_backoff(RETENTION, timezone.now(), run="id"))
    if after is not None:
        runs = runs.filter(Q(created_at__gt=after[0]) | Q(created_at=after[0], id__gt=after[1]))
    return list(runs.order_by("created_at", "id").values_list("created_at", "id")[:batch])


def _purge_batch(
    candidates: list[Any], status: str, cut: datetime, report: PurgeReport, *, dry_run: bool
) -> int:
    """Delete the trees of these roots (oldest first) in one transaction, until they hold
    ``MAX_RUNS_PER_BATCH`` runs (a bigger tree goes whole, alone); answers how many of the
    candidates it reached, so the next batch starts after the last."""
    with transaction.atomic():
        # Locked, and still what they were chosen for (a retry may have revived one).
        locked = set(
            Run.objects.select_for_update(skip_locked=True)
            .filter(
                Q(finished_at__lt=cut) | Q(finished_at__isnull=True),
                id__in=candidates,
                status=status,
                parent_run__isnull=True,
            )
            .values_list("id", flat=True)
        )
        trees = _trees([root for root in candidates if root in locked])
        members = [run_id for tree in trees.values() for run_id in tree]
        # Every run of the trees locked (in one order, the ids'), then their statuses read.
        statuses = dict(
            Run.objects.select_for_update()
            .filter(id__in=members)
            .order_by("id")
            .values_list("id", "status")
        )
        chosen: list[tuple[Any, list[Any]]] = []
        runs = 0
        reached = 0
        for root in candidates:
            if runs and runs + len(trees.get(root, ())) > MAX_RUNS_PER_BATCH:
                break
            reached += 1
            tree = trees.get(root)
            if tree is None:
                continue  # held by someone else, or no longer ended: the next pass sees it
            if any(statuses.get(run_id) not in RUN_TERMINAL for run_id in tree):
                report.kept_live += 1
                logger.info("retention: run %s kept: a run of its tree has not ended", root)
                continue
            chosen.append((root, tree))
            runs += len(tree)
        if chosen:
            report.deleted.update(_delete_trees(chosen))
        if dry_run:
            transaction.set_rollback(True)
    return reached


def _trees(roots: Iterable[Any]) -> dict[Any, list[Any]]:
    """Each root with every run below it: by ``root_run``, then by ``parent_run`` level by
    level (a row written before ``root_run`` existed has only its parent)."""
    tree_of: dict[Any, Any] = {root: root for root in roots}
    below = Run.objects.filter(root_run_id__in=list(tree_of)).values_list("id", "root_run_id")
    tree_of.update(dict(below))
    frontier = list(tree_of)
    for _ in range(_MAX_LEVELS):
        found = [
            (child, parent)
            for child, parent in Run.objects.filter(parent_run_id__in=frontier).values_list(
                "id", "parent_run_id"
            )
            if child not in tree_of
        ]
        if not found:
            break
        for child, parent in found:
            tree_of[child] = tree_of[parent]
        frontier = [child for child, _ in found]
    trees: dict[Any, list[Any]] = {}
    for run_id, root in tree_of.items():
        trees.setdefault(root, []).append(run_id)
    return trees


def _delete_trees(chosen: list[tuple[Any, list[Any]]]) -> Counter[str]:
    """Delete these trees (root, runs), all at once; should that fail, one by one, each tree
    that fails again marked on its root and kept (the module's docstring)."""
    try:
        with transaction.atomic():
            return _delete_runs([run_id for _, tree in chosen for run_id in tree])
    except Exception:
        logger.warning("retention: a batch of %d trees failed; one by one", len(chosen))
    deleted: Counter[str] = Counter()
    for root, tree in chosen:
        deleted.update(guarded(RETENTION, root, partial(_delete_runs, tree), failed=Counter()))
    return deleted


def _delete_runs(run_ids: list[Any]) -> Counter[str]:
    """Delete these runs (whole trees, locked by the caller) and every row of theirs."""
    deleted: Counter[str] = Counter()
    digests = _contents_of(run_ids)
    events = set(
        StepRun.objects.filter(run_id__in=run_ids, event__isnull=False).values_list(
            "event_id", flat=True
        )
    )
    for _, purge in hooks.purges():
        deleted.update(purge(run_ids))
    # The tree's own links are PROTECT (nothing else may delete a run from under its tree);
    # the whole tree goes here, so they are cleared first.
    Run.objects.filter(id__in=run_ids).filter(
        Q(parent_run__isnull=False) | Q(root_run__isnull=False)
    ).update(parent_run=None, root_run=None)
    _, by_model = Run.objects.filter(id__in=run_ids).delete()
    deleted.update({label: count for label, count in by_model.items() if count})
    deleted.update(_orphan_contents(digests))
    deleted.update(_dead_events(events))
    return deleted


def _contents_of(run_ids: list[Any]) -> set[str]:
    digests: set[str] = set()
    for prompt, reply in ModelCall.objects.filter(run_id__in=run_ids).values_list(
        "prompt_id", "reply_id"
    ):
        digests.update(d for d in (prompt, reply) if d)
    for arguments, result in ToolCall.objects.filter(run_id__in=run_ids).values_list(
        "arguments_id", "result_id"
    ):
        digests.update(d for d in (arguments, result) if d)
    return digests


def _orphan_contents(digests: set[str]) -> dict[str, int]:
    """Delete the contents among ``digests``, and the parts below them (a prompt's system text
    and messages, ``runs.engine.contents``), that nothing refers to any more: no call, and no
    stored row that stays (another prompt that repeats these messages). One a writer is using
    at this moment (its call's row refers to it, not committed yet) is locked by that
    reference and skipped, with every part below it."""
    if not digests:
        return {}
    below = contents.closure(digests)
    referenced = (
        Q(Exists(ModelCall.objects.filter(prompt_id=OuterRef("digest"))))
        | Q(Exists(ModelCall.objects.filter(reply_id=OuterRef("digest"))))
        | Q(Exists(ToolCall.objects.filter(arguments_id=OuterRef("digest"))))
        | Q(Exists(ToolCall.objects.filter(result_id=OuterRef("digest"))))
    )
    free = set(
        Content.objects.select_for_update(skip_locked=True)
        .filter(digest__in=below)
        .exclude(referenced)
        .values_list("digest", flat=True)
    )
    kept = set(below) - free
    referrers = Content.objects.filter(Q(head_id__in=below) | Q(rest_id__in=below))
    for parts in referrers.exclude(digest__in=below).values_list("head_id", "rest_id"):
        kept.update(part for part in parts if part in below)
    # Whatever a kept row is made of stays with it.
    stack = list(kept)
    while stack:
        for part in below[stack.pop()]:
            if part is not None and part not in kept:
                kept.add(part)
                stack.append(part)
    # A row and its parts in one statement: the parts' references are checked at commit.
    count, _ = Content.objects.filter(digest__in=free - kept).delete()
    return {Content._meta.label: count} if count else {}


def _dead_events(event_ids: set[Any]) -> dict[str, int]:
    """Delete the events among ``event_ids`` no step run took (any more) and no live run
    could take: a wait takes only an event that arrived after its run started."""
    if not event_ids:
        return {}
    # The oldest start of each live status, each from the (status, created_at) index.
    starts = [
        Run.objects.filter(status=status).order_by("created_at").values_list("created_at")[:1]
        for status in RunStatus
        if status not in RUN_TERMINAL
    ]
    oldest_live = min((row[0] for query in starts for row in query), default=None)
    events = Event.objects.filter(id__in=event_ids).exclude(
        Exists(StepRun.objects.filter(event_id=OuterRef("id")))
    )
    if oldest_live is not None:
        events = events.filter(created_at__lt=oldest_live)
    _, by_model = events.delete()
    return {label: n for label, n in by_model.items() if n}
