"""Shapes of approvals in the API (contract section 7: ``{id, run, step_id, status, message,
approvers, quorum, deadline, decisions}``, with a few more fields). Decisions are shown
without the IP address and user agent their audit rows keep: those are for the admin."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from runs.serializers import QuerySerializer, StrictBodySerializer, StrictCharField

from .models import COMMENT_MAX, ApprovalRequest, Decision
from .status import ApprovalStatus

PEOPLE_SCHEMA = {
    "type": "array",
    "description": "each person the request was sent to, and whether they have decided",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "via": {"type": "string", "description": 'user, "group:<name>" or email'},
            "decided": {"type": "boolean"},
        },
        "required": ["name", "via", "decided"],
    },
}

APPROVERS_SCHEMA = {
    "type": "object",
    "description": "the approvers as the document names them",
    "properties": {
        "users": {"type": "array", "items": {"type": "string"}},
        "groups": {"type": "array", "items": {"type": "string"}},
        "emails": {"type": "array", "items": {"type": "string"}},
    },
}


class DecideSerializer(StrictBodySerializer):
    """The body of ``POST /approvals/{id}/approve|reject``. Unknown fields are refused."""

    comment = StrictCharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        trim_whitespace=False,
        max_length=COMMENT_MAX,
        help_text=f"optional, up to {COMMENT_MAX} characters",
    )

    body_name = "a decision"


class ApprovalListQuerySerializer(QuerySerializer):
    """The filter of ``GET /approvals``."""

    status = serializers.ChoiceField(choices=ApprovalStatus.choices, required=False)


class DecisionSerializer(serializers.ModelSerializer):
    class Meta:
        model = Decision
        fields = ["by", "decision", "comment", "channel", "created_at"]
        read_only_fields = fields


class ApprovalSerializer(serializers.ModelSerializer):
    workflow = serializers.CharField(source="run.workflow_id", read_only=True)
    details = serializers.JSONField(read_only=True, allow_null=True)
    approvers = serializers.SerializerMethodField()
    decisions = DecisionSerializer(many=True, read_only=True)
    people = serializers.SerializerMethodField()

    class Meta:
        model = ApprovalRequest
        fields = [
            "id",
            "run",
            "workflow",
            "step_id",
            "path",
            "status",
            "message",
            "details",
            "approvers",
            "quorum",
            "deadline",
            "decisions",
            "people",
            "created_at",
            "closed_at",
        ]
        read_only_fields = fields

    @extend_schema_field(APPROVERS_SCHEMA)
    def get_approvers(self, approval: ApprovalRequest) -> dict[str, Any]:
        return dict(approval.approvers or {})

    @extend_schema_field(PEOPLE_SCHEMA)
    def get_people(self, approval: ApprovalRequest) -> list[dict[str, Any]]:
        return [
            {"name": person.label, "via": person.via, "decided": person.used_at is not None}
            for person in approval.people.all()
        ]
