"""The approvals API (contract section 7): the caller's approvals, and their decisions.
Views parse and render; ``approval_decide`` decides."""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Prefetch, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runs.views import RunPagination
from workflows.errors import FieldError, NotFound, echo
from workflows.views import ERRORS

from . import selectors
from .models import ApprovalRequest, Approver
from .serializers import (
    ApprovalListQuerySerializer,
    ApprovalSerializer,
    DecideSerializer,
)
from .services import approval_decide, approver_for, not_theirs
from .status import DecisionChoice
from .views import origin_of

APPROVAL_ID = OpenApiParameter(
    "approval_id",
    OpenApiTypes.STR,
    OpenApiParameter.PATH,
    description="the approval's id (a UUID)",
)


class ApprovalPagination(RunPagination):
    """Newest first, by ``created_at`` like runs (its cursor check applies as is)."""


def _with_rows(approvals: QuerySet[ApprovalRequest]) -> QuerySet[ApprovalRequest]:
    return approvals.select_related("run").prefetch_related(
        "decisions", Prefetch("people", queryset=Approver.objects.select_related("user"))
    )


def _approval_id(raw: str) -> uuid.UUID:
    # A malformed id is an unknown id (404), not a database error.
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"no approval {echo(raw)}")]) from None


def _readable(raw: str, user: Any) -> ApprovalRequest:
    """The approval, for one of its approvers; 404 when unknown and for anyone who may not
    read its run either, 403 for one who may (``services.not_theirs``)."""
    approval = _with_rows(ApprovalRequest.objects.filter(id=_approval_id(raw))).first()
    if approval is None:
        raise NotFound(errors=[FieldError("id", f"no approval {echo(raw)}")])
    if approver_for(approval, user) is None:
        raise not_theirs(approval, user)
    return approval


class ApprovalListView(APIView):
    pagination_class = ApprovalPagination

    @extend_schema(
        operation_id="approvals_list",
        description=(
            "The approvals the caller is an approver of (as a user, through a group, or by"
            " their e-mail address), newest first, cursor-paginated; `?status=pending` for"
            " those still open."
        ),
        parameters=[
            ApprovalListQuerySerializer,
            *ApprovalPagination.schema_parameters(),
        ],
        responses={200: ApprovalSerializer(many=True), 400: ERRORS, 401: ERRORS},
    )
    def get(self, request: Request) -> Response:
        query = ApprovalListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        approvals = _with_rows(selectors.approvals_for(request.user, **query.validated_data))
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(approvals, request, view=self)
        return paginator.get_paginated_response(ApprovalSerializer(page, many=True).data)


class ApprovalDetailView(APIView):
    @extend_schema(
        operation_id="approvals_read",
        parameters=[APPROVAL_ID],
        description="One approval the caller is an approver of, with its decisions so far.",
        responses={200: ApprovalSerializer, 401: ERRORS, 403: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, approval_id: str) -> Response:
        return Response(ApprovalSerializer(_readable(approval_id, request.user)).data)


class ApprovalDecideView(APIView):
    """``POST /approvals/{id}/approve|reject``: the caller's decision, then the approval."""

    decision: str

    def post(self, request: Request, approval_id: str) -> Response:
        body = DecideSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        approval, _ = approval_decide(
            request_id=_approval_id(approval_id),
            decision=self.decision,
            comment=body.validated_data.get("comment") or "",
            origin=origin_of(request, "api"),
            user=request.user,
        )
        fresh = _with_rows(ApprovalRequest.objects.filter(id=approval.id)).get()
        return Response(ApprovalSerializer(fresh).data)


def _decide_schema(name: str, verb: str) -> Any:
    return extend_schema(
        operation_id=f"approvals_{name}",
        parameters=[APPROVAL_ID],
        request=DecideSerializer,
        examples=[
            OpenApiExample(name, value={"comment": "checked the invoice"}, request_only=True)
        ],
        description=(
            f"{verb} as the caller, who must be among the approvers. The request closes when"
            " this decides it (any rejection; `quorum` approvals) and the run goes on. 409 when"
            " the approval is closed or the caller has already decided; 400 naming `comment`"
            " when it is too long."
        ),
        responses={
            200: ApprovalSerializer,
            400: ERRORS,
            401: ERRORS,
            403: ERRORS,
            404: ERRORS,
            409: ERRORS,
        },
    )


class ApprovalApproveView(ApprovalDecideView):
    decision = DecisionChoice.APPROVED

    @_decide_schema("approve", "Approve")
    def post(self, request: Request, approval_id: str) -> Response:
        return super().post(request, approval_id)


class ApprovalRejectView(ApprovalDecideView):
    decision = DecisionChoice.REJECTED

    @_decide_schema("reject", "Reject")
    def post(self, request: Request, approval_id: str) -> Response:
        return super().post(request, approval_id)
