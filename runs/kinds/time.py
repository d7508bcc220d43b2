"""``sleep`` and ``sleep_until``: the step waits, with no process alive, until a time (a
timer row fires it); a time already past is over at once, within the plan that reaches it."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from workflows.kinds import Ending, Kind, Opening, Role, Scope, register


def open_sleep(step: Mapping[str, Any], scope: Scope) -> Opening:
    wait_input = {"ms": step["ms"]}
    return _until(scope.now + timedelta(milliseconds=step["ms"]), wait_input, scope)


def open_sleep_until(step: Mapping[str, Any], scope: Scope) -> Opening:
    until = scope.resolve(step["until"], "until")
    wait_input = {"until": until}
    try:
        due = parse_until(until)
    except ValueError as error:
        failure = {"class": "invalid_input", "message": f"until: {error}"}
        return Opening("failed", input=wait_input, error=failure)
    return _until(due, wait_input, scope)


def _until(due: datetime, wait_input: dict[str, Any], scope: Scope) -> Opening:
    if due <= scope.now:
        # A time already past fires at once, within this plan.
        return Opening("succeeded", input=wait_input)
    return Opening("waiting", input=wait_input, not_before=due, timer="sleep")


def woke(step: Mapping[str, Any], row: Any) -> Ending:
    return Ending("succeeded")


SLEEP = register(Kind("sleep", Role.WAIT, open=open_sleep, due=woke))
SLEEP_UNTIL = register(Kind("sleep_until", Role.WAIT, open=open_sleep_until, due=woke))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The widest time zone displacement Postgres stores.
_MAX_OFFSET = timedelta(hours=15, minutes=59)


def parse_until(value: Any) -> datetime:
    """A ``sleep_until`` time, in UTC: epoch milliseconds (a number, or digits in a string) or
    ISO-8601 (a time without an offset is UTC). Raises ValueError naming what was given.

    Only times the database can store come back: an offset within ±15:59 (Postgres refuses a
    wider one, and no zone has one) and, in UTC, a year from 1 to 9999. Anything else raised
    inside the database or the reconciler on every pass, until the run's deadline.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{value!r} is neither ISO-8601 nor epoch milliseconds")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, int | float):
        try:
            return _EPOCH + timedelta(milliseconds=value)
        except (OverflowError, ValueError):
            raise ValueError(
                f"epoch milliseconds {value!r} are out of range (years 1 to 9999)"
            ) from None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(
                f"{value!r} is neither ISO-8601 nor epoch milliseconds (or is out of range: "
                "years 1 to 9999, offsets within ±15:59)"
            ) from None
        offset = parsed.utcoffset()
        if offset is not None and abs(offset) > _MAX_OFFSET:
            raise ValueError(f"{value!r} has an offset beyond ±15:59")
        try:
            return parsed.replace(tzinfo=UTC) if offset is None else parsed.astimezone(UTC)
        except OverflowError:
            raise ValueError(
                f"{value!r} is out of range: in UTC it is not in years 1 to 9999"
            ) from None
    raise ValueError(f"{value!r} is neither ISO-8601 nor epoch milliseconds")
