"""Pages people click: the link from an e-mail, the inbox, notifications.

The link page decides nothing on GET (mail scanners open links): only its form's POST, CSRF
protected, calls ``approval_decide``. A user approver's link works for that user signed in
only; a plain address's for whoever holds it. Every refusal is a page with its HTTP status,
never an error page, and no answer here is stored by a cache or names its address (the
link's token) to the sites it links to.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods, require_POST

from runs.models import Run
from workflows.errors import Conflict, EngineError, InvalidInput, NotFound

from . import pages, selectors
from .models import COMMENT_MAX, ApprovalRequest, Approver, Decision, Notification
from .services import Origin, approval_decide, approver_for, not_theirs, notification_read
from .tokens import LinkProblem, read_token


def origin_of(request: HttpRequest, channel: str) -> Origin:
    # REMOTE_ADDR, not X-Forwarded-For: a header any client can set would let the audit
    # row record an address of the caller's choosing. Behind a proxy, have it set
    # REMOTE_ADDR (e.g. gunicorn --forwarded-allow-ips).
    return Origin(
        channel,
        ip=request.META.get("REMOTE_ADDR") or None,
        user_agent=request.META.get("HTTP_USER_AGENT", ""),
    )


View = Callable[..., HttpResponse]


def private(view: View) -> View:
    """Every answer of ``view`` (its refusals and redirects too) is ``Cache-Control:
    no-store`` (a shared or back-button cache would keep a request's details, and the link's
    answer under the link's address) and ``Referrer-Policy: same-origin`` (a link followed
    from the page to another site must not carry the page's address, the token).

    Not ``no-referrer``: under it browsers send ``Origin: null`` with the page's own form
    POSTs (the Fetch standard), and Django's CSRF check refuses them (seen in Chromium: the
    decide form answered 403). ``same-origin`` sends nothing to other sites and the true
    origin to this one."""

    @wraps(view)
    def answer(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        add_never_cache_headers(response)
        # Set here, so SecurityMiddleware's site-wide SECURE_REFERRER_POLICY (which may be
        # loosened for other pages) leaves it as is.
        response.headers["Referrer-Policy"] = "same-origin"
        return response

    return answer


# --- the e-mailed link ------------------------------------------------------------------


@private
@require_http_methods(["GET", "HEAD", "POST"])
def link(request: HttpRequest, token: str) -> HttpResponse:
    try:
        approver = read_token(token)
    except LinkProblem as problem:
        return pages.link_problem(request, problem.reason)
    refused = pages.not_theirs(request, approver)
    if refused is not None:
        return refused
    if request.method != "POST":
        return pages.blocked(request, approver) or _decide_page(
            request, "approvals/confirm.html", approver, approver.request_id
        )
    try:
        approval, made = approval_decide(
            request_id=approver.request_id,
            approver_id=approver.id,
            decision=request.POST.get("decision", ""),
            comment=request.POST.get("comment", ""),
            origin=origin_of(request, "link"),
            user=request.user,
        )
    except InvalidInput as error:
        return _decide_page(
            request, "approvals/confirm.html", approver, approver.request_id, error, status=400
        )
    except Conflict as error:
        # Used, expired or decided by others meanwhile: the same page a GET would show now.
        approver.refresh_from_db()
        return pages.blocked(request, approver) or pages.service_problem(request, error)
    except EngineError as error:
        return pages.service_problem(request, error)
    return _decided(request, approval, made)


# --- the inbox --------------------------------------------------------------------------


@private
@login_required
def inbox(request: HttpRequest) -> HttpResponse:
    pending, history = selectors.inbox_for(request.user)
    return render(request, "approvals/inbox.html", {"pending": pending, "history": history})


@private
@login_required
@require_http_methods(["GET", "HEAD"])
def detail(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    approval = ApprovalRequest.objects.filter(id=approval_id).select_related("run").first()
    if approval is None:
        return pages.problem(
            request, 404, "No such approval", f"There is no approval {approval_id}."
        )
    approver = approver_for(approval, request.user)
    if approver is None:
        # 404 as for an unknown id, unless they may read its run (403: CONTRACT section 8).
        return pages.service_problem(request, not_theirs(approval, request.user))
    return _decide_page(request, "approvals/detail.html", approver, approval.id)


@private
@login_required
@require_POST
def decide(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    try:
        approval, made = approval_decide(
            request_id=approval_id,
            decision=request.POST.get("decision", ""),
            comment=request.POST.get("comment", ""),
            origin=origin_of(request, "inbox"),
            user=request.user,
        )
    except InvalidInput as error:
        approver = _approver_of(approval_id, request.user)
        if approver is None:
            return pages.service_problem(request, NotFound(f"no approval {approval_id}"))
        return _decide_page(
            request, "approvals/detail.html", approver, approval_id, error, status=400
        )
    except EngineError as error:
        return pages.service_problem(request, error)
    return _decided(request, approval, made)


def _approver_of(approval_id: uuid.UUID, user: Any) -> Approver | None:
    approval = ApprovalRequest.objects.filter(id=approval_id).first()
    return approver_for(approval, user) if approval is not None else None


# --- shared by the link and the inbox ---------------------------------------------------


def _decide_page(
    request: HttpRequest,
    template: str,
    approver: Approver,
    approval_id: Any,
    error: InvalidInput | None = None,
    status: int = 200,
) -> HttpResponse:
    summary = pages.summarize(approval_id)
    mine = next((p.decision for p in summary.people if p.approver.id == approver.id), None)
    context = {
        "summary": summary,
        "approval": summary.approval,
        "run": summary.approval.run,
        "approver": approver,
        "mine": mine,
        "can_decide": summary.approval.is_open and mine is None and approver.used_at is None,
        "errors": error.errors if error is not None else [],
        "comment": request.POST.get("comment", "") if error is not None else "",
        "comment_max": COMMENT_MAX,
    }
    return render(request, template, context, status=status)


def _decided(request: HttpRequest, approval: ApprovalRequest, made: Decision) -> HttpResponse:
    summary = pages.summarize(approval.id)
    run = Run.objects.only("id", "status", "workflow_id").get(id=approval.run_id)
    context = {"summary": summary, "approval": summary.approval, "decision": made, "run": run}
    return render(request, "approvals/decided.html", context)


# --- notifications ----------------------------------------------------------------------

NOTIFICATIONS_SHOWN = 200


@private
@login_required
def notifications(request: HttpRequest) -> HttpResponse:
    rows = Notification.objects.filter(user=request.user).select_related("run")
    shown = list(rows.order_by("-created_at", "-id")[:NOTIFICATIONS_SHOWN])
    return render(request, "approvals/notifications.html", {"notifications": shown})


@private
@login_required
@require_POST
def notifications_read(request: HttpRequest, notification_id: int | None = None) -> HttpResponse:
    notification_read(user=request.user, notification_id=notification_id)
    back = request.POST.get("next", "")
    if back and url_has_allowed_host_and_scheme(
        back, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return redirect(back)
    return redirect("approvals:notifications")
