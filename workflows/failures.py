"""What a step handler raises to fail its attempt with a chosen error class (contract
section 5).

Handlers raise :class:`StepFailure` and the worker (``workers/execution.py``) catches it, so
this module stands apart from the builder: the worker needs the exception, not the document
builder. Handlers import it from :mod:`workflows.sdk` as before. It imports nothing of Django.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ERROR_CLASSES",
    "KIND_ERROR_CLASSES",
    "BudgetWait",
    "Deferred",
    "KindFailure",
    "StepFailure",
]

ERROR_CLASSES = ("retryable", "fatal", "invalid_input", "unservable")
# Classes only the built-in kinds raise (KindFailure): a model reply that is not the JSON
# asked for (``invalid_output``, never retried), and a run limit the step ran into (``limit``:
# the run fails, whatever the step's on_error says), and a model, tool or http call in a test
# that no stub of the ``djflow`` fixture answers (``unstubbed``, never retried: a test never
# reaches the network; workflows.testing), or in a replay that its recording does not hold
# (``unrecorded``: manage.py run_replay without --live, config.replay), and a model call
# whose worst case does not fit the run's max_cost_usd or its account's budget under
# ``limits.on_budget: "fail"`` (``budget_exceeded``, never retried; under "wait", the
# default, the attempt waits instead: :class:`BudgetWait`).
KIND_ERROR_CLASSES = ("invalid_output", "limit", "unstubbed", "unrecorded", "budget_exceeded")
# The contract's bound on every *_ms field, as workflows.schema.MAX_DURATION_MS (not imported
# from there: that would load jsonschema into every process that imports a handler).
MAX_DURATION_MS = 315_360_000_000  # 3650 days


class StepFailure(Exception):
    """Raised by a handler to fail its attempt with a chosen error class (contract section 5).

    ``retryable`` is tried again while the retry budget lasts, no sooner than
    ``retry_after_ms``; ``fatal`` and ``invalid_input`` are never retried; ``unservable`` means
    this worker lacks what the step needs, and the attempt is offered to another worker without
    spending the budget.
    """

    _classes: tuple[str, ...] = ERROR_CLASSES

    def __init__(
        self,
        message: str,
        class_: str = "fatal",
        retry_after_ms: int | None = None,
    ) -> None:
        if class_ not in self._classes:
            raise ValueError(
                f"{type(self).__name__} class_ must be one of {', '.join(self._classes)}, "
                f"got {class_!r}"
            )
        if retry_after_ms is not None and (
            isinstance(retry_after_ms, bool)
            or not isinstance(retry_after_ms, int)
            or not 0 <= retry_after_ms <= MAX_DURATION_MS
        ):
            raise ValueError(
                f"StepFailure retry_after_ms must be an integer from 0 to {MAX_DURATION_MS} "
                f"(3650 days), got {retry_after_ms!r}"
            )
        super().__init__(message)
        self.message = str(message)
        self.error_class = class_
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduces to ``StepFailure(message)`` and would lose the class.
        return (type(self), (self.message, self.error_class, self.retry_after_ms))

    def __repr__(self) -> str:
        return f"StepFailure({self.message!r}, class_={self.error_class!r})"

    def as_error(self) -> dict[str, str]:
        return {"class": self.error_class, "message": self.message}


class KindFailure(StepFailure):
    """A built-in kind's failure: the handlers' classes and the kinds' own
    (:data:`KIND_ERROR_CLASSES`)."""

    _classes = ERROR_CLASSES + KIND_ERROR_CLASSES


class Deferred(Exception):
    """Raised by a kind's body that cannot go on now for a reason that passes (every model
    slot of the run's account is taken): the attempt is handed back without spending its
    budget, and offered again after ``seconds``."""

    def __init__(self, reason: str, *, seconds: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seconds = seconds


class BudgetWait(Exception):
    """Raised by a kind's body whose model call does not fit a budget (the run's
    ``limits.max_cost_usd``, its account's) under ``limits.on_budget: "wait"``: the call is
    not made, the attempt is handed back without spending its budget and is not offered
    again; the run shows ``budget_exceeded`` until a top-up, a raised account budget or a
    new period lets it go on. ``wait`` is what the attempt records (``StepRun.budget_wait``):
    ``{"limit", "asked_usd", "message", "account"?, "until"?}``."""

    def __init__(self, message: str, *, wait: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.wait = wait
