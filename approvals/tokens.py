"""Signed, single-use links: a token binds (request, approver) and is signed with Django's
signing (``SECRET_KEY``, a salt of its own). It carries no expiry of its own: it works while
its request is pending and before its deadline, and once (``Approver.used_at``). A token
is a credential only for a plain-address approver; a user approver's link also needs that
user signed in (``approvals.pages.not_theirs``, ``approvals.services.approval_decide``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core import signing
from django.core.exceptions import ValidationError
from django.urls import reverse

from .models import Approver

SALT = "approvals.link"


class LinkProblem(Exception):
    """Why a link cannot be used: ``reason`` names the page shown."""

    def __init__(self, reason: str, approver: Approver | None = None):
        super().__init__(reason)
        self.reason = reason
        self.approver = approver


@dataclass(frozen=True)
class LinkClaim:
    approver_id: int
    request_id: str
    token_id: str


def make_token(approver: Approver) -> str:
    return signing.dumps(
        {"a": approver.id, "r": str(approver.request_id), "t": str(approver.token_id)},
        salt=SALT,
    )


def link_for(approver: Approver) -> str:
    path = reverse("approvals:link", kwargs={"token": make_token(approver)})
    return f"{settings.SITE_URL.rstrip('/')}{path}"


def read_token(token: str) -> Approver:
    """The approver a token was made for; raises :class:`LinkProblem` with ``tampered`` (a
    bad signature or shape) or ``not_approver`` (a valid signature whose binding names no
    approver of that request)."""
    try:
        claim = signing.loads(token, salt=SALT)
    except signing.BadSignature:
        raise LinkProblem("tampered") from None
    if not isinstance(claim, dict) or not {"a", "r", "t"} <= claim.keys():
        raise LinkProblem("tampered")
    try:
        approver = Approver.objects.select_related("request", "user").get(
            id=int(claim["a"]), request_id=str(claim["r"]), token_id=str(claim["t"])
        )
    except (Approver.DoesNotExist, ValueError, TypeError, ValidationError):
        # ValidationError: a signed claim whose ids are not UUIDs (only the key's holder
        # can make one) names no approver either; it must not be a server error.
        raise LinkProblem("not_approver") from None
    return approver
