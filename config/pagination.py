"""Cursor pagination in the contract's shape: ``{"results": [...], "next": <cursor>|null}``."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlparse

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response

from workflows.errors import FieldError, InvalidInput


class ContractCursorPagination(CursorPagination):
    """``next`` is the opaque cursor itself, to send back as ``?cursor=``, not a URL."""

    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500
    cursor_query_param = "cursor"

    @classmethod
    def schema_parameters(cls) -> list[OpenApiParameter]:
        """``cursor`` and ``limit`` as the OpenAPI document states them: ``limit`` within the
        bounds :meth:`get_page_size` keeps (a client generated from the schema sends no 0)."""
        return [
            OpenApiParameter(
                cls.cursor_query_param,
                str,
                description="the `next` of the previous page; the first page without it",
            ),
            OpenApiParameter(
                cls.page_size_query_param,
                {"type": "integer", "minimum": 1, "maximum": cls.max_page_size},
                description=f"rows a page, 1 to {cls.max_page_size} ({cls.page_size} by default)",
            ),
        ]

    def get_page_size(self, request: Any) -> int:
        """``?limit=`` is a whole number from 1 to ``max_page_size``; anything else is a 400
        naming it (DRF would silently fall back to the default page size)."""
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        try:
            size = int(raw, 10)
        except ValueError:
            size = 0
        if not 1 <= size <= self.max_page_size:
            raise InvalidInput(
                errors=[
                    FieldError(
                        self.page_size_query_param,
                        f"must be a whole number from 1 to {self.max_page_size}, not {raw[:40]!r}",
                    )
                ]
            )
        return size

    def decode_cursor(self, request: Any) -> Any:
        bad = InvalidInput(errors=[FieldError("cursor", "is not a cursor this API gave out")])
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            # DRF answers 404 for a cursor it cannot read; it is the client's bad input.
            raise bad from None
        # DRF reads any base64 (or an empty value) without a position or an offset as the
        # first page; every cursor this API gives out has one, so such a value is a mistake
        # to name, not to answer with page one.
        if cursor is not None and not (cursor.position or cursor.offset or cursor.reverse):
            raise bad
        return cursor

    def next_cursor(self) -> str | None:
        link = self.get_next_link()
        if link is None:
            return None
        return parse_qs(urlparse(link).query).get(self.cursor_query_param, [None])[0]

    def get_paginated_response(self, data: list[Any]) -> Response:
        return Response({"results": data, "next": self.next_cursor()})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["results", "next"],
            "properties": {
                "results": schema,
                "next": {
                    "type": "string",
                    "nullable": True,
                    "description": "Send back as ?cursor= for the next page; null at the end.",
                },
            },
        }


class NewestFirstPagination(ContractCursorPagination):
    """Rows with ``created_at`` and ``id``, newest first; a cursor whose position is not a
    time is a bad cursor (400 naming it), not a database error."""

    ordering = ("-created_at", "-id")

    def decode_cursor(self, request: Any) -> Any:
        cursor = super().decode_cursor(request)
        if cursor is not None and cursor.position is not None:
            try:
                valid = parse_datetime(cursor.position) is not None
            except ValueError:
                valid = False
            if not valid:
                raise InvalidInput(
                    errors=[FieldError("cursor", "is not a cursor this API gave out")]
                )
        return cursor
