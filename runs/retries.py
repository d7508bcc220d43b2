"""What a retry from a step decides before it writes anything (``runs.services.run_retry``).

A retry from a step reruns that top-level step and every one after it, in document order; a
step inside a ``condition``, ``parallel``, ``foreach`` or ``loop`` reruns with its enclosing
top-level step, whole (an item of a foreach is no step of its own to restart from: the body's
scope, its item and what ran before it, come from the top-level step). What ran before it is
kept, outputs included. The planner leaves the superseded attempts out (``Run.reruns``,
``runs.engine.plan``); they stay in the journal.

An edited input replaces the run's input; a ``writeOnly`` field (a secret) the edit leaves
out, or sends as the mask ``••••`` (what the API showed), keeps its stored value.

Pure functions of documents, journals and inputs: no database.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from workflows import secrets
from workflows.input_schema import write_only_values
from workflows.validation import field_path

from .engine.plan import AttemptView, top_level_ids

# A top-level step whose latest row ended so is settled: a retry keeps it.
SETTLED = frozenset({"succeeded", "skipped"})


def restart_at(
    steps: Sequence[Mapping[str, Any]], attempts: Sequence[AttemptView], from_step: str | None
) -> str | None:
    """The top-level step a retry starts from: ``from_step``'s (itself, or the top-level step
    it is inside); without one, the first top-level step that did not settle (a plain retry
    of a failed run from its failed step). None when every top-level step settled."""
    if from_step is not None:
        return top_level_ids(steps)[from_step]
    latest = _latest(attempts)
    for step in steps:
        if not _settled(step, latest.get(step["id"])):
            return str(step["id"])
    return None


def split(
    steps: Sequence[Mapping[str, Any]], attempts: Sequence[AttemptView], restart: str | None
) -> tuple[list[str], list[str]]:
    """(the top-level steps that run again, those kept), each in document order: from
    ``restart`` on, every step; before it, those that did not settle run again too (a run
    cancelled at its second step and retried from its fourth goes on at its second)."""
    latest = _latest(attempts)
    rerun: list[str] = []
    kept: list[str] = []
    reached = False
    for step in steps:
        reached = reached or step["id"] == restart
        settled = not reached and _settled(step, latest.get(step["id"]))
        (kept if settled else rerun).append(str(step["id"]))
    return rerun, kept


def _latest(attempts: Sequence[AttemptView]) -> dict[str, AttemptView]:
    """The latest row of each top-level step (the journal is oldest first)."""
    return {attempt.step_id: attempt for attempt in attempts if not attempt.path}


def _settled(step: Mapping[str, Any], row: AttemptView | None) -> bool:
    """Whether a retry keeps what the step's latest row ended with: it succeeded or was
    skipped, or it failed and the run went on past it (``on_error: continue``)."""
    if row is None:
        return False
    if row.status in SETTLED:
        return True
    ended = row.status in ("failed", "timed_out", "cancelled")
    return ended and step.get("on_error", "fail_run") == "continue"


def merged_input(
    schema: Any,
    stored: Any,
    given: Mapping[str, Any],
    registry: Any,
    kept: list[str] | None = None,
) -> Any:
    """``given`` with each secret of the stored input that it omits (or sends masked) put
    back, in plaintext: what is validated and sealed again. Only where the secret's parent
    object is still in ``given``: an edit that removes a whole object removes its secrets.
    The dotted field of each secret put back is appended to ``kept``."""
    plain = secrets.reveal(stored, registry)
    merged = copy.deepcopy(dict(given))
    for path, value in sorted(write_only_values(schema, plain), key=lambda item: len(item[0])):
        parent: Any = merged
        for part in path[:-1]:
            parent = _child(parent, part)
        last = path[-1] if path else None
        missing = isinstance(parent, dict) and isinstance(last, str) and last not in parent
        if missing or (isinstance(parent, dict) and parent.get(last) == secrets.MASK):
            parent[last] = value
            if kept is not None:
                kept.append(".".join(["input", *map(str, path)]))
    return merged


def _child(parent: Any, part: str | int) -> Any:
    """``parent[part]`` when it is there, else None."""
    if isinstance(parent, Mapping) and part in parent:
        return parent[part]
    if isinstance(parent, list) and isinstance(part, int) and 0 <= part < len(parent):
        return parent[part]
    return None


def changes(
    before: Any, after: Any, where: Sequence[str | int] = ("input",), *, raw: bool = False
) -> list[dict[str, Any]]:
    """What differs between two stored inputs, field by field (objects are walked; any other
    value is compared whole): ``[{"field", "before", "after"}]``, a field absent on one side
    shown as null there. Stored inputs hold tokens: a secret with a new value has a new token,
    and shows as a change from ``••••`` to ``••••`` (``raw`` keeps the tokens, for a record
    that is masked when shown)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        found = []
        for key in [*before, *(k for k in after if k not in before)]:
            if key not in after or key not in before or before[key] != after[key]:
                found += changes(before.get(key), after.get(key), [*where, key], raw=raw)
        return found
    if before == after:
        return []
    if not raw:
        before, after = secrets.shown(before), secrets.shown(after)
    return [{"field": field_path(where), "before": before, "after": after}]
