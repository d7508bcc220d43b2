"""What every page's header shows: the signed-in user's unread notifications."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils.functional import SimpleLazyObject

from .selectors import unread_count


def header(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None:
        return {"unread_notifications": 0}
    # Lazy: counted only by pages that show the header (not the admin, not the API).
    return {"unread_notifications": SimpleLazyObject(lambda: unread_count(user))}
