"""Admin for authoring workflow definitions.

Documents are written through ``workflows.services.definition_save`` only, so the admin, the
API and the builder store the same thing. The admin holds no rules of its own: it shows the
editor, hands the parsed JSON to the service, and lists the service's ``{field, message}``
errors against the user's unchanged text. Versions are immutable and read-only here.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from config.admin_mixins import ReadOnlyMixin

from . import access, heartbeats, kb_admin, selectors  # noqa: F401 (kb_admin registers)
from .diff import diff_line_kind, document_diff, reading_order
from .errors import EngineError, FieldError
from .forms import DocumentForm, RecipeForm, RecipePreviewForm, RoleForm, listed_at
from .models import Recipe, WorkerHeartbeat, Workflow, WorkflowVersion
from .preflight import start_problems, start_warnings
from .recipes import Rendered, RenderTooLarge, render
from .services import SaveResult, definition_save, recipe_save

# What the add page starts from: the shape of a document, for the user to fill in.
STARTER_DOCUMENT: dict[str, Any] = {
    "id": "",
    "description": "",
    "steps": [{"id": "first_step", "kind": "task"}],
}

HASH_PREFIX_LENGTH = 12


def _pretty(document: dict[str, Any]) -> str:
    return json.dumps(reading_order(document), indent=2, ensure_ascii=False)


def _preflight(version: WorkflowVersion) -> str:
    """What a start of ``version`` would be refused for now, the input aside (the same checks
    as ``POST /runs`` and ``manage.py preflight``): an operator sees a missing recipe,
    knowledge base, tool, provider or worker before a run meets it. A handler no live worker
    serves now, but one served within ``UNSERVABLE_SECONDS``, is a warning below them: a
    start is accepted and its run waits for a worker."""
    problems = start_problems(version)
    warnings = start_warnings(version, problems)
    if not problems and not warnings:
        return format_html('<span class="djflow-preflight-ok">{}</span>', "Every check passes.")
    return format_html(
        "{}{}",
        _listed("djflow-preflight-problems", problems),
        _listed("djflow-preflight-warnings", warnings),
    )


def _listed(css_class: str, problems: list[FieldError]) -> str:
    if not problems:
        return ""
    return format_html(
        '<ul class="{}">{}</ul>',
        css_class,
        format_html_join(
            "",
            "<li><code>{}</code>: {}</li>",
            ((listed_at(p) or "(run)", p.message) for p in problems),
        ),
    )


def _version_url(version: WorkflowVersion) -> str:
    return reverse("admin:workflows_workflowversion_change", args=[version.pk])


def _workflow_url(
    workflow_id: str, view: str = "change", query: dict[str, Any] | None = None
) -> str:
    url = reverse(f"admin:workflows_workflow_{view}", args=[quote(workflow_id)])
    return f"{url}?{urlencode(query)}" if query else url


class WorkflowVersionInline(ReadOnlyMixin, admin.TabularInline):
    """The versions of a workflow, newest first; a table to read, never a formset to edit."""

    model = WorkflowVersion
    fields = ("number", "hash_prefix", "description", "created_by", "created_at", "links")
    readonly_fields = fields
    ordering = ("-number",)
    extra = 0
    can_delete = False
    verbose_name_plural = "versions"

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowVersion]:
        return super().get_queryset(request).select_related("created_by")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Whoever may read the workflow reads its versions (workflows.access): a role on it
        # gives no global view permission on versions.
        if obj is None:
            # Asked without the workflow by the inline's queryset, whose rows the formset
            # then narrows to the workflow of a page that was itself checked.
            return access.has_any_role(request.user) or access.sees_all_definitions(request.user)
        return access.may_see_definition(request.user, obj.pk)

    @admin.display(description="hash")
    def hash_prefix(self, version: WorkflowVersion) -> str:
        return format_html("<code>{}</code>", version.content_hash[:HASH_PREFIX_LENGTH])

    @admin.display(description="")
    def links(self, version: WorkflowVersion) -> str:
        return format_html(
            '<a href="{}">view</a> · <a href="{}">diff with previous</a> · '
            '<a href="{}">new version from this</a>',
            _version_url(version),
            _workflow_url(version.workflow_id, "diff", {"to": version.number}),
            _workflow_url(version.workflow_id, "new_version", {"from": version.number}),
        )


@admin.register(Workflow)
class WorkflowAdmin(admin.ModelAdmin):
    list_display = ("id", "latest_number", "latest_description", "created_at")
    search_fields = ("id",)
    fields = ("id", "created_at", "latest_preflight", "latest_document")
    readonly_fields = fields
    inlines = (WorkflowVersionInline,)
    document_form_template = "admin/workflows/workflow/document_form.html"
    diff_template = "admin/workflows/workflow/diff.html"
    roles_template = "admin/workflows/workflow/roles.html"

    # --- who may do what (workflows.access, CONTRACT section 8) ------------------------------

    def has_module_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return (
            user.is_active
            and user.is_staff
            and (access.has_any_role(user) or access.may_create(user))
        )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return self.has_module_permission(request)
        return access.may_see_definition(request.user, obj.pk)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return access.may_create(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # "Change" is authoring: a new version through the "New version" page.
        if obj is None:
            return access.AUTHOR in access.global_roles(request.user) or (
                self.has_module_permission(request)
            )
        return access.may_author(request.user, obj.pk, exists=True)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Workflow]:
        latest = WorkflowVersion.objects.filter(workflow=OuterRef("pk")).order_by("-number")
        visible = access.visible_workflows(request.user, super().get_queryset(request))
        return visible.annotate(
            latest_number=Subquery(latest.values("number")[:1]),
            latest_description=Subquery(latest.values("description")[:1]),
        )

    # --- list and change page ---------------------------------------------------------------

    @admin.display(description="latest version", ordering="latest_number")
    def latest_number(self, workflow: Workflow) -> int | None:
        return workflow.latest_number  # type: ignore[attr-defined]

    @admin.display(description="description")
    def latest_description(self, workflow: Workflow) -> str:
        return workflow.latest_description or ""  # type: ignore[attr-defined]

    @admin.display(description="latest document")
    def latest_document(self, workflow: Workflow) -> str:
        version = workflow.latest_version
        if version is None:
            return "—"
        return format_html('<pre class="djflow-document">{}</pre>', _pretty(version.document))

    @admin.display(description="pre-flight")
    def latest_preflight(self, workflow: Workflow) -> str:
        version = workflow.latest_version
        return "—" if version is None else _preflight(version)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Versions are immutable and runs pin them: a workflow is never deleted from here.
        return False

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Nothing on this page is editable; a new body goes through "New version".
        if request.method not in ("GET", "HEAD"):
            return HttpResponseNotAllowed(["GET", "HEAD"])
        workflow_id = unquote(object_id)
        context = {
            "title": f"Workflow {workflow_id}",
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            "show_delete": False,
            "can_author": access.may_author(request.user, workflow_id, exists=True),
            "can_grant": access.may_grant(request.user, workflow_id, access.VIEWER),
            "roles_url": _workflow_url(workflow_id, "roles"),
            "new_version_url": _workflow_url(workflow_id, "new_version"),
            "diff_url": _workflow_url(workflow_id, "diff"),
            # The start form (CONTRACT section 15), a page of runs: named, not imported.
            "start_url": (
                reverse("runs:start", kwargs={"workflow_id": workflow_id})
                if access.may_start(request.user, workflow_id)
                else None
            ),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra_context=context)

    # --- authoring ----------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        info = (self.opts.app_label, self.opts.model_name)
        custom = [
            path(
                "<path:object_id>/new-version/",
                self.admin_site.admin_view(self.new_version_view),
                name="{}_{}_new_version".format(*info),
            ),
            path(
                "<path:object_id>/diff/",
                self.admin_site.admin_view(self.diff_view),
                name="{}_{}_diff".format(*info),
            ),
            path(
                "<path:object_id>/roles/",
                self.admin_site.admin_view(self.roles_view),
                name="{}_{}_roles".format(*info),
            ),
        ]
        return custom + super().get_urls()

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_add_permission(request):
            raise PermissionDenied
        return self._document_view(
            request, workflow=None, initial=STARTER_DOCUMENT, title="Add workflow"
        )

    def new_version_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        workflow = self.get_object(request, unquote(object_id))
        if workflow is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_change_permission(request, workflow):
            raise PermissionDenied
        base_number = request.GET.get("from")
        number = int(base_number) if base_number and base_number.isdigit() else None
        base = WorkflowVersion.objects.resolve(workflow.id, number)
        initial = (
            {k: v for k, v in base.document.items() if k != "version"}
            if base is not None
            else {**STARTER_DOCUMENT, "id": workflow.id}
        )
        title = f"New version of {workflow.id}"
        if base is not None:
            title += f" (starting from version {base.number})"
        return self._document_view(request, workflow=workflow, initial=initial, title=title)

    def _document_view(
        self,
        request: HttpRequest,
        *,
        workflow: Workflow | None,
        initial: dict[str, Any],
        title: str,
    ) -> HttpResponse:
        workflow_id = workflow.id if workflow is not None else None
        if request.method == "POST":
            form = DocumentForm(request.POST, workflow_id=workflow_id)
            if form.is_valid():
                document = form.cleaned_data["document"]
                refused = self._refusals(request, workflow, document)
                if refused:
                    form.add_document_errors(refused)
                else:
                    try:
                        result = definition_save(document=document, user=request.user)
                    except EngineError as exc:
                        form.add_document_errors(exc.errors)
                    else:
                        return self._saved(request, result)
        else:
            form = DocumentForm(initial={"document": _pretty(initial)}, workflow_id=workflow_id)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "workflow": workflow,
            "form": form,
            "media": self.media + form.media,
            "has_view_permission": self.has_view_permission(request),
        }
        return TemplateResponse(request, self.document_form_template, context)

    def _refusals(
        self, request: HttpRequest, workflow: Workflow | None, document: Any
    ) -> list[FieldError]:
        """Permission, not validation: the add page saves a new version when the id exists,
        as the API does, and that takes the change permission the "New version" page needs."""
        if workflow is not None or not isinstance(document, dict):
            return []
        existing = Workflow.objects.filter(id=document.get("id")).first()
        if existing is None or self.has_change_permission(request, existing):
            return []
        return [
            FieldError(
                "id",
                f"workflow '{existing.id}' already exists and you may not add versions to it; "
                "choose another id",
            )
        ]

    def _saved(self, request: HttpRequest, result: SaveResult) -> HttpResponse:
        version = result.version
        workflow_id = version.workflow_id
        if result.created:
            message = f"Saved {workflow_id} version {version.number}."
            if version.workflow.versions.count() == 1:
                self.log_addition(request, version.workflow, [{"added": {}}])
            else:
                self.log_change(request, version.workflow, message)
            self.message_user(request, message, messages.SUCCESS)
        else:
            self.message_user(
                request,
                f"unchanged: this is already version {version.number} of {workflow_id}",
                messages.WARNING,
            )
        # A warning, not a refusal: the worker that serves it may be deployed later. A start
        # is refused while no worker has served it within UNSERVABLE_SECONDS, and accepted
        # (the run waits) when one did but none is live (START_CHECKS_WORKERS).
        for _, why in heartbeats.unserved_steps(document=version.document):
            self.message_user(request, why, messages.WARNING)
        return HttpResponseRedirect(_workflow_url(workflow_id))

    # --- roles --------------------------------------------------------------------------------

    def roles_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Who holds which role on the workflow; authors grant and revoke every role, operators
        the viewer role (the contract's table). Through workflows.access, like the command."""
        workflow = self.get_object(request, unquote(object_id))
        if workflow is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not access.may_grant(request.user, workflow.pk, access.VIEWER):
            raise PermissionDenied
        form = RoleForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            role = form.cleaned_data["role"]
            holder = form.cleaned_data["holder"]
            if not access.may_grant(request.user, workflow.pk, role):
                form.add_error("role", f"you may not grant or revoke the {role} role")
            else:
                change = access.revoke if form.cleaned_data["revoke"] else access.grant
                change(role, workflow.pk, **holder)
                verb = "Revoked" if form.cleaned_data["revoke"] else "Granted"
                message = f"{verb} {role} on {workflow.pk} for {form.cleaned_data['name']}."
                self.log_change(request, workflow, message)
                self.message_user(request, message, messages.SUCCESS)
                return HttpResponseRedirect(_workflow_url(workflow.pk, "roles"))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Roles on {workflow.pk}",
            "workflow": workflow,
            "holders": access.holders(workflow.pk),
            "form": form,
            "change_url": _workflow_url(workflow.pk),
            "has_view_permission": True,
        }
        return TemplateResponse(request, self.roles_template, context)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The history logs every grant and revoke ("Granted operator on billing for zoe"):
        # it is for those the Roles page admits, not every reader of the workflow.
        workflow = self.get_object(request, unquote(object_id))
        if workflow is not None and not access.may_grant(request.user, workflow.pk, access.VIEWER):
            raise PermissionDenied
        return super().history_view(request, object_id, extra_context)

    # --- diff ---------------------------------------------------------------------------------

    def diff_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """``?from=1&to=3``; ``to`` defaults to the latest, ``from`` to the one before ``to``."""
        workflow = self.get_object(request, unquote(object_id))
        if workflow is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_or_change_permission(request, workflow):
            raise PermissionDenied
        numbers = list(workflow.versions.order_by("number").values_list("number", flat=True))
        problems: list[str] = []

        def pick(name: str, default: int | None) -> int | None:
            raw = request.GET.get(name)
            if not raw:
                return default
            if raw.isdigit() and int(raw) in numbers:
                return int(raw)
            problems.append(f"{workflow.id} has no version {raw!r} (for '{name}').")
            return None

        to_number = pick("to", numbers[-1] if numbers else None)
        earlier = [n for n in numbers if to_number is not None and n < to_number]
        from_number = pick("from", earlier[-1] if earlier else to_number)

        rows: list[tuple[str, str]] | None = None
        if from_number is not None and to_number is not None:
            docs = dict(
                workflow.versions.filter(number__in={from_number, to_number}).values_list(
                    "number", "document"
                )
            )
            lines = document_diff(
                docs[from_number],
                docs[to_number],
                fromfile=f"{workflow.id} version {from_number}",
                tofile=f"{workflow.id} version {to_number}",
            )
            rows = [(line, diff_line_kind(line)) for line in lines]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Changes in {workflow.id}",
            "workflow": workflow,
            "numbers": numbers,
            "from_number": from_number,
            "to_number": to_number,
            "problems": problems,
            "rows": rows,
            "change_url": _workflow_url(workflow.id),
            "has_view_permission": True,
        }
        return TemplateResponse(request, self.diff_template, context)


