"""Schedules in the admin: listed to their owners and their workflow's viewers; added,
switched on or off and deleted through the same services as the API (so the same permission
checks and the same 400s, shown on the form). The timing itself is beat's periodic task,
linked from here."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from workflows import access
from workflows.errors import EngineError
from workflows.forms import json_from_text

from . import selectors, services
from .clock import CATCH_UP
from .models import Schedule

CATCH_UP_CHOICES = [("", "the setting's (DJFLOW_SCHEDULE_CATCH_UP)")] + [(c, c) for c in CATCH_UP]


def _form_errors(form: forms.Form, error: EngineError) -> None:
    """A service's refusal, each problem on its field when the form has it."""
    for problem in error.errors:
        field = (problem.field or "").split(".")[0].split("[")[0]
        form.add_error(field if field in form.fields else None, problem.message)


class ScheduleAddForm(forms.ModelForm):  # type: ignore[type-arg]
    workflow_id = forms.CharField(label="workflow", max_length=100)
    version = forms.IntegerField(required=False, min_value=1, help_text="empty: the latest")
    input = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6}), required=False, help_text="JSON"
    )
    cron = forms.CharField(
        required=False, help_text="minute hour day-of-month month day-of-week, e.g. 0 2 * * *"
    )
    every_ms = forms.IntegerField(required=False, help_text="or an interval in milliseconds")
    enabled = forms.BooleanField(required=False, initial=True)
    catch_up = forms.ChoiceField(choices=CATCH_UP_CHOICES, required=False)

    class Meta:
        model = Schedule
        fields: list[str] = []

    def __init__(self, *args: Any, user: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.errors:
            return data
        try:
            # The admin's JSON rules (the API parser's): no NaN, \u0000, lone surrogate or
            # nesting past the limit, which the database or the service would fail on.
            value = json_from_text(data["input"]) if data.get("input") else None
        except forms.ValidationError as error:
            self.add_error("input", error)
            return data
        try:
            # The admin's view is one transaction: the schedule commits with the page.
            self.instance = services.schedule_create(
                workflow=data["workflow_id"],
                version=data.get("version"),
                input=value,
                cron=data.get("cron") or None,
                every_ms=data.get("every_ms"),
                enabled=bool(data.get("enabled")),
                catch_up=data.get("catch_up") or None,
                user=self.user,
            )
        except EngineError as error:
            _form_errors(self, error)
        return data


class ScheduleChangeForm(forms.ModelForm):  # type: ignore[type-arg]
    enabled = forms.BooleanField(required=False)
    catch_up = forms.ChoiceField(choices=CATCH_UP_CHOICES, required=False)

    class Meta:
        model = Schedule
        fields: list[str] = []

    def __init__(self, *args: Any, user: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user
        self.fields["enabled"].initial = self.instance.task.enabled
        self.fields["catch_up"].initial = self.instance.catch_up or ""

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        try:
            self.instance = services.schedule_change(
                schedule_id=self.instance.pk,
                user=self.user,
                enabled=bool(data.get("enabled")),
                catch_up=data.get("catch_up") or None,
            )
        except EngineError as error:
            _form_errors(self, error)
        return data


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "id",
        "workflow_id",
        "owner",
        "every_or_cron",
        "enabled",
        "next_run_at",
        "starts",
        "missed",
        "failures",
        "last_error_at",
    )
    list_filter = ("task__enabled",)
    search_fields = ("workflow__id",)
    readonly_fields = (
        "workflow",
        "version",
        "shown_input",
        "every_or_cron",
        "periodic_task",
        "owner",
        "next_run_at",
        "last_slot_at",
        "last_run",
        "starts",
        "missed",
        "failures",
        "last_error",
        "last_error_at",
        "created_at",
    )
    actions = ["delete_selected"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        return selectors.schedule_list(user=request.user)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        base = ScheduleChangeForm if obj is not None else ScheduleAddForm
        user = request.user

        class Form(base):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, user=user, **kw)

        return Form

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return ["workflow_id", "version", "input", "cron", "every_ms", "enabled", "catch_up"]
        return ["enabled", "catch_up", *self.readonly_fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.readonly_fields if obj is not None else ()

    def has_module_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return user.is_active and user.is_staff and access.has_any_role(user)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return self.has_module_permission(request)
        return selectors.may_view(request.user, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Which workflow is the form's to say; the service refuses one the user may not start.
        return self.has_module_permission(request) and access.operates_some(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return self.has_module_permission(request)
        return services.may_change(request.user, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_change_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Schedule, form: Any, change: bool) -> None:
        """The form's clean() saved it through the service."""

    def delete_model(self, request: HttpRequest, obj: Schedule) -> None:
        services.schedule_delete(schedule_id=obj.pk, user=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for schedule in queryset:
            services.schedule_delete(schedule_id=schedule.pk, user=request.user)

    @admin.display(description="input")
    def shown_input(self, schedule: Schedule) -> str:
        return json.dumps(services.shown_input(schedule), indent=2, ensure_ascii=False)

    @admin.display(description="timing")
    def every_or_cron(self, schedule: Schedule) -> str:
        cron = services.cron_of(schedule.task)
        if cron is not None:
            return f"cron {cron}"
        every = services.every_of(schedule.task)
        return f"every {every}"

    @admin.display(boolean=True)
    def enabled(self, schedule: Schedule) -> bool:
        return schedule.task.enabled

    @admin.display(description="periodic task")
    def periodic_task(self, schedule: Schedule) -> str:
        url = reverse("admin:django_celery_beat_periodictask_change", args=[schedule.task_id])
        return format_html('<a href="{}">{}</a>', url, schedule.task.name)
