"""Limits on who may knock how often: the API's request rates and the sign-in lockout.

Both count in a store every process shares. The API's throttles count in Django's cache
(``CACHE_URL``: the database by default, Redis when set): a per-process memory cache would
give each gunicorn worker and each process of the standalone its own count, so N processes
would allow N times the rate. Failed sign-ins are counted by django-axes in the database.
"""

from __future__ import annotations

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.http import HttpRequest
from rest_framework import throttling
from rest_framework.settings import api_settings


class LoginLockoutBackend(AxesStandaloneBackend):
    """django-axes's check, for sign-ins that come over HTTP (the sign-in page, the admin's).

    ``authenticate()`` without a request (``manage.py shell``, a script on the server) is not a
    sign-in from the network: there is no address to count and nobody to lock out, so it goes
    on to the next backend instead of failing as upstream's does.
    """

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def client_ip(request: HttpRequest) -> str | None:
    """The address a sign-in came from: ``REMOTE_ADDR``, or behind ``DJFLOW_TRUSTED_PROXIES``
    proxies the address the outermost of them saw (each appends the address it received from
    to ``X-Forwarded-For``; what a client wrote to the left of that may be forged)."""
    proxies = settings.DJFLOW_TRUSTED_PROXIES
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        if hops:
            return hops[-min(proxies, len(hops))]
    return request.META.get("REMOTE_ADDR")


class _RatesFromSettings:
    """DRF binds its rates when the throttle module is imported; these read them on each
    request, so a changed setting (a test's) applies."""

    scope: str

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class UserRateThrottle(_RatesFromSettings, throttling.UserRateThrottle):
    """Requests per signed-in user (token or session): ``DJFLOW_API_THROTTLE_USER``."""


class AnonRateThrottle(_RatesFromSettings, throttling.AnonRateThrottle):
    """Anonymous requests per client address: ``DJFLOW_API_THROTTLE_ANON``."""
