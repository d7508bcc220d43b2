"""The engine's one exception hierarchy.

Every failure a client can cause is an :class:`EngineError` with a code, an HTTP status and a
list of ``{"field"?, "message"}`` problems; ``config.api_errors.exception_handler`` turns it
into the contract's error JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldError:
    """One problem with a client's input; ``field`` is a path such as ``steps[2].when.path``."""

    field: str | None
    message: str

    def as_dict(self) -> dict[str, str]:
        out = {"message": self.message}
        if self.field is not None:
            out = {"field": self.field, **out}
        return out


class EngineError(Exception):
    code = "error"
    status = 400

    def __init__(self, message: str = "", *, errors: list[FieldError] | None = None):
        self.errors = errors or [FieldError(None, message or self.code)]
        super().__init__(message or "; ".join(_describe(e) for e in self.errors))

    def as_payload(self) -> dict[str, Any]:
        return {"errors": [e.as_dict() for e in self.errors]}


def echo(value: object, limit: int = 64) -> str:
    """A client's value as an error message repeats it: at most ``limit`` characters, so a
    3,000-character id in a path is not sent back whole."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(error: FieldError) -> str:
    return f"{error.field}: {error.message}" if error.field else error.message


class InvalidDocument(EngineError):
    """A workflow document broke the schema or a rule of contract section 4."""

    code = "invalid_document"
    status = 400


class InvalidInput(EngineError):
    code = "invalid_input"
    status = 400


class NotFound(EngineError):
    code = "not_found"
    status = 404


class Conflict(EngineError):
    code = "conflict"
    status = 409


class Forbidden(EngineError):
    code = "forbidden"
    status = 403
