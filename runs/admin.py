"""Admin for inspecting runs and the step journal.

Runs and step runs are written by the engine only: here they are read, never added, changed
or deleted. The two actions call the lifecycle services and report, run by run, what each
answered; they take the ``runs.change_run`` permission, so a view-only operator can look but
not act.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.contrib import admin, messages
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Sum
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from config.admin_mixins import ReadOnlyMixin
from workflows import access
from workflows.admin import WorkflowVersionAdmin
from workflows.errors import EngineError
from workflows.models import WorkflowVersion
from workflows.secrets import shown, shown_text

from . import forecasts
from .engine import contents, costs, slots, unservable
from .models import (
    Account,
    Event,
    ModelCall,
    NotifyDelivery,
    Run,
    RunAction,
    StepRun,
    Timer,
    ToolCall,
)
from .services import account_save, run_cancel, run_retry
from .status import StepStatus
from .timeline import duration

# The characters of a step run's error its run's journal shows.
ERROR_CHARS = 160


def _pretty_json(value: Any) -> str:
    """A stored value as JSON, secrets (their tokens) shown as ``••••``."""
    if value is None:
        return "—"
    text = json.dumps(shown(value), indent=2, ensure_ascii=False, sort_keys=True)
    return format_html('<pre class="djflow-json">{}</pre>', text)


def _without_traceback(error: Any) -> Any:
    if isinstance(error, dict) and "traceback" in error:
        return {key: value for key, value in error.items() if key != "traceback"}
    return error


def _run_link(run_id: Any, text: str | None = None) -> str:
    url = reverse("admin:runs_run_change", args=[run_id])
    return format_html('<a href="{}">{}</a>', url, text or str(run_id))


class RunInline(ReadOnlyMixin, admin.TabularInline):
    """Rows of the run on its page: shown to whoever may read the run (workflows.access), not
    only to holders of the model's global view permission, which a role on one workflow
    does not give."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            # Asked without the run by the inline's queryset, whose rows the formset then
            # narrows to the run of a page that was itself checked.
            return access.has_any_role(request.user)
        return access.may_view_run(request.user, obj.workflow_id, obj.created_by_id)


class StepRunInline(RunInline):
    """The journal of a run, one row per attempt, in the order it was written.

    Nine columns that fit a 1280 px window beside the admin's sidebar: the step with its
    path, when it started and how long it took, its error cut at :data:`ERROR_CHARS` (the
    step run's own page has all of it), long words broken anywhere (runs/admin.css). Eleven
    columns, dates on four lines and an unbroken error (a URL) ran the table 600 px past
    the window's right edge (issue 37)."""

    model = StepRun
    fields = (
        "step",
        "kind",
        "attempt",
        "status",
        "worker",
        "started",
        "took",
        "error_shown",
        "cost_usd",
    )
    readonly_fields = fields
    ordering = ("id",)
    extra = 0
    verbose_name_plural = "step runs (the journal)"

    class Media:
        css = {"all": ["runs/admin.css"]}

    @admin.display(description="step")
    def step(self, step: StepRun) -> str:
        return f"{step.path}{step.step_id}"

    @admin.display(description="started")
    def started(self, step: StepRun) -> str:
        if step.started_at is None:
            return "—"
        return timezone.localtime(step.started_at).strftime("%Y-%m-%d %H:%M:%S")

    @admin.display(description="took")
    def took(self, step: StepRun) -> str:
        if step.started_at is None or step.finished_at is None:
            return "—"
        return duration((step.finished_at - step.started_at).total_seconds() * 1000)

    @admin.display(description="error")
    def error_shown(self, step: StepRun) -> str:
        if not isinstance(step.error, dict):
            return ""
        text = f"{step.error.get('class', '')}: {step.error.get('message', '')}"
        text = shown_text(text)
        return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


class RunActionInline(RunInline):
    """Who cancelled, paused, resumed, retried the run or sent it an event, and when."""

    model = RunAction
    fields = ("action", "actor_name", "created_at", "detail")
    readonly_fields = fields
    ordering = ("created_at", "id")
    extra = 0
    verbose_name_plural = "operator actions"


class RunScopedAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """Rows of runs, shown to whoever may read the run (workflows.access, CONTRACT section 8):
    a user with a role on some workflows sees those runs here as in the API, and nothing
    else; rows of other runs are 404s."""

    run_prefix = ""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        readable = access.run_filter(request.user, self.run_prefix)
        return queryset if readable is None else queryset.filter(readable)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return (
            request.user.is_active and request.user.is_staff and access.has_any_role(request.user)
        )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return self.has_module_permission(request)
        run = obj if isinstance(obj, Run) else obj.run
        return access.may_view_run(request.user, run.workflow_id, run.created_by_id)

    def tracebacks(self, request: HttpRequest, run: Run) -> bool:
        return access.may_see_tracebacks(request.user, run.workflow_id)


@admin.register(Run)
class RunAdmin(RunScopedAdmin):
    list_display = (
        "id",
        "workflow",
        "version_number",
        "status",
        "created_at",
        "finished_at",
        "cost_usd",
        "inspect_link",
    )
    # Related-only: the stock filter lists every workflow id, those the user may not see too.
    list_filter = ("status", ("workflow", admin.RelatedOnlyFieldListFilter))
    search_fields = ("id", "correlation", "idempotency_key")
    list_select_related = ("version",)
    fields = (
        "id",
        "inspect_link",
        "workflow",
        "version_number",
        "status",
        "reason",
        "correlation",
        "idempotency_key",
        "priority",
        "concurrency_key",
        "admitted_at",
        "parent_link",
        "children_links",
        "generation",
        "attempts",
        "cost_usd",
        "created_by",
        "created_at",
        "started_at",
        "finished_at",
        "deadline_at",
        "pretty_input",
        "pretty_output",
        "pretty_error",
    )
    readonly_fields = fields
    inlines = (RunActionInline, StepRunInline)
    actions = ("cancel_runs", "retry_runs")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Run]:
        return super().get_queryset(request).select_related("version", "parent_step_run")

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """The actions are offered to whoever may operate some runs; the service checks each
        selected run (a starter operates only the runs they started)."""
        return access.operates_some(request.user)

    @admin.display(description="waiting")
    def reason(self, run: Run) -> str:
        """Why the run does not move on, when something is known to hold it."""
        queued = slots.waiting_reason(run)
        if queued is not None:
            return queued
        waiting = run.steps.filter(status=StepStatus.SCHEDULED, waiting_since__isnull=False)
        reasons = [unservable.waiting_reason(step) for step in waiting.order_by("id")]
        return next((reason for reason in reasons if reason), "—")

    @admin.display(description="inspector")
    def inspect_link(self, run: Run) -> str:
        """The run's page in the run inspector (graph, timeline, attempts, actions): the
        admin lists and filters; the inspector is where a run is read."""
        url = reverse("runs:inspect", args=[run.id])
        return format_html('<a href="{}" class="djflow-inspect">Inspect</a>', url)

    @admin.display(description="version", ordering="version__number")
    def version_number(self, run: Run) -> int:
        return run.version.number

    @admin.display(description="parent")
    def parent_link(self, run: Run) -> str:
        if run.parent_run_id is None:
            return "—"
        step = run.parent_step_run
        where = f" (step {step.step_id})" if step is not None else ""
        return format_html("{}{}", _run_link(run.parent_run_id), where)

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        run = super().get_object(request, object_id, from_field)
        if run is not None:
            # For children_links, which has no request: only the children the user may read.
            run.readable_children = access.run_filter(request.user)
        return run

    @admin.display(description="children")
    def children_links(self, run: Run) -> str:
        children = run.children.order_by("created_at", "id")
        readable = getattr(run, "readable_children", None)
        if readable is not None:
            children = children.filter(readable)
        children = children.values_list("id", "workflow_id", "status")
        if not children:
            return "—"
        return format_html_join(
            "",
            "<div>{} {} ({})</div>",
            ((_run_link(child_id), workflow, status) for child_id, workflow, status in children),
        )

    @admin.display(description="input")
    def pretty_input(self, run: Run) -> str:
        return _pretty_json(run.input)

    @admin.display(description="output")
    def pretty_output(self, run: Run) -> str:
        return _pretty_json(run.output)

    @admin.display(description="error")
    def pretty_error(self, run: Run) -> str:
        return _pretty_json(run.error)

    # --- actions --------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs", permissions=["operate"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        self._each(request, queryset, run_cancel, "cancelled")

    @admin.action(description="Retry selected failed runs", permissions=["operate"])
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        self._each(request, queryset, run_retry, "retried")

    def _each(
        self,
        request: HttpRequest,
        queryset: QuerySet[Run],
        service: Callable[..., Run],
        done: str,
    ) -> None:
        """Call ``service`` for each run, each in its own transaction, and report each."""
        for run_id in queryset.order_by("created_at", "id").values_list("id", flat=True):
            try:
                service(run_id=run_id, user=request.user)
            except EngineError as exc:
                self.message_user(request, f"Run {run_id}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"Run {run_id} {done}.", messages.SUCCESS)


class ModelCallInline(ReadOnlyMixin, admin.StackedInline):
    """The attempt's model calls (CONTRACT section 10): what was asked and answered, tokens,
    latency, cost and the reservation it was made under. Shown with the attempt, to whoever
    may read its run."""

    model = ModelCall
    fields = (
        "provider",
        "model",
        "answered_by",
        "recipe",
        "recipe_version",
        "status",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
        "reasoning_tokens",
        "latency_ms",
        "cost_usd",
        "reserved_usd",
        "request_id",
        "pretty_error",
        "pretty_retrieved",
        "pretty_prompt",
        "pretty_reply",
    )
    readonly_fields = fields
    ordering = ("id",)
    extra = 0
    verbose_name_plural = "model calls"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).select_related("prompt", "reply")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return access.has_any_role(request.user)
        return access.may_view_run(request.user, obj.run.workflow_id, obj.run.created_by_id)

    @admin.display(description="error")
    def pretty_error(self, call: ModelCall) -> str:
        return _pretty_json(call.error) if call.error else "—"

    @admin.display(
        description="retrieved (knowledge base, query, and each passage's key, version, score)"
    )
    def pretty_retrieved(self, call: ModelCall) -> str:
        return _pretty_json(_cut(call.retrieved)) if call.retrieved else "—"

    @admin.display(description="prompt (system and messages, after templates)")
    def pretty_prompt(self, call: ModelCall) -> str:
        return _pretty_json(_cut(contents.body(call.prompt)))

    @admin.display(description="reply")
    def pretty_reply(self, call: ModelCall) -> str:
        return _pretty_json(_cut(contents.body(call.reply))) if call.reply is not None else "—"


