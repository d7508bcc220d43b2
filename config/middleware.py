"""Middleware of the project."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse

from workflows.secrets import MASK, TOKEN, forget

_TOKEN_START = b"[secret:"
_TEXT_TYPES = ("text/", "application/json", "application/problem+json")


class SecretMaskMiddleware:
    """The net under every page, admin view and API answer: a secret's token (what the
    database stores in place of a writeOnly input field, see ``workflows.secrets``) shows as
    ``••••`` in any text response, whichever view rendered it.

    The run serializers, the run admin and the e-mails mask explicitly; this catches every
    other place a stored value reaches a person (approval pages and their API, the home page,
    notifications, views added later). It also ends the request's hold on the secrets it
    received (``workflows.secrets.expose``), so the next request on this thread does not mask
    them. Streaming responses (files) are left alone.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        forget()
        try:
            response = self.get_response(request)
        finally:
            forget()
        if response.streaming or _TOKEN_START not in response.content:
            return response
        if not response.get("Content-Type", "").startswith(_TEXT_TYPES):
            return response
        charset = response.charset or "utf-8"
        text = response.content.decode(charset, errors="replace")
        response.content = TOKEN.sub(MASK, text).encode(charset, errors="replace")
        if response.has_header("Content-Length"):
            response["Content-Length"] = str(len(response.content))
        return response


class NulRefusalMiddleware:
    """A request whose path or query holds NUL is a 400 before any view sees it (contract
    section 9: text with NUL anywhere is 400).

    Postgres text holds no NUL, so an id or a filter carrying one made the database driver
    raise in whichever view looked it up: a 500 on ``/api/v1/definitions/{id}``, its versions,
    ``/api/v1/recipes/{name}``, ``/api/v1/kbs/{kb}/documents`` and admin pages. Refusing it
    here covers every route, those added later included. Lone surrogates need no check: Django
    decodes the path and the query as UTF-8 and re-quotes or replaces what is not.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        where = _nul_in(request)
        message = "may not hold NUL characters (%00)"
        if where is None and _foreign_form_charset(request):
            # Django decodes a form body in the charset its Content-Type names: a multipart
            # body in unicode_escape carried a lone surrogate into the database (a 500;
            # security review). Forms here are UTF-8; anything else is refused.
            where, message = "Content-Type", "must name no charset but utf-8 for a form body"
        if where is None:
            return self.get_response(request)
        if request.path_info.startswith("/api/"):
            return JsonResponse({"errors": [{"field": where, "message": message}]}, status=400)
        named = ("path", "query", "Content-Type")
        shown = where if where in named else f"query parameter {where!r}"
        return HttpResponseBadRequest(f"The {shown} {message}.", content_type="text/plain")


def _foreign_form_charset(request: HttpRequest) -> bool:
    """Whether ``request`` is a form body whose Content-Type names a charset not UTF-8."""
    kind = request.content_type or ""
    if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return False
    charset = (request.content_params or {}).get("charset")
    return charset is not None and charset.strip().lower().replace("_", "-") not in (
        "utf-8",
        "utf8",
    )


def _nul_in(request: HttpRequest) -> str | None:
    """Where ``request`` holds NUL: ``"path"``, the query parameter's name (``"query"`` for
    a name holding one), else None."""
    if "\x00" in request.path_info:
        return "path"
    for key, values in request.GET.lists():
        if "\x00" in key:
            return "query"
        if any("\x00" in value for value in values):
            return key
    return None
