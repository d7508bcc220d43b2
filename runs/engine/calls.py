"""What a model call records (CONTRACT section 10): one :class:`~runs.models.ModelCall` per
call, on the attempt that made it, with its prompt and reply stored once each by content hash
(:class:`~runs.models.Content`), and its reservation settled, in one transaction.

Content addressing keeps storage linear in what is new: a conversation resent with every call
(a JSON re-ask, a loop of turns) stores each distinct prompt once, and every call refers to
it. A Temporal user who stored the whole conversation with every call hit the 50 MB history
limit after 53 of 100 calls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import transaction

from ..models import Content, ModelCall
from . import costs


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


def digest(body: Any) -> str:
    """The SHA-256 of ``body``'s canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(_canonical(body)).hexdigest()


def call_record(*, reservation: costs.Reservation, call: Call) -> ModelCall:
    """Record ``call`` on its attempt and settle its reservation to what it cost."""
    with transaction.atomic():
        prompt, reply = _store(call.prompt, call.reply)
        costs.settle(reservation, actual=call.cost_usd)
        return ModelCall.objects.create(
            step_run_id=reservation.step_run_id,
            run_id=reservation.run_id,
            provider=call.provider,
            model=call.model,
            answered_by=call.answered_by[:200],
            prompt_id=prompt,
            reply_id=reply,
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
        )


def _store(prompt: Any, reply: Any | None) -> tuple[str, str | None]:
    """The digests of the prompt and the reply (None: no reply), stored in one statement.
    The same content again is the row already stored: nothing is written twice. Rows go in
    digest order, so two calls storing the same two contents wait for each other in the
    same order, never both at once."""
    bodies = [prompt] if reply is None else [prompt, reply]
    rows: dict[str, Content] = {}
    keys: list[str] = []
    for body in bodies:
        raw = _canonical(body)
        key = hashlib.sha256(raw).hexdigest()
        rows.setdefault(key, Content(digest=key, body=body, size=len(raw)))
        keys.append(key)
    Content.objects.bulk_create([rows[key] for key in sorted(rows)], ignore_conflicts=True)
    return keys[0], (keys[1] if reply is not None else None)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
