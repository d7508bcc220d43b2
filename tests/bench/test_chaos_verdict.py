"""bench.chaos's verdict on a run failed because its worker was lost under an at_most_once
attempt: given up (as the contract says), not lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from bench import chaos

IN_DOUBT = {"class": "in_doubt", "message": "in doubt since its worker was lost"}


def row(step_id: str, kind: str = "task", status: str = "succeeded", **fields: Any) -> Any:
    return SimpleNamespace(
        step_id=step_id,
        kind=kind,
        status=status,
        effect=fields.get("effect", "at_least_once"),
        error=fields.get("error"),
    )


def test_a_parallel_whose_at_most_once_branch_was_given_up_is_given_up() -> None:
    """The parallel's row fails with its branch's class: it is not an attempt (the chaos
    counted such a run lost, and failed CI)."""
    journal = [
        row("both", kind="parallel", status="failed", effect=None, error=IN_DOUBT),
        row("twice"),
        row("negated", status="failed", effect="at_most_once", error=IN_DOUBT),
    ]
    assert chaos._gave_up_once(journal, None)


def test_an_attempt_given_up_must_be_at_most_once_and_tried_once() -> None:
    at_least_once = [row("negated", status="failed", error=IN_DOUBT)]
    assert not chaos._gave_up_once(at_least_once, None)
    tried_twice = [
        row("negated", status="failed", effect="at_most_once", error={"class": "lost"}),
        row("negated", status="failed", effect="at_most_once", error=IN_DOUBT),
    ]
    assert not chaos._gave_up_once(tried_twice, None)
    nothing_given_up = [row("both", kind="parallel", status="failed", error=IN_DOUBT)]
    assert not chaos._gave_up_once(nothing_given_up, None)
