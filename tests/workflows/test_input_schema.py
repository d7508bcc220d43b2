"""input_schema at run time: RE2 patterns and local references only (contract section 9)."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from referencing.exceptions import Unresolvable

from workflows.input_schema import input_validator, remote_refs

REDOS = "^(a+)+$"


def _messages(schema: dict, value: object) -> list[str]:
    return [error.message for error in input_validator(schema).iter_errors(value)]


def test_a_redos_pattern_answers_at_once() -> None:
    # Python's re takes 0.4 s for 24 "a" here and doubles with each one more: hours for 40.
    schema = {"type": "string", "pattern": REDOS}
    started = time.monotonic()
    assert len(_messages(schema, "a" * 40 + "!")) == 1
    assert time.monotonic() - started < 1.0
    assert _messages(schema, "a" * 40) == []


def test_pattern_properties_and_additional_properties_run_on_re2() -> None:
    schema = {
        "type": "object",
        "patternProperties": {REDOS: {"type": "integer"}},
        "additionalProperties": False,
    }
    started = time.monotonic()
    assert _messages(schema, {"a" * 40: 1}) == []
    assert _messages(schema, {"a" * 40: "x"}) == ["'x' is not of type 'integer'"]
    assert len(_messages(schema, {"a" * 40 + "!": 1})) == 1
    assert time.monotonic() - started < 1.0
    closed = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "null"}}
    assert _messages(closed, {"a": 1, "b": None}) == []
    assert len(_messages(closed, {"b": 1})) == 1


def test_local_refs_resolve() -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/n"}}}
    assert _messages(schema, {"x": 1}) == []
    assert len(_messages(schema, {"x": "1"})) == 1


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/x.json", "https://example.com/s.json"])
def test_a_remote_ref_is_never_fetched(ref: str) -> None:
    schema = {"properties": {"x": {"$ref": ref}}}
    with mock.patch("urllib.request.urlopen") as urlopen, pytest.raises(Unresolvable):
        _messages(schema, {"x": 1})
    urlopen.assert_not_called()


def test_remote_refs_finds_every_non_local_ref() -> None:
    schema = {
        "$ref": "#/$defs/a",
        "$defs": {"a": {"allOf": [{"$ref": "b.json"}, {"$dynamicRef": "http://x/y"}]}},
        "properties": {"$ref": {"const": {"$ref": "data.json"}}, "y": {"$ref": 5}},
    }
    found = sorted((".".join(map(str, path)), ref) for path, ref in remote_refs(schema, []))
    assert found == [
        ("$defs.a.allOf.0.$ref", "b.json"),
        ("$defs.a.allOf.1.$dynamicRef", "http://x/y"),
        ("properties.y.$ref", 5),
    ]


def test_unevaluated_properties_match_pattern_properties_on_re2() -> None:
    # jsonschema's own unevaluatedProperties matched patternProperties with Python's re:
    # 26 "a" and a "!" took seconds there (doubling with each "a"), and \z, which RE2 has and
    # re has not, raised inside validation.
    schema = {
        "type": "object",
        "patternProperties": {REDOS: {"type": "integer"}, r"^id_[0-9]+\z": {}},
        "unevaluatedProperties": False,
    }
    started = time.monotonic()
    assert _messages(schema, {"a" * 26 + "!": 1}) == [
        f"Unevaluated properties are not allowed ({'a' * 26 + '!'!r} was unexpected)"
    ]
    assert time.monotonic() - started < 1.0
    assert _messages(schema, {"a" * 26: 1, "id_7": "x"}) == []
    assert len(_messages(schema, {"id_7x": 1})) == 1


def test_unevaluated_properties_still_see_every_evaluating_keyword() -> None:
    schema = {
        "type": "object",
        "$defs": {"named": {"properties": {"name": {}}}},
        "allOf": [{"$ref": "#/$defs/named"}],
        "if": {"required": ["kind"]},
        "then": {"properties": {"kind": {}}},
        "dependentSchemas": {"kind": {"properties": {"extra": {}}}},
        "unevaluatedProperties": {"type": "integer"},
    }
    assert _messages(schema, {"name": "a", "kind": "b", "extra": "c", "n": 1}) == []
    assert _messages(schema, {"name": "a", "other": "x"}) == [
        "Unevaluated properties are not valid under the given schema ('other' was unevaluated "
        "and invalid)"
    ]