@admin.register(WorkflowVersion)
class WorkflowVersionAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """Versions are immutable: they can be looked at, never added, changed or deleted here."""

    list_display = ("__str__", "number", "hash_prefix", "description", "created_by", "created_at")
    # Related-only: the stock filter lists every workflow id, those the user may not see too.
    list_filter = (("workflow", admin.RelatedOnlyFieldListFilter),)
    search_fields = ("workflow__id", "description")
    list_select_related = ("created_by",)

    # --- who may see what (workflows.access): a version is read by its workflow's readers --

    def has_module_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return (
            user.is_active
            and user.is_staff
            and (access.has_any_role(user) or access.sees_all_definitions(user))
        )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is None:
            return self.has_module_permission(request)
        return access.may_see_definition(request.user, obj.workflow_id)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowVersion]:
        visible = access.visible_workflows(request.user, Workflow.objects.all())
        return super().get_queryset(request).filter(workflow__in=visible.values("pk"))

    fields = (
        "workflow_link",
        "number",
        "content_hash",
        "description",
        "created_by",
        "created_at",
        "preflight",
        "pretty_document",
    )
    readonly_fields = fields

    @admin.display(description="pre-flight")
    def preflight(self, version: WorkflowVersion) -> str:
        return _preflight(version)

    @admin.display(description="hash")
    def hash_prefix(self, version: WorkflowVersion) -> str:
        return format_html("<code>{}</code>", version.content_hash[:HASH_PREFIX_LENGTH])

    @admin.display(description="workflow")
    def workflow_link(self, version: WorkflowVersion) -> str:
        return format_html(
            '<a href="{}">{}</a>', _workflow_url(version.workflow_id), version.workflow_id
        )

    @admin.display(description="document")
    def pretty_document(self, version: WorkflowVersion) -> str:
        return format_html('<pre class="djflow-document">{}</pre>', _pretty(version.document))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        version = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if version is not None:
            context["version_links"] = format_html_join(
                "",
                '<li><a href="{}">{}</a></li>',
                [
                    (
                        _workflow_url(version.workflow_id, "diff", {"to": version.number}),
                        "Diff with previous",
                    ),
                    (
                        _workflow_url(version.workflow_id, "new_version", {"from": version.number}),
                        "New version from this",
                    ),
                ],
            )
        return super().change_view(request, object_id, form_url, extra_context=context)


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """The workers that said which handlers they serve; written by the workers only."""

    list_display = ("hostname", "live", "queue_list", "handler_count", "last_seen", "stopped_at")
    fields = (
        "hostname",
        "live",
        "pid",
        "queues",
        "handlers",
        "started_at",
        "last_seen",
        "stopped_at",
    )
    readonly_fields = fields
    search_fields = ("hostname",)

    @admin.display(boolean=True)
    def live(self, worker: WorkerHeartbeat) -> bool:
        return heartbeats.is_live(worker, timezone.now())

    @admin.display(description="queues")
    def queue_list(self, worker: WorkerHeartbeat) -> str:
        return ", ".join(worker.queues)

    @admin.display(description="handlers")
    def handler_count(self, worker: WorkerHeartbeat) -> int:
        return len(worker.handlers)


