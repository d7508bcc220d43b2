"""The form a person starts a run with (CONTRACT section 15): one field per property of a
version's ``input_schema``, named after the property (``name="ticket"``).

=====================================  ==================================================
the property's schema                  the field
=====================================  ==================================================
``"writeOnly": true``                  a password field (never shown again), parsed as its
                                       type below
``enum``                               a choice of its values (JSON for those that are not
                                       strings), and a blank choice: not given
``"type": "string"``                   text (one line when ``maxLength`` is at most 200)
``"type": "integer"`` / ``"number"``   a number
``"type": "boolean"``                  a checkbox: ``true`` or ``false``, always given
anything else (arrays, objects, a     JSON text
list of types, ``$ref``, ``anyOf``)
=====================================  ==================================================

``["T", "null"]`` counts as ``T``. ``title`` is the label, ``description`` the help text,
``default`` the initial value. A field left blank is left out of the input, so the schema's
``required`` names it; a blank checkbox is ``false``. The required properties come first, in
the order ``required`` lists them, then the others by name (a stored document keeps no order
of its keys: Postgres' ``jsonb``).

One JSON field named ``input`` holds the whole input instead when the version has no
``input_schema``, when its schema is not an object with ``properties``, when it has more than
:data:`MAX_FIELDS` of them, or when a property's name is one the page needs itself
(:data:`RESERVED`).

Nothing here decides what input is valid: the form only turns text into JSON values (refusing
what the API's parser refuses: ``workflows.forms.json_from_text``); the schema's word comes
from ``runs.services.run_start``, whose ``FieldError`` paths (``input.ticket``,
``input.tags[0]``) :meth:`StartForm.add_problems` puts beside their fields. Secrets are never
written back into the page: password fields render blank; after a refusal, so does a field
whose text may hold one (a ``writeOnly`` inside its schema, or anywhere outside
``properties``: ``$defs``, ``allOf``); and a run's input prefills no field holding a secret.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

from django import forms

from . import secrets
from .errors import FieldError
from .forms import json_from_text
from .input_schema import mentions_write_only

WHOLE: Final = "input"
# The form's own hidden field: a fresh idempotency key per form shown, so a form sent twice
# (a double click, a reload of the POST) starts one run.
START_KEY: Final = "start_key"
RESERVED: Final = frozenset({"csrfmiddlewaretoken", START_KEY})
# A schema with more properties than this is one JSON field: a page of thousands of fields
# would be unbounded work for no one's use.
MAX_FIELDS: Final = 100
# A string field with a maxLength up to this is one line of text; longer ones a text area.
SHORT_TEXT: Final = 200


class _Omitted:
    """What a blank field gives: the property is left out of the input (``None`` is JSON
    ``null``, a value one may type in a JSON field)."""

    def __repr__(self) -> str:
        return "OMITTED"


OMITTED: Final = _Omitted()


class InputField(forms.Field):
    """What each field below has besides Django's: ``show`` turns a JSON value into what
    its widget shows."""

    # writeOnly: a password field whose text is never sent back, nor named in an error.
    secret = False
    # In the schema's ``required`` (marked beside the label). Not the field's own
    # ``required``: a blank field is left out of the input, and the schema's ``required``
    # (run_start) names it, as the API would.
    schema_required = False
    # Said beside the label: what to type.
    hint = ""

    def show(self, value: Any) -> Any:
        return value


class _InputField(InputField):
    """Mixed into each field below but the checkbox: blank is :data:`OMITTED`; a secret's
    parse error names no part of what was typed."""

    # Only a string field keeps spaces: "  " is a value there, nothing in a number or JSON.
    spaces_are_values = False

    def clean(self, value: Any) -> Any:
        text = value if isinstance(value, str) else ""
        if value is None or not (text if self.spaces_are_values else text.strip()):
            return OMITTED
        if not self.secret:
            return super().clean(value)
        try:
            return super().clean(value)
        except forms.ValidationError:
            raise forms.ValidationError(
                "Enter a valid value (what was typed is not shown: it is a secret).",
                code="invalid",
            ) from None


class TextField(_InputField, forms.CharField):
    spaces_are_values = True


class IntegerField(_InputField, forms.IntegerField):
    pass


class NumberField(_InputField, forms.FloatField):
    """A JSON number: ``3`` stays an integer (a float would turn ``10**20`` into
    ``1e+20``), ``2.5`` is a float; past a float's range it is refused, as the API refuses
    ``1e999``."""

    widget = forms.NumberInput(attrs={"step": "any"})

    def to_python(self, value: Any) -> Any:
        text = str(value).strip()
        if text.lstrip("+-").isascii() and text.lstrip("+-").isdigit():
            try:
                return int(text)
            except ValueError:
                pass  # past Python's 4,300 digits: a float, then out of range below
        return super().to_python(value)

    def validate(self, value: Any) -> None:
        # An integer is a JSON number whatever its size; FloatField's finiteness check would
        # raise OverflowError past a float's range.
        if not isinstance(value, int):
            super().validate(value)


class JsonField(_InputField, forms.CharField):
    widget = forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "class": "json"})
    hint = "JSON"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(strip=False, **kwargs)

    def to_python(self, value: Any) -> Any:
        return json_from_text(str(value))

    def validate(self, value: Any) -> None:
        pass  # any JSON value, null included: the schema decides

    def run_validators(self, value: Any) -> None:
        pass  # CharField's are for text; json_from_text refused what no JSON column stores

    def show(self, value: Any) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False)


class EnumField(_InputField, forms.ChoiceField):
    """One of ``values``, each chosen by its text (a string's own, JSON for the others;
    JSON for all when two would read the same, as ``"1"`` and ``1``)."""

    def __init__(self, values: list[Any], **kwargs: Any) -> None:
        keys = [v if isinstance(v, str) else _json(v) for v in values]
        if len(set(keys)) < len(keys):
            keys = [_json(v) for v in values]
        self.values = dict(zip(keys, values, strict=True))
        super().__init__(choices=[("", "—"), *((k, k) for k in self.values)], **kwargs)

    def clean(self, value: Any) -> Any:
        key = super().clean(value)
        return key if key is OMITTED else self.values[key]

    def show(self, value: Any) -> Any:
        return next((k for k, v in self.values.items() if _same(v, value)), None)


class BooleanField(InputField, forms.BooleanField):
    pass


# The most values an enum is offered as a choice of; a longer one is typed.
MAX_CHOICES = 200


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    # JSON's equality: true is not 1.
    return type(a) is type(b) and a == b


def _type(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        return others[0] if len(others) == 1 else None
    return kind


def _field(schema: Any, *, name: str, required: bool) -> InputField:
    """The field for one property's ``schema``."""
    schema = schema if isinstance(schema, dict) else {}
    secret = schema.get("writeOnly") is True
    kind = _type(schema)
    common: dict[str, Any] = {"required": False, "label": _label(schema, name)}
    if isinstance(schema.get("description"), str):
        common["help_text"] = schema["description"]
    field: InputField
    # A list longer than people choose from is a text field: 100 enums of 1,400 values made a
    # 5 MB page that took 24 s to render (security review).
    enum = schema.get("enum")
    if isinstance(enum, list) and 0 < len(enum) <= MAX_CHOICES and not secret:
        field = EnumField(schema["enum"], **common)
    elif kind == "string":
        long = not (isinstance(schema.get("maxLength"), int) and schema["maxLength"] <= SHORT_TEXT)
        widget = forms.Textarea(attrs={"rows": 3}) if long and not secret else forms.TextInput
        field = TextField(strip=False, widget=widget, **common)
    elif kind == "integer":
        field = IntegerField(**common)
    elif kind == "number":
        field = NumberField(**common)
    elif kind == "boolean" and not secret:
        field = BooleanField(**common)
    else:
        field = JsonField(**common)
    if secret:
        field.widget = forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"})
        field.secret = True
    field.schema_required = required
    return field


