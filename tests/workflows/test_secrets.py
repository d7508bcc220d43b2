"""Secrets in pure Python: finding writeOnly fields, sealing, revealing, concealing, masking,
and the scrub of logs (``workflows.secrets``, ``workflows.input_schema``)."""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote, quote_plus

import pytest

from workflows import secrets
from workflows.input_schema import write_only_values
from workflows.secrets import MASK, TOKEN, conceal, reveal, seal, shown
from workflows.templates import resolve

KEY = "sk-live-4f9a8b7c6d5e"


# --- where the secrets are --------------------------------------------------------------------


def test_nested_properties_items_refs_and_additional_properties_are_found() -> None:
    schema = {
        "type": "object",
        "$defs": {"pin": {"type": "integer", "writeOnly": True}},
        "properties": {
            "creds": {"properties": {"api_key": {"type": "string", "writeOnly": True}}},
            "pin": {"$ref": "#/$defs/pin"},
            "tokens": {"type": "array", "items": {"writeOnly": True}},
            "headers": {"additionalProperties": {"writeOnly": True}},
            "public": {"type": "string"},
        },
    }
    value = {
        "creds": {"api_key": KEY},
        "pin": 4321,
        "tokens": ["a", "b"],
        "headers": {"X-Auth": "h1"},
        "public": "hello",
    }
    found = sorted(write_only_values(schema, value), key=lambda item: item[0])
    assert found == [
        (["creds", "api_key"], KEY),
        (["headers", "X-Auth"], "h1"),
        (["pin"], 4321),
        (["tokens", 0], "a"),
        (["tokens", 1], "b"),
    ]


def test_every_branch_of_any_of_the_input_satisfies_is_searched() -> None:
    schema = {
        "properties": {
            "key": {
                "anyOf": [{"type": "integer"}, {"type": "string", "writeOnly": True}],
            },
            "other": {"if": {"type": "string"}, "then": {"writeOnly": True}},
        }
    }
    found = write_only_values(schema, {"key": KEY, "other": "x"})
    assert sorted(path for path, _ in found) == [["key"], ["other"]]
    # A branch the value does not satisfy marks nothing.
    assert write_only_values(schema, {"key": 3, "other": 3}) == []


def test_a_schema_without_write_only_finds_nothing() -> None:
    assert write_only_values({"type": "object"}, {"key": KEY}) == []
    assert write_only_values({"properties": {"k": {"writeOnly": False}}}, {"k": KEY}) == []


# --- sealing and revealing --------------------------------------------------------------------


SCHEMA = {
    "properties": {
        "creds": {"properties": {"api_key": {"writeOnly": True}}},
        "pins": {"writeOnly": True},
        "nothing": {"writeOnly": True},
    }
}


def _sealed(value: dict) -> tuple[dict, dict]:
    return seal(value, write_only_values(SCHEMA, value), {})


def test_sealing_replaces_each_secret_scalar_by_a_token_and_keeps_the_shape() -> None:
    value = {"creds": {"api_key": KEY, "user": "ann"}, "pins": [1234, 1234], "nothing": None}
    sealed, registry = _sealed(value)
    token = sealed["creds"]["api_key"]
    assert TOKEN.fullmatch(token) and registry[token] == KEY
    assert sealed["creds"]["user"] == "ann"
    # An array stays an array (foreach walks it); one token per distinct value.
    assert len(sealed["pins"]) == 2 and sealed["pins"][0] == sealed["pins"][1]
    assert registry[sealed["pins"][0]] == 1234
    assert sealed["nothing"] is None
    assert value["creds"]["api_key"] == KEY  # the caller's value is not changed
    assert KEY not in repr(sealed)


def test_tokens_are_random_per_run() -> None:
    first, _ = _sealed({"creds": {"api_key": KEY}})
    second, _ = _sealed({"creds": {"api_key": KEY}})
    assert first["creds"]["api_key"] != second["creds"]["api_key"]


def test_revealing_a_resolved_template_gives_the_handler_the_values() -> None:
    sealed, registry = _sealed({"creds": {"api_key": KEY}, "pins": [1234]})
    template = {
        "auth": "Bearer ${input.creds.api_key}",
        "key": "${input.creds.api_key}",
        "pin": "${input.pins.0}",
        "pins": "${input.pins}",
        "text": "pin ${input.pins.0}",
    }
    stored = resolve(template, {"input": sealed})
    assert KEY not in repr(stored)
    assert reveal(stored, registry) == {
        "auth": f"Bearer {KEY}",
        "key": KEY,
        "pin": 1234,  # a whole token keeps the value's JSON type
        "pins": [1234],
        "text": "pin 1234",
    }


def test_an_unknown_token_is_left_as_it_is() -> None:
    forged = "[secret:0123456789abcdef0123]"
    _, registry = _sealed({"creds": {"api_key": KEY}})
    assert reveal({"x": forged, "y": f"a {forged}"}, registry) == {"x": forged, "y": f"a {forged}"}


def test_a_child_keeps_its_parents_tokens_and_seals_its_own() -> None:
    parent, inherited = _sealed({"creds": {"api_key": KEY}})
    token = parent["creds"]["api_key"]
    child_input = {"key": token, "bearer": f"Bearer {token}", "own": "pw-123456"}
    schema = {"properties": {"key": {"writeOnly": True}, "bearer": {}, "own": {"writeOnly": True}}}
    sealed, registry = seal(child_input, write_only_values(schema, child_input), inherited)
    assert sealed["key"] == token and sealed["bearer"] == f"Bearer {token}"
    assert registry[sealed["own"]] == "pw-123456" and registry[token] == KEY


