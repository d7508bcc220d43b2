"""What the scripting commands share (``manage.py start|cancel|retry``): the named user they
act as, and engine errors as command errors naming each field."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser

from workflows.errors import EngineError


def add_user_argument(parser: CommandParser) -> None:
    parser.add_argument(
        "--user",
        required=True,
        help="the username to act as: the command may do what this user may, no more "
        "(the permission model of the API)",
    )


def acting_user(username: str) -> Any:
    user = get_user_model().objects.filter(username=username).first()
    if user is None or not user.is_active:
        raise CommandError(f"--user: no active user '{username}'")
    return user


def refused(error: EngineError) -> CommandError:
    """The error's problems on one line each (``field: message``), as the API names them."""
    lines = [f"{e.field}: {e.message}" if e.field else e.message for e in error.errors]
    return CommandError("\n".join(lines) or str(error))


def serializer_refused(errors: dict[str, Any]) -> CommandError:
    lines = [
        f"--{name.replace('_', '-')}: {' '.join(map(str, msgs))}" for name, msgs in errors.items()
    ]
    return CommandError("\n".join(lines))