def _label(schema: dict[str, Any], name: str) -> str:
    title = schema.get("title")
    return title if isinstance(title, str) and title.strip() else name


def by_property(schema: Any) -> bool:
    """Is the form one field per property of ``schema`` (or one JSON field, ``input``)?"""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return (
        isinstance(properties, dict)
        and 0 < len(properties) <= MAX_FIELDS
        # "" would be a control without a name, which a browser never sends.
        and not (RESERVED | {""}) & properties.keys()
    )


def input_fields(schema: Any) -> dict[str, InputField]:
    """The fields for ``schema`` (a version's ``input_schema``, or None), by input name."""
    if not by_property(schema):
        return {WHOLE: JsonField(required=False, label="Input", help_text="The run's whole input.")}
    properties = schema["properties"]
    listed = schema.get("required")
    required = [
        n for n in dict.fromkeys(listed if isinstance(listed, list) else []) if n in properties
    ]
    names = [*required, *sorted(n for n in properties if n not in required)]
    return {n: _field(properties[n], name=n, required=n in required) for n in names}


class StartForm(forms.Form):
    """The start form of one ``input_schema``. ``input()`` is the run input from the fields
    that parsed; ``add_problems`` puts a start's ``FieldError`` list beside the fields."""

    def __init__(self, schema: Any, data: Any = None, *, input: Any = OMITTED) -> None:
        """``input``: a run's stored input to prefill (Run again), secrets left blank; the
        schema's defaults otherwise."""
        super().__init__(data)
        fields = input_fields(schema)
        self.fields.update(fields)
        self.whole = not by_property(schema)
        for name, field in fields.items():
            if input is not OMITTED:
                self.initial[name] = _prefill(field, input if self.whole else _get(input, name))
                continue
            own = schema if self.whole else schema["properties"][name]
            if isinstance(own, dict) and "default" in own:
                self.initial[name] = field.show(own["default"])
        self.problems: list[FieldError] = []
        # The fields whose text may hold a secret (a writeOnly inside them, or one the schema
        # marks from elsewhere: $defs, allOf...: which field it reaches is not worked out).
        elsewhere = isinstance(schema, dict) and mentions_write_only(
            {k: v for k, v in schema.items() if k != "properties"}
        )
        properties = schema.get("properties") if isinstance(schema, dict) else None
        self.may_hold_secrets = {
            name
            for name, field in fields.items()
            if not field.secret
            and (
                elsewhere
                or mentions_write_only(
                    properties.get(name) if properties and not self.whole else schema
                )
            )
        }

    def input(self) -> Any:
        """The run input the parsed fields make: the whole field's value, or an object of
        the fields given (a blank one left out)."""
        data = getattr(self, "cleaned_data", {})
        if self.whole:
            value = data.get(WHOLE, OMITTED)
            return None if value is OMITTED else value
        return {n: v for n, v in data.items() if n in self.fields and v is not OMITTED}

    def refused(self, problems: Iterable[FieldError]) -> None:
        """The form as a refused start shows it again: :meth:`add_problems`, and the fields
        that may hold a secret blank (what was typed in them is not sent back)."""
        self.add_problems(problems)
        if self.may_hold_secrets:
            # Only shown from here: the cleaning is done.
            self.data = {**self.data, **dict.fromkeys(self.may_hold_secrets, "")}
            for name in self.may_hold_secrets:
                # The bound field (made by the cleaning) keeps its own copy of the help.
                bound = self[name]
                bound.help_text = f"{bound.help_text} It holds a secret: type it again.".strip()

    def add_problems(self, problems: Iterable[FieldError]) -> None:
        """Each problem beside its field (``input.ticket``, ``input.tags[0]``: the part
        below the field is named in the message); the others (the whole input, a step's
        pre-flight) in ``problems``, listed above the form. A field that already has an
        error of its own (it did not parse) keeps only that one."""
        names = sorted(self.fields, key=len, reverse=True)
        for problem in problems:
            name, rest = _owner(problem.field, names, whole=self.whole)
            if name is None:
                self.problems.append(problem)
            elif name not in self.errors:
                message = f"{rest}: {problem.message}" if rest else problem.message
                self.add_error(name, forms.ValidationError(message, code="refused"))


def _owner(path: str | None, names: list[str], *, whole: bool) -> tuple[str | None, str]:
    """The field a problem's path falls in, and the rest of the path below it."""
    if path is None or not (path == "input" or path.startswith(("input.", "input["))):
        return None, ""
    if whole:
        return WHOLE, path[len("input") :].lstrip(".")
    below = path[len("input.") :]
    for name in names:  # longest first: a name may hold dots ("a.b" before "a")
        if below == name:
            return name, ""
        if below.startswith((f"{name}.", f"{name}[")):
            return name, below[len(name) :].lstrip(".")
    return None, ""


def _get(value: Any, name: str) -> Any:
    return value.get(name, OMITTED) if isinstance(value, dict) else OMITTED


def _prefill(field: InputField, value: Any) -> Any:
    """What a field shows of a run's stored input: nothing for a secret, nor for a value
    holding one (a token shown as •••• and sent back would be the text •••• itself)."""
    if value is OMITTED or field.secret or secrets.shown(value) is not value:
        return None
    if isinstance(field, BooleanField):
        return value is True
    return field.show(value)


__all__ = [
    "OMITTED",
    "START_KEY",
    "WHOLE",
    "InputField",
    "StartForm",
    "by_property",
    "input_fields",
]