class ToolCallInline(ReadOnlyMixin, admin.StackedInline):
    """The attempt's MCP tool calls: server, tool, the arguments sent and the result answered
    (a run secret in them shown as ``••••``), status and latency."""

    model = ToolCall
    fields = (
        "server",
        "tool",
        "status",
        "latency_ms",
        "pretty_error",
        "pretty_arguments",
        "pretty_result",
    )
    readonly_fields = fields
    ordering = ("id",)
    extra = 0
    verbose_name_plural = "tool calls"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).select_related("arguments", "result")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return access.has_any_role(request.user)
        return access.may_view_run(request.user, obj.run.workflow_id, obj.run.created_by_id)

    @admin.display(description="error")
    def pretty_error(self, call: ToolCall) -> str:
        return _pretty_json(call.error) if call.error else "—"

    @admin.display(description="arguments")
    def pretty_arguments(self, call: ToolCall) -> str:
        return _pretty_json(_cut(contents.body(call.arguments)))

    @admin.display(description="result")
    def pretty_result(self, call: ToolCall) -> str:
        return _pretty_json(_cut(contents.body(call.result))) if call.result is not None else "—"


# The most of a prompt's or reply's text an attempt's admin page shows (a page of many long
# calls must stay a page); GET /api/v1/runs/{id}/calls/{call} has them whole.
SHOWN_TEXT_CHARS = 20_000


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > SHOWN_TEXT_CHARS:
        return f"{value[:SHOWN_TEXT_CHARS]}… [{len(value) - SHOWN_TEXT_CHARS} more characters]"
    if isinstance(value, dict):
        return {key: _cut(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_cut(item) for item in value]
    return value


@admin.register(StepRun)
class StepRunAdmin(RunScopedAdmin):
    run_prefix = "run__"
    inlines = (ModelCallInline, ToolCallInline)

    list_display = (
        "__str__",
        "run_link",
        "kind",
        "attempt",
        "status",
        "worker",
        "scheduled_at",
        "finished_at",
        "cost_usd",
    )
    list_filter = ("status", "kind")
    search_fields = ("step_id", "run__id")
    fields = (
        "run_link",
        "step_id",
        "path",
        "kind",
        "attempt",
        "generation",
        "status",
        "branch",
        "effect",
        "queue",
        "worker",
        "idempotency_key",
        "scheduled_at",
        "started_at",
        "finished_at",
        "lease_expires_at",
        "deadline_at",
        "refusals",
        "waiting_for",
        "waiting_since",
        "cost_usd",
        "pretty_input",
        "pretty_output",
        "pretty_error",
        "pretty_usage",
    )
    readonly_fields = fields

    @admin.display(description="run", ordering="run__created_at")
    def run_link(self, step: StepRun) -> str:
        return _run_link(step.run_id)

    @admin.display(description="input")
    def pretty_input(self, step: StepRun) -> str:
        return _pretty_json(step.input)

    @admin.display(description="output")
    def pretty_output(self, step: StepRun) -> str:
        return _pretty_json(step.output)

    @admin.display(description="error")
    def pretty_error(self, step: StepRun) -> str:
        return _pretty_json(_without_traceback(step.error))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Tracebacks are for the run's operators (CONTRACT section 8).
        if obj is not None and self.tracebacks(request, obj.run):
            return (*self.readonly_fields, "pretty_traceback")
        return self.readonly_fields

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.get_readonly_fields(request, obj)

    @admin.display(description="traceback")
    def pretty_traceback(self, step: StepRun) -> str:
        traceback = step.error.get("traceback") if isinstance(step.error, dict) else None
        return format_html('<pre class="djflow-json">{}</pre>', traceback) if traceback else "—"

    @admin.display(description="usage")
    def pretty_usage(self, step: StepRun) -> str:
        return _pretty_json(step.usage)


@admin.register(Event)
class EventAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """Events delivered through the API or ``workflows.sdk.send_event``, and the waits that
    took each. Whoever does not read every run sees the events they sent and those taken by
    runs they may read (workflows.access)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Event]:
        queryset = super().get_queryset(request)
        readable = access.run_filter(request.user, "run__")
        if readable is None:
            return queryset
        taken = StepRun.objects.filter(event_id=OuterRef("pk")).filter(readable)
        return queryset.filter(Q(created_by_id=request.user.pk) | Q(Exists(taken)))

    list_display = ("id", "name", "key", "created_at", "created_by")
    list_filter = ("name",)
    search_fields = ("name", "key")
    date_hierarchy = "created_at"
    fields = ("name", "key", "pretty_payload", "created_by", "created_at", "taken_by")
    readonly_fields = fields

    @admin.display(description="payload")
    def pretty_payload(self, event: Event) -> str:
        return _pretty_json(event.payload)

    @admin.display(description="taken by")
    def taken_by(self, event: Event) -> str:
        waits = StepRun.objects.filter(event=event).values_list("run_id", "step_id")
        if not waits:
            return "—"
        return format_html_join(
            ", ", "{} ({})", ((_run_link(run_id), step_id) for run_id, step_id in waits)
        )


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    """Accounts with budgets (CONTRACT section 17): operators with ``runs.change_account`` set
    the budget and period here as ``PUT /api/v1/accounts/{name}`` does (the waits on the
    account are offered again); spent and reserved are the engine's. The change page shows
    what the account's runs cost in the period, per workflow."""

    list_display = ("name", "budget_usd", "period", "spent_usd", "reserved_usd", "period_start")
    search_fields = ("name",)
    fields = ("name", "budget_usd", "period", "spent_usd", "reserved_usd", "by_workflow")
    readonly_fields = ("spent_usd", "reserved_usd", "by_workflow")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # A name is the runs' label: renaming a row would orphan its spend.
        return (*self.readonly_fields, "name") if obj is not None else self.readonly_fields

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Account, form: Any, change: bool) -> None:
        # Through the service: it makes the row, counts the period, and releases the waits.
        saved = account_save(
            name=obj.name, budget_usd=obj.budget_usd, period=obj.period, user=request.user
        )
        obj.pk = saved.pk

    @admin.display(description="this period, per workflow")
    def by_workflow(self, account: Account) -> str:
        since = costs.period_start(account.period, timezone.now())
        runs = Run.objects.filter(account=account.name)
        if since is not None:
            runs = runs.filter(created_at__gte=since)
        rows = (
            runs.order_by()
            .values_list("workflow_id")
            .annotate(spent=Sum("cost_usd"), n=Count("id"))
            .order_by("-spent")[:50]
        )
        if not rows:
            return "—"
        return format_html_join(
            ", ", "{}: ${} ({} runs)", ((wf, spent, n) for wf, spent, n in rows)
        )