# --- what handlers answer ---------------------------------------------------------------------


def test_an_echoed_secret_is_concealed_losslessly() -> None:
    _, registry = _sealed({"creds": {"api_key": KEY}, "pins": [123456]})
    answer = {
        "echo": f"used {KEY} twice: {KEY}",
        KEY: "as a key",
        "whole": KEY,
        "pin": "pin=123456",
        "pins": [123456, 12, True],
        "error": {"message": f"refused {KEY}", "traceback": f'raise X("{KEY}")'},
    }
    stored = conceal(answer, registry)
    assert KEY not in repr(stored) and "123456" not in repr(stored)
    assert stored["pins"][1:] == [12, True]  # not secrets: numbers the guards may compare
    assert reveal(stored, registry) == answer


@pytest.mark.parametrize(
    "encode",
    [
        lambda v: json.dumps({"key": v}, separators=(",", ":")),
        lambda v: json.dumps({"key": v}, ensure_ascii=False),
        lambda v: "https://api.example/keys/" + quote(v, safe=""),
        lambda v: "q=" + quote_plus(v),
    ],
    ids=["json", "json-unicode", "url-path", "url-query"],
)
def test_a_secret_is_concealed_where_it_reads_escaped(encode: Any) -> None:
    """A prompt that rendered an object holding a PEM key shows it JSON-escaped (its line
    breaks and quotes escaped); a URL shows it percent-encoded: both are concealed."""
    pem = '-----BEGIN KEY-----\nAbC+d/"é"\n-----END KEY-----'
    _, registry = _sealed({"creds": {"api_key": pem}})
    stored = conceal(encode(pem), registry)
    assert "AbC" not in stored and "BEGIN" not in stored, stored
    assert TOKEN.search(stored)


def test_a_short_number_secret_is_not_concealed_where_numbers_equal_it() -> None:
    _, registry = seal({"n": 7}, [(["n"], 7)], {})
    assert conceal({"count": 7, "text": "7 items"}, registry) == {"count": 7, "text": "7 items"}


def test_a_short_secret_is_concealed_only_where_a_whole_string_is_it() -> None:
    _, registry = seal({"k": "abc"}, [(["k"], "abc")], {})
    stored = conceal({"a": "abc", "b": "abcdef"}, registry)
    assert TOKEN.fullmatch(stored["a"]) and stored["b"] == "abcdef"


def test_a_secret_containing_another_is_concealed_whole() -> None:
    _, registry = seal({"a": "hunter", "b": "hunter2-long"}, [(["a"], 0), (["b"], 0)], {})
    stored = conceal("x hunter2-long y", registry)
    assert TOKEN.fullmatch(stored[2:-2]) and registry[stored[2:-2]] == "hunter2-long"
    assert reveal(stored, registry) == "x hunter2-long y"


# --- what people see --------------------------------------------------------------------------


def test_shown_masks_every_token_in_values_and_keys() -> None:
    sealed, _ = _sealed({"creds": {"api_key": KEY}})
    token = sealed["creds"]["api_key"]
    assert shown({"a": token, token: [f"Bearer {token}"], "n": 3}) == {
        "a": MASK,
        MASK: [f"Bearer {MASK}"],
        "n": 3,
    }


def test_masker_hides_a_value_and_its_repr_in_messages() -> None:
    hide = secrets.masker(["it's-secret", 98765, "two\nlines"])
    assert hide("\"it's-secret\" does not match '^sk-'") == f"{MASK} does not match '^sk-'"
    assert hide("'two\\nlines' is too long") == f"{MASK} is too long"
    assert hide("98765 is not of type 'string'") == f"{MASK} is not of type 'string'"


# --- logs and error reports -------------------------------------------------------------------


def test_scrub_masks_what_the_context_holds_and_tokens() -> None:
    token = "[secret:0123456789abcdef0123]"
    event = {"exception": {"values": [{"value": f"refused {KEY}"}]}, "vars": [token, "x"]}
    assert KEY in repr(secrets.scrub(event))  # not held: nothing to mask but tokens
    with secrets.exposing([KEY]):
        scrubbed = secrets.scrub(event)
    assert scrubbed == {
        "exception": {"values": [{"value": f"refused {MASK}"}]},
        "vars": [MASK, "x"],
    }
    assert secrets.exposed() == frozenset()


def test_log_records_are_masked_where_they_are_made(caplog: pytest.LogCaptureFixture) -> None:
    secrets.install_log_scrubber()
    log = logging.getLogger("tests.secrets")
    with caplog.at_level(logging.INFO), secrets.exposing([KEY]):
        log.info("calling with %s", KEY)
        log.info("stored as %s", "[secret:0123456789abcdef0123]")
        try:
            raise RuntimeError(f"refused {KEY}")
        except RuntimeError:
            log.exception("it failed")
    assert KEY not in caplog.text
    assert f"calling with {MASK}" in caplog.text and f"stored as {MASK}" in caplog.text
    assert f"RuntimeError: refused {MASK}" in caplog.text
    # Outside the block the value is not held (and an ordinary record is left alone).
    caplog.clear()
    with caplog.at_level(logging.INFO):
        log.info("an %s line", "ordinary")
    assert caplog.records[0].args == ("ordinary",)
