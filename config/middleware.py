"""Middleware of the project."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

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
