"""What a step handler gets as ``ctx``: the attempt's identity, spans and a bound logger."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from . import tracing
from .pricing import price


class Span:
    """One timed piece of a step's work; a model call reports its model and token usage."""

    def __init__(self, name: str, kind: str, attributes: Mapping[str, Any]) -> None:
        self.name = name
        self.kind = kind
        self.attributes: dict[str, Any] = dict(attributes)
        self.model: str | None = None
        self.provider: str | None = None
        self.usage: dict[str, int] = {}
        self.started_at = datetime.now(UTC)
        self.finished_at: datetime | None = None
        self.error: str | None = None
        self._t0 = time.perf_counter()
        self.duration_ms: float | None = None
        # What the span's work cost, already charged to the run when it happened (a recipe's
        # model call is settled against its reservation at once: runs.engine.costs); None
        # for a span priced from its usage when the attempt is recorded.
        self.charged: Decimal | None = None

    def set_model(self, model: str, provider: str | None = None) -> None:
        self.model = model
        self.provider = provider

    def set_usage(self, *, input_tokens: int = 0, output_tokens: int = 0, **more: int) -> None:
        for name, value in {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            **more,
        }.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"usage {name} must be a non-negative integer, got {value!r}")
            self.usage[name] = self.usage.get(name, 0) + value

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    @property
    def cost_usd(self) -> Decimal | None:
        if self.charged is not None:
            return self.charged
        return price(self.model, self.usage, self.provider) if self.usage else None

    def close(self, error: BaseException | None = None) -> None:
        self.finished_at = datetime.now(UTC)
        self.duration_ms = round((time.perf_counter() - self._t0) * 1000, 3)
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"

    def as_dict(self) -> dict[str, Any]:
        cost = self.cost_usd
        return {
            "name": self.name,
            "kind": self.kind,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "duration_ms": self.duration_ms,
            "model": self.model,
            "provider": self.provider,
            "usage": self.usage,
            "cost_usd": float(cost) if cost is not None else None,
            # Usage on a model the price table does not know is recorded, not priced.
            "priced": cost is not None or not self.usage,
            "attributes": self.attributes,
            "error": self.error,
        }


@dataclass
class StepContext:
    """Passed to handlers as ``ctx``. ``idempotency_key`` is stable across the retries of one
    step in one run: pass it to third parties so a retried call is recognised."""

    run_id: str
    step_id: str
    attempt: int
    idempotency_key: str
    workflow_id: str
    logger: logging.LoggerAdapter[logging.Logger]
    spans: list[Span] = field(default_factory=list)
    # The attempt's row and who its model calls count against (the built-in kinds use them;
    # a handler need not).
    step_run_id: int = 0
    account: str = ""
    # When the attempt's time is up (its timeout_ms from the claim).
    deadline_at: datetime | None = None
    # The model calls the attempt made, each with its reservation: recorded, and settled, in
    # the transaction that records the attempt (runs.engine.calls.calls_record).
    model_calls: list[Any] = field(default_factory=list)
    # The MCP tool calls it made (runs.engine.calls.ToolUse), recorded in the same transaction.
    tool_calls: list[Any] = field(default_factory=list)
    # A value with the run's secrets replaced by their tokens: what the kinds store of what
    # they sent and got (a prompt rendered from a secret input).
    conceal: Callable[[Any], Any] = field(default=lambda value: value)
    # When the worker took the attempt up (made right after its claim): its duration metric.
    started: float = field(default_factory=time.monotonic)
    # The attempt's OpenTelemetry span (workers.tracing), None when tracing is off.
    trace_span: Any = None

    @contextmanager
    def span(self, name: str, kind: str = "internal", **attributes: Any) -> Iterator[Span]:
        opened = Span(name, kind, attributes)
        self.spans.append(opened)
        # Exported too when tracing is on, under the attempt's span (workers.tracing).
        live = tracing.open_handler_span(opened)
        try:
            yield opened
        except BaseException as exc:
            opened.close(exc)
            tracing.close_handler_span(live, opened)
            raise
        else:
            opened.close()
            tracing.close_handler_span(live, opened)

    def usage(self) -> dict[str, Any]:
        """The attempt's usage summed over its spans, by model."""
        total: dict[str, int] = {}
        by_model: dict[str, dict[str, int]] = {}
        for span in self.spans:
            for key, value in span.usage.items():
                total[key] = total.get(key, 0) + value
                if span.model:
                    model = by_model.setdefault(span.model, {})
                    model[key] = model.get(key, 0) + value
        return {**total, "models": by_model} if total else {}

    def cost_usd(self) -> Decimal:
        """What the attempt's spans cost, charged already or not."""
        return sum((s.cost_usd or Decimal(0) for s in self.spans), Decimal(0))

    def uncharged_usd(self) -> Decimal:
        """What recording the attempt charges the run: its spans not charged already."""
        spans = (s for s in self.spans if s.charged is None)
        return sum((s.cost_usd or Decimal(0) for s in spans), Decimal(0))


class _StepLogger(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every line with the run, step and attempt, and passes them as ``extra``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        prefix = f"[run {extra.get('run_id')} step {extra.get('step_id')} #{extra.get('attempt')}]"
        return f"{prefix} {msg}", kwargs


def bound_logger(run_id: str, step_id: str, attempt: int) -> logging.LoggerAdapter[logging.Logger]:
    return _StepLogger(
        logging.getLogger("workflows.step"),
        {"run_id": run_id, "step_id": step_id, "attempt": attempt},
    )
