"""``wait_event``: the step waits, with no process alive, for an event of its name and key
(``POST /events``, ``runs.engine.events``), or times out after ``timeout_ms``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from workflows.kinds import Ending, Kind, Opening, Role, Scope, register


def key_text(value: Any) -> str:
    """A wait_event's resolved key as the text events are matched on: a string as it is,
    anything else (a number from a template, say) as compact JSON, so 42 matches "42"."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def wait_key(name: str, key: str) -> str:
    """The digest waits and events are matched on: no separator can be confused."""
    return hashlib.sha256(json.dumps([name, key]).encode()).hexdigest()


def open_wait(step: Mapping[str, Any], scope: Scope) -> Opening:
    key = key_text(scope.resolve(step.get("key", ""), "key"))
    due = scope.after(step.get("timeout_ms"))
    return Opening(
        "waiting",
        input={"event": step["event"], "key": key},
        not_before=due,
        timer="wait_timeout" if due is not None else None,
        wait_key=wait_key(step["event"], key),
    )


def no_event(step: Mapping[str, Any], row: Any) -> Ending:
    message = f"no event '{step['event']}' arrived within timeout_ms ({step.get('timeout_ms')} ms)"
    return Ending("timed_out", {"class": "timeout", "message": message})


WAIT_EVENT = register(Kind("wait_event", Role.WAIT, open=open_wait, due=no_event))
