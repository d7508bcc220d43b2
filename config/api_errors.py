"""One DRF exception handler: every error leaves the API as ``{"errors": [...]}``."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import OperationalError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from workflows.errors import EngineError


def _flatten(detail: Any, prefix: str = "") -> list[dict[str, str]]:
    """Turn DRF's nested ``detail`` into a flat list of ``{field, message}``."""
    if isinstance(detail, dict):
        out: list[dict[str, str]] = []
        for key, value in detail.items():
            if key in ("non_field_errors", "detail"):
                out.extend(_flatten(value, prefix))
            else:
                out.extend(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(detail, list):
        out = []
        for item in detail:
            out.extend(_flatten(item, prefix))
        return out
    error = {"message": str(detail)}
    return [{"field": prefix, **error} if prefix else error]


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, EngineError):
        return Response(exc.as_payload(), status=exc.status)
    if isinstance(exc, OperationalError):
        # The database is unreachable or locked (a restart, SQLite's write lock held past its
        # timeout). Nothing was written: the transaction rolled back. Say so, and when to retry.
        response = Response(
            {"errors": [{"message": "the database is unavailable right now; try again"}]},
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
        )
        response["Retry-After"] = "5"
        return response
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ParseError):
        response.data = {"errors": [{"field": "body", "message": str(exc.detail)}]}
    else:
        response.data = {"errors": _flatten(exc.detail)}
    if response.status_code == status.HTTP_401_UNAUTHORIZED:
        response["WWW-Authenticate"] = response.get("WWW-Authenticate", 'Token realm="api"')
    return response
