"""Admin for knowledge bases (CONTRACT section 10): browse them, search their documents (the
search box is ``workflows.kb_search``, ranked), add a document, and edit one, which saves a
new version through ``workflows.knowledge.kb_write``: no stored row is ever edited.

Who may (``workflows.access``, "knowledge bases", as the API): a staff user sees the knowledge
bases they may read and nothing else, not even their names in a filter; adding or editing a
document needs write on its knowledge base; adding a knowledge base
``workflows.add_knowledgebase`` (its creator then reads and writes it). Nothing deletes.
Imported by ``workflows.admin``.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from . import access, kb_search, knowledge, selectors
from .errors import EngineError
from .models import KnowledgeBase, KnowledgeDocument

# Search results the admin's search box shows at most (ranked; the best first).
SEARCH_LIMIT = kb_search.MAX_TOP_K


def _staff(request: HttpRequest) -> bool:
    return bool(request.user.is_active and request.user.is_staff)


@admin.register(KnowledgeBase)
class KnowledgeBaseAdmin(admin.ModelAdmin):
    list_display = ("name", "documents", "created_at", "created_by")
    search_fields = ("name",)
    fields = ("name",)

    def has_module_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return _staff(request) and (access.reads_some_kb(user) or access.may_add_kb(user))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if not _staff(request):
            return False
        if obj is None:
            return access.reads_some_kb(request.user) or access.may_add_kb(request.user)
        return access.may_read_kb(request.user, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return _staff(request) and access.may_add_kb(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a name never changes; its documents are edited on their own pages

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[KnowledgeBase]:
        return access.readable_kbs(request.user, selectors.kb_list())

    @admin.display(description="documents")
    def documents(self, kb: KnowledgeBase) -> int:
        return int(getattr(kb, "document_count", 0))

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        created = knowledge.kb_get_or_create(name=obj.name, user=request.user)
        obj.pk, obj.created_at, obj.created_by = created.pk, created.created_at, created.created_by


class _KnowledgeBaseFilter(admin.SimpleListFilter):
    title = "knowledge base"
    parameter_name = "kb"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        kbs = access.readable_kbs(request.user, KnowledgeBase.objects.all())
        return [(str(kb.pk), kb.name) for kb in kbs[:200]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value and value.isascii() and value.isdigit():
            return queryset.filter(kb_id=int(value))
        return queryset


class _VersionsFilter(admin.SimpleListFilter):
    """The current version of each document unless every version is asked for."""

    title = "versions"
    parameter_name = "versions"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("all", "every version")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset if self.value() == "all" else queryset.filter(current=True)


class KnowledgeDocumentForm(forms.ModelForm):
    class Meta:
        model = KnowledgeDocument
        fields = ("kb", "key", "title", "content")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        key = data.get("key", getattr(self.instance, "key", None))
        problems = knowledge.document_problems(
            key=key, title=data.get("title", ""), content=data.get("content", "")
        )
        for problem in problems:
            field = problem.field if problem.field in self.fields else None
            self.add_error(field, problem.message)
        return data

    def validate_unique(self) -> None:
        # A save is a new version (kb_write numbers it): no stored row's uniqueness applies.
        return None


@admin.register(KnowledgeDocument)
class KnowledgeDocumentAdmin(admin.ModelAdmin):
    form = KnowledgeDocumentForm
    list_display = ("key", "version", "title", "kb", "current", "created_at", "written_by")
    list_filter = (_KnowledgeBaseFilter, _VersionsFilter)
    list_select_related = ("kb", "created_by")
    # The box searches titles and contents, ranked (kb_search); it needs a field named here
    # to be shown at all.
    search_fields = ("key",)
    search_help_text = (
        'Full-text search of titles and contents: every word must occur; "a phrase", or, -word.'
    )
    readonly_fields = ("version", "current", "created_at", "written_by")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return _staff(request) and access.reads_some_kb(request.user)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if not _staff(request):
            return False
        if obj is None:
            return access.reads_some_kb(request.user)
        return access.may_read_kb(request.user, obj.kb)

    def has_add_permission(self, request: HttpRequest) -> bool:
        writable = access.writable_kbs(request.user, KnowledgeBase.objects.all())
        return _staff(request) and writable.exists()

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # "Change" saves a new version of the document (kb_write); the row shown stays.
        if obj is None:
            return self.has_add_permission(request)
        return _staff(request) and access.may_write_kb(request.user, obj.kb)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[KnowledgeDocument]:
        readable = access.readable_kbs(request.user, KnowledgeBase.objects.all())
        return KnowledgeDocument.objects.filter(kb__in=readable)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None:
            return ("kb", "key", *self.readonly_fields)
        return self.readonly_fields

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        if "kb" in form.base_fields:
            form.base_fields["kb"].queryset = access.writable_kbs(
                request.user, KnowledgeBase.objects.all()
            )
        return form

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        if not search_term.strip():
            return queryset, False
        kb_ids = list(queryset.values_list("kb_id", flat=True).distinct()[:1000])
        hits = kb_search.search_many(kb_ids, search_term, SEARCH_LIMIT)
        order = Case(
            *[When(pk=hit.id, then=Value(rank)) for rank, hit in enumerate(hits)],
            default=Value(0),
            output_field=IntegerField(),
        )
        found = queryset.filter(pk__in=[hit.id for hit in hits])
        # Ranked, best first (the changelist orders before it searches: this order stays).
        return found.annotate(search_rank=order).order_by("search_rank", "-pk"), False

    ordering = ("-created_at", "-id")

    def response_change(self, request: HttpRequest, obj: Any) -> HttpResponse:
        response = super().response_change(request, obj)
        if "_continue" in request.POST:
            # On to the version written, not back to the page of the one it replaced.
            response["Location"] = reverse(
                "admin:workflows_knowledgedocument_change", args=[obj.pk]
            )
        return response

    @admin.display(description="written by")
    def written_by(self, document: KnowledgeDocument) -> str:
        if document.run_id is not None:
            return f"run {document.run_id}"
        return document.created_by.get_username() if document.created_by else "—"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        kb = form.instance.kb if change else form.cleaned_data["kb"]
        if not access.may_write_kb(request.user, kb):
            raise PermissionDenied
        try:
            written = knowledge.kb_write(
                kb=kb.name,
                key=obj.key,
                title=form.cleaned_data.get("title", ""),
                content=form.cleaned_data["content"],
                create=False,
                user=request.user,
            )
        except EngineError:  # the form checked the fields; the knowledge base may be gone
            raise PermissionDenied from None
        # The page goes on to the version written (or the unchanged one that holds the text).
        document = written.document
        obj.pk, obj.version, obj.current = document.pk, document.version, document.current
        obj.created_at, obj.created_by = document.created_at, document.created_by
