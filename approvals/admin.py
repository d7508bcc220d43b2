"""Admin for inspecting approvals, their decisions, notifications and the mail outbox.

Everything here is written by the engine and ``approval_decide``: the admin reads, never adds,
changes or deletes. A decision is an audit row (append-only in the model too); its IP and
user agent are shown here and nowhere else. Token ids are shown nowhere, not even here: with
the ``SECRET_KEY`` an approver's token id is all it takes to make their link.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from config.admin_mixins import ReadOnlyMixin
from workflows import access

from .models import ApprovalRequest, Approver, Decision, Mail, Notification
from .outbox import pretty


class RunScopedRows:
    """Rows that belong to a run are shown only to whoever may read that run
    (workflows.access, CONTRACT section 8), whatever Django model permission let them in;
    ``run_prefix`` leads from the row to its run (``None``: rows only for those who read
    every run)."""

    run_prefix: str | None = "run__"

    def get_queryset(self, request: Any) -> Any:
        queryset = super().get_queryset(request)  # type: ignore[misc]
        readable = access.run_filter(request.user, self.run_prefix or "")
        if readable is None:
            return queryset
        return queryset.none() if self.run_prefix is None else queryset.filter(readable)


def _run_link(run_id: Any) -> str:
    if run_id is None:
        return "—"
    url = reverse("admin:runs_run_change", args=[run_id])
    return format_html('<a href="{}">{}</a>', url, run_id)


def _pretty_json(value: Any) -> str:
    if value is None:
        return "—"
    return format_html('<pre class="djflow-json">{}</pre>', pretty(value))


class ApproverInline(ReadOnlyMixin, admin.TabularInline):
    model = Approver
    fields = ("label", "user", "email", "via", "used_at")
    readonly_fields = fields
    extra = 0

    @admin.display(description="approver")
    def label(self, approver: Approver) -> str:
        return approver.label


class DecisionInline(ReadOnlyMixin, admin.TabularInline):
    model = Decision
    fields = ("created_at", "by", "user", "decision", "comment", "channel", "ip", "user_agent")
    readonly_fields = fields
    extra = 0
    verbose_name_plural = "decisions (the audit)"


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(RunScopedRows, ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "status", "workflow", "run_link", "step_id", "created_at", "deadline")
    list_filter = ("status",)
    search_fields = ("id", "step_id", "run__id", "message")
    list_select_related = ("run",)
    date_hierarchy = "created_at"
    fields = (
        "id",
        "status",
        "workflow",
        "run_link",
        "step_id",
        "path",
        "message",
        "pretty_details",
        "pretty_approvers",
        "quorum",
        "deadline",
        "remind_after_ms",
        "reminders_sent",
        "pretty_escalate_to",
        "escalated_at",
        "created_at",
        "closed_at",
    )
    readonly_fields = fields
    inlines = (ApproverInline, DecisionInline)

    @admin.display(description="workflow", ordering="run__workflow")
    def workflow(self, approval: ApprovalRequest) -> str:
        return approval.run.workflow_id

    @admin.display(description="run")
    def run_link(self, approval: ApprovalRequest) -> str:
        return _run_link(approval.run_id)

    @admin.display(description="details")
    def pretty_details(self, approval: ApprovalRequest) -> str:
        return _pretty_json(approval.details)

    @admin.display(description="approvers (as the document names them)")
    def pretty_approvers(self, approval: ApprovalRequest) -> str:
        return _pretty_json(approval.approvers)

    @admin.display(description="escalate to")
    def pretty_escalate_to(self, approval: ApprovalRequest) -> str:
        return _pretty_json(approval.escalate_to)


@admin.register(Decision)
class DecisionAdmin(RunScopedRows, ReadOnlyMixin, admin.ModelAdmin):
    run_prefix = "request__run__"
    list_display = (
        "created_at",
        "request",
        "by",
        "decision",
        "channel",
        "ip",
        "user_agent",
    )
    list_filter = ("decision", "channel")
    search_fields = ("by", "request__id", "ip")
    list_select_related = ("request",)
    date_hierarchy = "created_at"
    fields = (
        "request",
        "approver",
        "user",
        "by",
        "decision",
        "comment",
        "channel",
        "ip",
        "user_agent",
        "created_at",
    )
    readonly_fields = fields


@admin.register(Notification)
class NotificationAdmin(RunScopedRows, ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("created_at", "user", "kind", "title", "run_link", "read_at")
    list_filter = ("kind", ("read_at", admin.EmptyFieldListFilter))
    search_fields = ("title", "user__username")
    list_select_related = ("user",)
    fields = ("user", "kind", "title", "body", "run_link", "step_run", "created_at", "read_at")
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, notification: Notification) -> str:
        return _run_link(notification.run_id)


@admin.register(Mail)
class MailAdmin(RunScopedRows, ReadOnlyMixin, admin.ModelAdmin):
    run_prefix = None  # a mail's run is two joins away: global readers only
    list_display = ("id", "kind", "to", "status", "tries", "created_at", "sent_at", "last_error")
    list_filter = ("status", "kind")
    search_fields = ("to",)
    fields = (
        "kind",
        "to",
        "approver",
        "notification",
        "status",
        "tries",
        "last_error",
        "created_at",
        "offered_at",
        "sent_at",
    )
    readonly_fields = fields
