"""document_diff: a unified diff of the canonical text of two documents. No database."""

from __future__ import annotations

import copy

from workflows.diff import diff_line_kind, document_diff, document_text, reading_order

BASE = {
    "id": "support_ticket",
    "version": 1,
    "description": "Classify and answer.",
    "steps": [
        {"id": "classify", "kind": "task"},
        {"id": "send", "kind": "task", "input": {"text": "${steps.classify.output}"}},
    ],
}


def changed(version: int = 2, **top: object) -> dict:
    doc = copy.deepcopy(BASE)
    doc.update(top)
    doc["version"] = version
    return doc


def test_equal_documents_give_no_diff():
    assert document_diff(BASE, copy.deepcopy(BASE)) == []


def test_version_key_is_ignored():
    assert document_diff(BASE, changed(version=7)) == []
    assert document_diff(BASE, {k: v for k, v in BASE.items() if k != "version"}) == []


def test_key_order_is_ignored():
    reordered = dict(reversed(list(BASE.items())))
    reordered["steps"] = [dict(reversed(list(s.items()))) for s in BASE["steps"]]
    assert document_diff(BASE, reordered) == []


def test_changed_value_is_one_removed_and_one_added_line():
    lines = document_diff(BASE, changed(description="Classify, then answer."))
    removed = [line for line in lines if diff_line_kind(line) == "removed"]
    added = [line for line in lines if diff_line_kind(line) == "added"]
    assert removed == ['-  "description": "Classify and answer.",']
    assert added == ['+  "description": "Classify, then answer.",']


def test_header_and_hunk_come_first():
    lines = document_diff(BASE, changed(description="x"), fromfile="v1", tofile="v2")
    assert lines[0] == "--- v1"
    assert lines[1] == "+++ v2"
    assert lines[2].startswith("@@ ")
    assert [diff_line_kind(line) for line in lines[:3]] == ["header", "header", "hunk"]


def test_default_labels():
    lines = document_diff(BASE, changed(description="x"))
    assert lines[:2] == ["--- old", "+++ new"]


def test_lines_have_no_line_endings():
    lines = document_diff(BASE, changed(description="x"))
    assert all("\n" not in line for line in lines)


def test_added_step_shows_only_added_lines():
    new = copy.deepcopy(BASE)
    new["steps"].append({"id": "archive", "kind": "task"})
    lines = document_diff(BASE, new)
    kinds = {diff_line_kind(line) for line in lines}
    assert "removed" not in kinds
    assert any('"archive"' in line for line in lines if diff_line_kind(line) == "added")


def test_removed_step_shows_only_removed_lines():
    new = copy.deepcopy(BASE)
    del new["steps"][1]
    lines = document_diff(BASE, new)
    kinds = {diff_line_kind(line) for line in lines}
    assert "added" not in kinds
    removed = [line for line in lines if diff_line_kind(line) == "removed"]
    assert '-      "id": "send",' in removed


def test_step_order_matters():
    swapped = copy.deepcopy(BASE)
    swapped["steps"].reverse()
    assert document_diff(BASE, swapped) != []


def test_context_lines_follow_the_context_argument():
    old = {"id": "w", "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7}
    new = {**old, "d": 40}
    wide = document_diff(old, new)
    narrow = document_diff(old, new, context=0)
    assert len([x for x in narrow if diff_line_kind(x) == "context"]) == 0
    assert len([x for x in wide if diff_line_kind(x) == "context"]) == 6


def test_non_ascii_text_is_kept_readable():
    lines = document_diff(BASE, changed(description="Répondre à un ticket"))
    assert '+  "description": "Répondre à un ticket",' in lines


def test_document_text_is_sorted_pretty_json_without_version():
    text = document_text({"version": 3, "id": "w", "description": "d"})
    assert text == '{\n  "description": "d",\n  "id": "w"\n}'


def test_inputs_are_not_modified():
    old, new = copy.deepcopy(BASE), changed(description="x")
    before_old, before_new = copy.deepcopy(old), copy.deepcopy(new)
    document_diff(old, new)
    assert old == before_old
    assert new == before_new


def test_line_kinds():
    assert diff_line_kind("--- a") == "header"
    assert diff_line_kind("+++ b") == "header"
    assert diff_line_kind("@@ -1,3 +1,3 @@") == "hunk"
    assert diff_line_kind('+  "a": 1') == "added"
    assert diff_line_kind('-  "a": 1') == "removed"
    assert diff_line_kind('   "a": 1') == "context"


def test_reading_order_puts_fields_in_the_contract_order():
    scrambled = {
        "steps": [{"when": {"path": "input.x", "op": "exists"}, "kind": "task", "id": "a"}],
        "output": None,
        "extra": 1,
        "version": 2,
        "limits": {},
        "id": "w",
        "description": "d",
    }
    ordered = reading_order(scrambled)
    assert ordered == scrambled
    assert list(ordered) == ["id", "version", "description", "limits", "steps", "output", "extra"]
    assert list(ordered["steps"][0]) == ["id", "kind", "when"]


def test_reading_order_reaches_nested_steps():
    doc = {"id": "w", "steps": [{"branches": {"b": {"kind": "task", "id": "inner"}}, "id": "p"}]}
    ordered = reading_order(doc)
    assert list(ordered["steps"][0]) == ["id", "branches"]
    assert list(ordered["steps"][0]["branches"]["b"]) == ["id", "kind"]
