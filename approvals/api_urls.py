"""The approvals API, under /api/v1 (contract section 7)."""

from django.urls import path

from . import api

urlpatterns = [
    path("approvals", api.ApprovalListView.as_view(), name="approvals-api"),
    path("approvals/<str:approval_id>", api.ApprovalDetailView.as_view(), name="approval-api"),
    path(
        "approvals/<str:approval_id>/approve",
        api.ApprovalApproveView.as_view(),
        name="approval-api-approve",
    ),
    path(
        "approvals/<str:approval_id>/reject",
        api.ApprovalRejectView.as_view(),
        name="approval-api-reject",
    ),
]
