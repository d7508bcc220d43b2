"""What a model call records (CONTRACT section 10): one :class:`~runs.models.ModelCall` per
call, on the attempt that made it, with its prompt and reply stored once each by content hash
(:class:`~runs.models.Content`), and its reservation settled, in one transaction. An MCP tool
call is recorded the same way (:class:`~runs.models.ToolCall`: its arguments and result by
content hash), without a reservation: a tool call is not priced.

Content addressing keeps storage linear in what is new: a prompt is stored as its messages
(``runs.engine.contents``), so a conversation resent with every call (a JSON re-ask, a loop of
turns) stores each message once, and every call refers to it. A Temporal user who stored the
whole conversation with every call hit the 50 MB history limit after 53 of 100 calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import transaction

from ..models import ModelCall, ToolCall
from . import contents, costs


@dataclass(frozen=True)
class Call:
    """A finished call, as the worker saw it."""

    provider: str
    model: str
    prompt: Any
    reply: Any | None
    status: str
    error: dict[str, Any] | None = None
    answered_by: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    latency_ms: int = 0
    cost_usd: Decimal | None = None
    request_id: str = ""
    # The stored recipe the call rendered ("" for an inline one) and its version.
    recipe: str = ""
    recipe_version: int | None = None
    # What the recipe's context retrieved for the prompt (ModelCall.retrieved), or None.
    retrieved: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolUse:
    """A finished MCP tool call, as the worker saw it (arguments and result concealed)."""

    step_run_id: int
    run_id: Any
    server: str
    tool: str
    arguments: Any
    result: Any | None
    status: str
    error: dict[str, Any] | None = None
    latency_ms: int = 0


def digest(body: Any) -> str:
    """The SHA-256 of ``body``'s canonical JSON (sorted keys, no spaces)."""
    return contents.digest(body)


def call_record(*, reservation: costs.Reservation, call: Call) -> ModelCall:
    """Record one ``call`` on its attempt and settle its reservation to what it cost."""
    with transaction.atomic():
        [recorded] = calls_record([(reservation, call)])
    return recorded


def calls_record(made: Sequence[tuple[costs.Reservation, Call]]) -> list[ModelCall]:
    """Record the calls one attempt made, and settle their reservations, in the caller's
    transaction: the worker does it in the one that records the attempt (a call costs no
    transaction of its own), whether or not the attempt's result is still wanted, since the
    calls were made and paid for either way. A worker lost before then leaves its
    reservations held, and the reconciler charges them (``costs.release_ended``)."""
    if not made:
        return []
    digests = contents.store([body for _, call in made for body in (call.prompt, call.reply)])
    costs.settle_all([(reservation, call.cost_usd) for reservation, call in made])
    rows = [
        ModelCall(
            step_run_id=reservation.step_run_id,
            run_id=reservation.run_id,
            provider=call.provider,
            model=call.model,
            answered_by=call.answered_by[:200],
            prompt_id=digests[id(call.prompt)],
            reply_id=digests[id(call.reply)] if call.reply is not None else None,
            status=call.status,
            error=call.error,
            input_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            cached_tokens=call.cached_tokens,
            reasoning_tokens=call.reasoning_tokens,
            latency_ms=call.latency_ms,
            cost_usd=call.cost_usd,
            reserved_usd=reservation.amount,
            request_id=call.request_id[:200],
            recipe=call.recipe,
            recipe_version=call.recipe_version,
            retrieved=call.retrieved,
        )
        for reservation, call in made
    ]
    return ModelCall.objects.bulk_create(rows)


def tool_calls_record(made: Sequence[ToolUse]) -> list[ToolCall]:
    """Record the tool calls one attempt made, in the caller's transaction (the one that
    records the attempt), whether or not its result is still wanted: they were made."""
    if not made:
        return []
    digests = contents.store([body for use in made for body in (use.arguments, use.result)])
    rows = [
        ToolCall(
            step_run_id=use.step_run_id,
            run_id=use.run_id,
            server=use.server[:200],
            tool=use.tool[:200],
            arguments_id=digests[id(use.arguments)],
            result_id=digests[id(use.result)] if use.result is not None else None,
            status=use.status,
            error=use.error,
            latency_ms=use.latency_ms,
        )
        for use in made
    ]
    return ToolCall.objects.bulk_create(rows)
