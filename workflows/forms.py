"""Admin forms for authoring workflow documents.

The forms only turn the editor's text into JSON; every rule about documents lives in
``workflows.validation`` and is applied by ``workflows.services.definition_save``. The errors
that service raises are attached to the form so the page re-shows the user's own text with
each ``{field, message}`` listed above the editor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.template.loader import render_to_string
from django.utils.safestring import SafeString
from django_json_widget.widgets import JSONEditorWidget

from .access import ROLES
from .errors import FieldError


class DocumentEditorWidget(JSONEditorWidget):
    """django-json-widget's editor that keeps the user's text exactly as typed.

    The stock widget parses its value on render (a malformed submission would crash the page)
    and copies the editor into the form only while the content parses (a malformed edit would
    be silently replaced by the last valid one). This one holds the raw text in a real
    ``<textarea>``: it is prefilled server-side, shown as-is when JavaScript is off, and kept
    in step with the editor on every change and on submit, valid JSON or not. The editor
    instance is ``window["<id>_editor"]`` and ``<container>.jsonEditor``, as upstream.
    """

    template_name = "admin/workflows/widgets/document_editor.html"

    class Media:
        # Starts the editor (after upstream's jsoneditor.min.js, which Media inheritance puts
        # first): a file, so the admin needs no inline script under the Content-Security-Policy.
        js = ("workflows/document_editor.js",)

    def __init__(self, attrs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("height", "60vh")
        kwargs.setdefault("width", "100%")
        super().__init__(attrs=attrs, **kwargs)

    def format_value(self, value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, dict | list):
            return json.dumps(value, indent=2, ensure_ascii=False)
        return str(value)

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        # The template lives with the project's admin templates (TEMPLATES["DIRS"]), which
        # the default form renderer does not search; render it with the template engine.
        context = self.get_context(name, value, attrs)
        return SafeString(render_to_string(self.template_name, context))


class DocumentForm(forms.Form):
    """One field: the workflow document as JSON text.

    ``cleaned_data["document"]`` is the parsed JSON (any JSON value; the service decides
    whether it is a valid document). ``document_errors`` holds the ``FieldError`` list of the
    last rejected save, for the page to list.
    """

    document = forms.CharField(
        label="Document",
        strip=False,
        widget=DocumentEditorWidget(),
        error_messages={"required": "Enter the workflow document as JSON."},
    )

    def __init__(self, *args: Any, workflow_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workflow_id = workflow_id
        self.document_errors: list[FieldError] = []

    def clean_document(self) -> Any:
        text = self.cleaned_data["document"]
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                "Malformed JSON: %(msg)s at line %(line)d, column %(col)d.",
                code="malformed_json",
                params={"msg": exc.msg, "line": exc.lineno, "col": exc.colno},
            ) from exc
        if (
            self.workflow_id is not None
            and isinstance(document, dict)
            and document.get("id") != self.workflow_id
        ):
            # A page about one workflow never writes to another: a changed id here is far
            # more likely a slip than a wish to copy, and "Add workflow" does copies.
            self.document_errors = [
                FieldError(
                    "id",
                    f"this page saves versions of '{self.workflow_id}'; set \"id\" to "
                    f'"{self.workflow_id}", or use Add workflow to save a new workflow',
                )
            ]
            raise forms.ValidationError("The document is for another workflow.", code="wrong_id")
        return document

    def add_document_errors(self, errors: Iterable[FieldError]) -> None:
        """Record a rejected save: keep the text, list each error above the editor."""
        self.document_errors = list(errors)
        self.add_error(
            None,
            forms.ValidationError(
                "The document was not saved. Correct the problems listed below.",
                code="rejected",
            ),
        )


class RoleForm(forms.Form):
    """Grant (or revoke) a role on a workflow to one user or one group, by name."""

    role = forms.ChoiceField(choices=[(role, role) for role in ROLES])
    kind = forms.ChoiceField(choices=[("user", "user"), ("group", "group")], initial="user")
    name = forms.CharField(max_length=150, help_text="the username, or the group's name")
    revoke = forms.BooleanField(required=False, help_text="revoke instead of grant")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        kind, name = cleaned.get("kind"), cleaned.get("name")
        if kind == "user" and name:
            user = (
                get_user_model().objects.filter(**{get_user_model().USERNAME_FIELD: name}).first()
            )
            if user is None:
                self.add_error("name", f"no user '{name}'")
            else:
                cleaned["holder"] = {"user": user}
        elif kind == "group" and name:
            group = Group.objects.filter(name=name).first()
            if group is None:
                self.add_error("name", f"no group '{name}'")
            else:
                cleaned["holder"] = {"group": group}
        return cleaned