@admin.register(Timer)
class TimerAdmin(RunScopedAdmin):
    run_prefix = "run__"

    list_display = ("id", "purpose", "run_link", "fire_at", "fired_at")
    list_filter = ("purpose", ("fired_at", admin.EmptyFieldListFilter))
    list_select_related = ("run",)
    fields = ("run_link", "step_run", "purpose", "key", "fire_at", "fired_at", "created_at")
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, timer: Timer) -> str:
        return _run_link(timer.run_id)


@admin.register(NotifyDelivery)
class NotifyDeliveryAdmin(RunScopedAdmin):
    """Run-end webhooks (a document's notify): which were delivered, which are still being
    tried, and which failed for good and why. Shown to whoever may read the run; the URL
    without its query (it may carry a token), never the entry's secret."""

    run_prefix = "run__"

    list_display = ("id", "event", "status", "url_shown", "attempts", "response_status", "run_link")
    list_filter = ("status", "event")
    list_select_related = ("run",)
    fields = (
        "run_link",
        "event",
        "url_shown",
        "status",
        "attempts",
        "response_status",
        "last_error",
        "due_at",
        "created_at",
        "delivered_at",
        "body",
    )
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, delivery: NotifyDelivery) -> str:
        return _run_link(delivery.run_id)

    @admin.display(description="url")
    def url_shown(self, delivery: NotifyDelivery) -> str:
        parts = urlsplit(delivery.url)
        return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


# --- the forecast beside a workflow version (CONTRACT section 17) ----------------------------
# The versions' admin is the workflows app's, which may not import the runs it forecasts: this
# layer, above it, registers it again with the forecast.


class ForecastVersionAdmin(WorkflowVersionAdmin):
    fields = (*WorkflowVersionAdmin.fields[:-1], "forecast", WorkflowVersionAdmin.fields[-1])
    readonly_fields = fields

    @admin.display(description="forecast")
    def forecast(self, version: WorkflowVersion) -> str:
        shown = forecasts.version_forecast(version).as_json()
        return render_to_string("runs/forecast.html", {"forecast": shown})


admin.site.unregister(WorkflowVersion)
admin.site.register(WorkflowVersion, ForecastVersionAdmin)
