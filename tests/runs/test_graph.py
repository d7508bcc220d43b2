"""The inspector's graph (runs.graph): the document as nodes, the journal's latest attempts
counted onto them, and a layout whose boxes never overlap and whose lanes sit side by side."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from runs import graph

DOCUMENT: dict[str, Any] = {
    "id": "shapes",
    "steps": [
        {"id": "first", "kind": "task"},
        {
            "id": "route",
            "kind": "condition",
            "if": {"path": "input.x", "op": "eq", "value": 1},
            "then": [{"id": "yes", "kind": "task"}],
            "else": [
                {
                    "id": "switch",
                    "kind": "condition",
                    "if": {"path": "input.y", "op": "exists"},
                    "then": [{"id": "maybe", "kind": "task"}],
                    "else": [],
                }
            ],
        },
        {
            "id": "fan",
            "kind": "parallel",
            "branches": {
                "left": {"id": "l", "kind": "task"},
                "right": [{"id": "r1", "kind": "task"}, {"id": "r2", "kind": "task"}],
            },
        },
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.items}",
            "do": {"id": "work", "kind": "task"},
        },
        {
            "id": "again",
            "kind": "loop",
            "max_iterations": 3,
            "do": [{"id": "try_it", "kind": "task"}, {"id": "check", "kind": "task"}],
        },
        {"id": "child", "kind": "subworkflow", "workflow": "other"},
    ],
}


def by_id(nodes: list[graph.Node]) -> dict[str, graph.Node]:
    return {node.step_id: node for node in graph.walk(nodes)}


def test_the_outline_nests_every_kind_of_body() -> None:
    nodes = graph.outline(DOCUMENT)
    assert [n.step_id for n in nodes] == ["first", "route", "fan", "each", "again", "child"]
    found = by_id(nodes)
    assert [lane.label for lane in found["route"].lanes] == ["then", "else"]
    assert [lane.label for lane in found["switch"].lanes] == ["then", "else"]
    assert found["switch"].lanes[1].steps == []
    assert [lane.label for lane in found["fan"].lanes] == ["left", "right"]
    # One step of a branch runs in this run at the branch's path; several in a body run.
    assert found["l"].key == "|fan[left]/|l"
    assert found["r1"].key == "fan.branches.right||r1"
    assert found["work"].key == "|each[]/|work"
    assert found["check"].key == "again.do||check"
    assert found["each"].items_key == "|each[]/|work"
    assert found["again"].items_key == "|again[]/|_body"


def test_a_foreach_of_fifty_items_is_one_node_with_counts_per_status() -> None:
    nodes = graph.outline(DOCUMENT)
    latest = [("", "", "each", "failed", "")]
    latest += [("", f"each[{i}]/", "work", "succeeded", "") for i in range(48)]
    latest += [("", f"each[{i}]/", "work", "failed", "") for i in (48, 49)]
    graph.colour(nodes, latest)
    found = by_id(nodes)
    assert found["work"].counts == {"succeeded": 48, "failed": 2}
    assert found["work"].status == "failed"
    assert found["each"].summary == "50 items: 2 failed · 48 succeeded"
    drawing = graph.layout(nodes)
    assert sum(1 for box in drawing.boxes if box.node.step_id == "work") == 1


def test_statuses_of_body_runs_and_branches_find_their_nodes() -> None:
    nodes = graph.outline(DOCUMENT)
    graph.colour(
        nodes,
        [
            ("", "", "first", "succeeded", ""),
            ("", "", "route", "succeeded", "else"),
            ("", "", "switch", "skipped", ""),
            ("", "fan[left]/", "l", "running", ""),
            ("", "fan[right]/", "_body", "waiting", ""),
            ("fan.branches.right", "", "r1", "succeeded", ""),
            ("fan.branches.right", "", "r2", "scheduled", ""),
            ("", "again[0]/", "_body", "succeeded", ""),
            ("", "again[1]/", "_body", "running", ""),
            ("again.do", "", "check", "succeeded", ""),
        ],
    )
    found = by_id(nodes)
    assert found["route"].taken == ["else"] and found["route"].status == "succeeded"
    assert found["switch"].summary == "skipped"
    assert (found["l"].status, found["r1"].status, found["r2"].status) == (
        "running",
        "succeeded",
        "scheduled",
    )
    assert found["again"].items == {"succeeded": 1, "running": 1}
    assert found["again"].summary == "2 iterations: 1 running · 1 succeeded"
    assert found["yes"].status is None and found["yes"].summary == "not reached"


def test_the_colour_is_the_most_severe_status() -> None:
    assert graph.dominant({"succeeded": 9, "running": 1}) == "running"
    assert graph.dominant({"succeeded": 9, "failed": 1, "running": 1}) == "failed"
    assert graph.dominant({"skipped": 1}) == "skipped"
    assert graph.dominant({}) is None


def overlap(a: graph.Box, b: graph.Box) -> bool:
    return a.x < b.x + b.w and b.x < a.x + a.w and a.y < b.y + b.h and b.y < a.y + a.h


def test_the_layout_has_no_overlapping_boxes_and_fits_the_drawing() -> None:
    drawing = graph.layout(graph.outline(DOCUMENT))
    assert len(drawing.boxes) == 15
    for a, b in combinations(drawing.boxes, 2):
        assert not overlap(a, b), (a.node.step_id, b.node.step_id)
    for box in drawing.boxes:
        assert box.x >= 0 and box.x + box.w <= drawing.width
        assert box.y >= 0 and box.y + box.h <= drawing.height
    for frame in drawing.frames:
        assert frame.x + frame.w <= drawing.width and frame.y + frame.h <= drawing.height


def test_steps_run_top_to_bottom_and_lanes_side_by_side() -> None:
    drawing = graph.layout(graph.outline(DOCUMENT))
    box = {b.node.step_id: b for b in drawing.boxes}
    tops = [box[s].y for s in ("first", "route", "fan", "each", "again", "child")]
    assert tops == sorted(tops) and len(set(tops)) == 6
    # then left of else, left branch left of right; a lane's steps below its container.
    assert box["yes"].x + box["yes"].w <= box["switch"].x
    assert box["l"].x + box["l"].w <= box["r1"].x
    assert box["r1"].y < box["r2"].y and box["r1"].x == box["r2"].x
    assert box["work"].y > box["each"].y + box["each"].h
    # The lanes of one container start at the same height.
    assert box["l"].y == box["r1"].y and box["yes"].y == box["switch"].y
    # Every repeated body (foreach, loop) is framed dashed; branches are not.
    repeated = {f.label for f in drawing.frames if f.repeated}
    assert repeated == {"each item", "each iteration"}


def test_lines_join_what_follows() -> None:
    drawing = graph.layout(
        graph.outline({"steps": [{"id": "a", "kind": "task"}, {"id": "b", "kind": "task"}]})
    )
    a, b = drawing.boxes
    [line] = drawing.lines
    assert line.points == ((a.cx, a.y + a.h), (b.cx, b.y))
    assert line.d.startswith("M") and line.arrow


def test_an_empty_or_odd_document_still_draws() -> None:
    assert graph.layout(graph.outline({"steps": []})).boxes == []
    odd = graph.outline({"steps": [{"id": "f", "kind": "foreach", "do": None}, "junk"]})
    assert [n.step_id for n in odd] == ["f"]
    graph.layout(odd)
    assert graph.node_path("a[3]/b[x]/c[12]/") == "a[]/b[x]/c[]/"


def test_on_failure_steps_are_drawn_last_and_coloured_by_their_rows() -> None:
    document = {
        "id": "with_handler",
        "steps": [{"id": "work", "kind": "task"}],
        "on_failure": [{"id": "tidy", "kind": "task"}, {"id": "tell", "kind": "task"}],
    }
    nodes = graph.outline(document)
    assert [n.step_id for n in nodes] == ["work", "on_failure"]
    assert [n.step_id for n in nodes[1].lanes[0].steps] == ["tidy", "tell"]
    graph.colour(
        nodes,
        [
            ("", "", "work", "failed", ""),
            ("", "_on_failure[1]/", "tidy", "succeeded", ""),
            ("", "_on_failure[1]/", "tell", "running", ""),
        ],
    )
    tidy, tell = nodes[1].lanes[0].steps
    assert (tidy.status, tell.status) == ("succeeded", "running")
    assert nodes[1].counts == {"succeeded": 1, "running": 1}
    assert nodes[1].status == "running"
    assert len(graph.layout(nodes).boxes) == 4
    # A document without one draws none.
    assert [n.step_id for n in graph.outline({"steps": [{"id": "a", "kind": "task"}]})] == ["a"]


def test_a_condition_without_else_draws_a_line_past_its_steps_not_an_empty_box() -> None:
    """Issue 37: an arrow into an empty ``else`` box and a line through it. The missing branch
    is a line from the split to the join, labelled, with no frame and no arrow."""
    document = {
        "steps": [
            {
                "id": "check",
                "kind": "condition",
                "if": {"path": "input.x", "op": "exists"},
                "then": [{"id": "yes", "kind": "task"}],
            },
            {"id": "after", "kind": "task"},
        ]
    }
    drawing = graph.layout(graph.outline(document))
    assert [frame.label for frame in drawing.frames] == ["then"]
    assert [label.text for label in drawing.labels] == ["else"]
    box = {b.node.step_id: b for b in drawing.boxes}
    check, yes, after = box["check"], box["yes"], box["after"]
    [join] = drawing.joins
    right_of_then = yes.x + yes.w
    bypass = [
        line
        for line in drawing.lines
        if line.points[-1] == join and line.points[2][0] > right_of_then
    ]
    assert len(bypass) == 1 and not bypass[0].arrow
    # It leaves the condition's box and comes back to the join, right of the then lane.
    assert bypass[0].points[0] == (check.cx, check.y + check.h)
    # Every arrow ends on a box's top: none points into nothing.
    tops = {(b.cx, b.y) for b in drawing.boxes}
    assert all(line.points[-1] in tops for line in drawing.lines if line.arrow)
    assert after.y > join[1]
    for b in drawing.boxes:
        assert b.x + b.w <= drawing.width