@admin.register(Recipe)
class RecipeAdmin(admin.ModelAdmin):
    """Recipes (CONTRACT section 10): every row is one immutable version.

    Saving, on the add page or on a version's page, hands the form's document to
    ``workflows.services.recipe_save`` (no ``version``): a changed body becomes the next
    version, an unchanged one is the version that holds it; no stored row is ever edited.
    The service's field-named errors show on the form field they name. Each version has a
    preview page that renders it with a sample input and context (``workflows.recipes.render``;
    no model is called).

    Who may (``workflows.access``, as the API): reading and the preview need
    ``workflows.view_recipe``, ``add_recipe`` or ``change_recipe``; the add page a new name
    ``add_recipe``; a new version ``change_recipe``. Nothing deletes a recipe.
    """

    list_display = ("name", "version", "model_name", "output_kind", "description", "created_at")
    list_display_links = ("name", "version")
    search_fields = ("name",)
    ordering = ("name", "-version")
    list_select_related = ("created_by",)
    form_template = "admin/workflows/recipe/recipe_form.html"
    preview_template = "admin/workflows/recipe/preview.html"

    # --- who may do what (workflows.access) ----------------------------------------------------

    def has_module_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return user.is_active and user.is_staff and access.may_read_recipes(user)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_module_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self.has_module_permission(request) and access.may_add_recipe(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # "Change" is saving a new version from a version's page.
        return self.has_module_permission(request) and access.may_change_recipe(request.user)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # --- list ----------------------------------------------------------------------------------

    @admin.display(description="model")
    def model_name(self, recipe: Recipe) -> str:
        return recipe.model or "—"

    @admin.display(description="output")
    def output_kind(self, recipe: Recipe) -> str:
        return recipe.output

    # --- pages ---------------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        info = (self.opts.app_label, self.opts.model_name)
        preview = path(
            "<path:object_id>/preview/",
            self.admin_site.admin_view(self.preview_view),
            name="{}_{}_preview".format(*info),
        )
        return [preview, *super().get_urls()]

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_add_permission(request):
            raise PermissionDenied
        return self._recipe_view(request, None)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        recipe = self.get_object(request, unquote(object_id))
        if recipe is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, recipe):
            raise PermissionDenied
        if request.method == "POST" and not self.has_change_permission(request, recipe):
            raise PermissionDenied
        return self._recipe_view(request, recipe)

    def _recipe_view(self, request: HttpRequest, recipe: Recipe | None) -> HttpResponse:
        name = recipe.name if recipe is not None else None
        can_save = (
            self.has_change_permission(request, recipe)
            if recipe is not None
            else self.has_add_permission(request)
        )
        if request.method == "POST":
            form = RecipeForm(request.POST, name=name)
            if form.is_valid():
                try:
                    saved, created = recipe_save(document=form.document(), user=request.user)
                except EngineError as exc:
                    form.add_recipe_errors(exc.errors)
                else:
                    return self._recipe_saved(request, saved, created)
        else:
            initial = RecipeForm.initial_from(recipe.document) if recipe is not None else {}
            form = RecipeForm(initial=initial, name=name)
        if not can_save:
            for field in form.fields.values():
                field.disabled = True
        versions = (
            selectors.recipe_versions(name=name)
            if name is not None
            else selectors.RecipeVersions(newest=[], total=0)
        )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Recipe {recipe}" if recipe is not None else "Add recipe",
            "recipe": recipe,
            "form": form,
            "can_save": can_save,
            "versions": [(pk, number, _recipe_url(pk)) for pk, number in versions.newest],
            "versions_total": versions.total,
            "versions_hidden": versions.total - len(versions.newest),
            "preview_url": _recipe_url(recipe.pk, "preview") if recipe is not None else None,
            "media": self.media + form.media,
            "has_view_permission": True,
        }
        return TemplateResponse(request, self.form_template, context)

    def _recipe_saved(self, request: HttpRequest, recipe: Recipe, created: bool) -> HttpResponse:
        if created:
            message = f"Saved recipe {recipe.name} version {recipe.version}."
            if recipe.version == 1:
                self.log_addition(request, recipe, [{"added": {}}])
            else:
                self.log_change(request, recipe, message)
            self.message_user(request, message, messages.SUCCESS)
        else:
            self.message_user(
                request,
                f"unchanged: this is already version {recipe.version} of {recipe.name}",
                messages.WARNING,
            )
        return HttpResponseRedirect(_recipe_url(recipe.pk))

    def preview_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Render the version with a sample input and context; nothing is saved or called."""
        recipe = self.get_object(request, unquote(object_id))
        if recipe is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, recipe):
            raise PermissionDenied
        form = RecipePreviewForm(request.POST or None)
        rendered: Rendered | None = None
        if request.method == "POST" and form.is_valid():
            try:
                rendered = render(
                    recipe.document,
                    form.cleaned_data["sample_input"],
                    form.cleaned_data["sample_context"],
                )
            except RenderTooLarge as exc:
                form.add_error(None, f"Cannot render: {exc}")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Preview {recipe}",
            "recipe": recipe,
            "form": form,
            "rendered": rendered,
            "change_url": _recipe_url(recipe.pk),
            "has_view_permission": True,
        }
        return TemplateResponse(request, self.preview_template, context)


def _recipe_url(pk: int, view: str = "change") -> str:
    return reverse(f"admin:workflows_recipe_{view}", args=[pk])
