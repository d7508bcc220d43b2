"""Admin forms for authoring workflow documents.

The forms only turn the editor's text into JSON; every rule about documents lives in
``workflows.validation`` and is applied by ``workflows.services.definition_save``. The errors
that service raises are attached to the form so the page re-shows the user's own text with
each ``{field, message}`` listed above the editor.
"""

from __future__ import annotations

import json
import re
import sys
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
from .json_limits import MAX_JSON_DEPTH, NotANumber, json_depth, loads_numbers_only, text_problems


def json_from_text(text: str) -> Any:
    """The JSON value of a form field's text, or a ``ValidationError`` for the field: text that
    does not parse, and JSON that parses but that nothing after the form could handle
    (``workflows.json_limits``, the API's own limits: nested past ``MAX_JSON_DEPTH``, a number
    of too many digits, ``\\u0000`` or a lone surrogate anywhere). Those would otherwise be a
    ``RecursionError`` in the service or a page that cannot be encoded: a 500 for staff input.
    """
    try:
        value = loads_numbers_only(text)
    except RecursionError:
        raise _too_deep() from None
    except NotANumber as exc:
        raise forms.ValidationError(
            "Malformed JSON: %(msg)s.", code="malformed_json", params={"msg": str(exc)}
        ) from None
    except json.JSONDecodeError as exc:
        raise forms.ValidationError(
            "Malformed JSON: %(msg)s at line %(line)d, column %(col)d.",
            code="malformed_json",
            params={"msg": exc.msg, "line": exc.lineno, "col": exc.colno},
        ) from exc
    except ValueError:
        # Python refuses integers of more than 4,300 digits (CVE-2020-10735).
        raise forms.ValidationError(
            "Malformed JSON: a number has more than %(digits)d digits.",
            code="malformed_json",
            params={"digits": sys.get_int_max_str_digits()},
        ) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise _too_deep()
    problems = text_problems(value, top="the value")
    if problems:
        raise forms.ValidationError(
            [
                forms.ValidationError(
                    "%(where)s: %(message)s",
                    code="unstorable_text",
                    params={"where": p.field, "message": p.message},
                )
                for p in problems
            ]
        )
    return value


# A message that quotes the last name of its own field (workflows.validation's).
_NAMED = re.compile(r"\b(?:unknown|required) field '([^']+)'")


def listed_at(error: FieldError) -> str:
    """Where an admin page lists ``error``: its field, less the last name when the message
    quotes that name already. "steps[0].colour unknown field 'colour'" and "steps[0].approvers
    required field 'approvers' is missing" said the name twice (issue 37); at ``steps[0]``
    each says it once. The API's ``{field, message}`` stay as they are."""
    field = error.field or ""
    named = _NAMED.search(error.message)
    if named is None:
        return field
    if field == named.group(1):
        return ""
    return field.removesuffix(f".{named.group(1)}")


def _too_deep() -> forms.ValidationError:
    return forms.ValidationError(
        "The JSON is nested more than %(depth)d levels deep.",
        code="too_deep",
        params={"depth": MAX_JSON_DEPTH},
    )


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
        document = json_from_text(self.cleaned_data["document"])
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

    @property
    def listed_errors(self) -> list[tuple[str, str]]:
        """The rejected save's errors as the page lists them: (where, message)."""
        return [(listed_at(error), error.message) for error in self.document_errors]

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


# --- recipes ---------------------------------------------------------------------------------


class RecipeForm(forms.Form):
    """A recipe's fields, one form field each; :meth:`document` is what the service saves.

    Only the shapes a browser cannot send are checked here (the output schema's JSON, numbers):
    every rule about recipes is ``workflows.recipes.prepare_recipe``'s, whose field-named
    errors :meth:`add_recipe_errors` puts on the form field they name.
    """

    name = forms.CharField(max_length=100, help_text="Lower case letters, digits and _.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    system = forms.CharField(
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 4, "class": "djflow-document-text"}),
        help_text="Optional system prompt; templates as in the prompt.",
    )
    prompt = forms.CharField(
        strip=False,
        widget=forms.Textarea(attrs={"rows": 10, "class": "djflow-document-text"}),
        help_text="${input} is the step input (${input.x} a field of it), ${context} the "
        "retrieved passages; $${ is a literal ${.",
    )
    model = forms.CharField(
        required=False,
        max_length=200,
        help_text="'<provider>:<model>', e.g. openai:gpt-4o-mini; empty: DJFLOW_DEFAULT_MODEL.",
    )
    output = forms.ChoiceField(choices=[("text", "text"), ("json", "json")], initial="text")
    output_schema = forms.CharField(
        required=False,
        strip=False,
        widget=DocumentEditorWidget(height="30vh"),
        help_text='With output "json": the JSON Schema the reply must satisfy (local $refs only).',
    )
    temperature = forms.FloatField(required=False, help_text="0 to 2; empty: the model's default.")
    max_tokens = forms.IntegerField(required=False, help_text="1 to 200000; empty: 1024.")

    def __init__(self, *args: Any, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if name is not None:
            # A page about one recipe saves versions of that recipe only.
            self.fields["name"].disabled = True
            self.fields["name"].initial = name

    @staticmethod
    def initial_from(document: dict[str, Any]) -> dict[str, Any]:
        initial = {k: v for k, v in document.items() if k not in ("version", "output_schema")}
        if "output_schema" in document:
            initial["output_schema"] = json.dumps(
                document["output_schema"], indent=2, ensure_ascii=False
            )
        return initial

    def clean_output_schema(self) -> Any:
        text = self.cleaned_data["output_schema"]
        if not text.strip():
            return None
        return json_from_text(text)

    def document(self) -> dict[str, Any]:
        """The recipe document of the cleaned fields; empty optional ones left out."""
        data = self.cleaned_data
        document: dict[str, Any] = {"name": data["name"]}
        for key in ("description", "system", "prompt", "model"):
            if data.get(key):
                document[key] = data[key]
        document["output"] = data["output"]
        for key in ("output_schema", "temperature", "max_tokens"):
            if data.get(key) is not None:
                document[key] = data[key]
        return document

    def add_recipe_errors(self, errors: Iterable[FieldError]) -> None:
        """Each error on the form field it names (``output_schema.type`` on output_schema),
        the rest (``version``, the body) above the form."""
        for error in errors:
            field = error.field or ""
            root = field.split(".", 1)[0].split("[", 1)[0]
            if root in self.fields:
                inner = field[len(root) :].lstrip(".")
                self.add_error(root, f"{inner}: {error.message}" if inner else error.message)
            else:
                self.add_error(None, f"{field}: {error.message}" if field else error.message)


class RecipePreviewForm(forms.Form):
    """A sample step input (JSON) and context (text) to render a recipe with."""

    sample_input = forms.CharField(
        label="Sample input",
        strip=False,
        initial="{}",
        widget=forms.Textarea(attrs={"rows": 8, "class": "djflow-document-text"}),
        help_text="The step input as JSON: what ${input} reads.",
    )
    sample_context = forms.CharField(
        label="Sample context",
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 5, "class": "djflow-document-text"}),
        help_text="Retrieved passages as text: what ${context} reads.",
    )

    def clean_sample_input(self) -> Any:
        text = self.cleaned_data["sample_input"]
        return json_from_text(text)
