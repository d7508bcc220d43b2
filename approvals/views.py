"""Placeholder views; the pages are built in templates/approvals/."""

from django.http import HttpRequest, HttpResponse


def inbox(request: HttpRequest) -> HttpResponse:
    return HttpResponse("inbox")


def link(request: HttpRequest, token: str) -> HttpResponse:
    return HttpResponse("link")


def notifications(request: HttpRequest) -> HttpResponse:
    return HttpResponse("notifications")
