"""The workflow's graph as the run inspector draws it: the version's document turned into a
tree of nodes, each with the statuses of its latest attempts, and that tree laid out as boxes,
frames and lines for a server-side SVG.

Pure Python, no Django: the page reads the journal and hands in ``(body, path, step_id,
status)`` of every step instance's latest attempt; this module decides where everything goes.

How journal rows find their node: a step of the top-level list or of a condition's branch
runs at its parent's path; the one step of a parallel branch at ``<path><id>[<branch>]/``, of
a foreach item or loop iteration at ``<path><id>[<index>]/`` (``runs.engine.plan``). A body of
several steps runs as an anonymous child run whose ``body`` names it (``<id>.do``,
``<id>.branches.<name>``), its steps at paths of their own inside that child. Indexes are
digits and branch names are ids (they start with a letter), so replacing every ``[<digits>]``
by ``[]`` turns the path of any item or iteration into its node's: a foreach of 10,000 items is
one node with counts per status, never 10,000 nodes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BODY = "_body"  # runs.engine.plan.BODY: the stand-in row of a body of several steps
# runs.engine.plan.ON_FAILURE: where the rows of a document's on_failure steps live
# (``_on_failure[<generation>]/``), and the id of the node that holds them.
ON_FAILURE = "_on_failure"
_INDEX = re.compile(r"\[\d+\]")

# The order a node's colour is chosen in: one failed item of fifty makes the node look failed,
# one still running makes it look running, even when the rest succeeded.
SEVERITY = (
    "failed",
    "timed_out",
    # An attempt in doubt waits for a person: its node shows it above work in flight.
    "in_doubt",
    "running",
    "waiting",
    "scheduled",
    "cancelled",
    "succeeded",
    "skipped",
)
COMPOSITES = frozenset({"parallel", "foreach", "loop"})


def node_path(path: str) -> str:
    """The path of an item or iteration with its indexes removed: ``a[3]/b[x]/`` → ``a[]/b[x]/``."""
    return _INDEX.sub("[]", path)


def key(body: str, path: str, step_id: str) -> str:
    """A node's identity: the body it runs in ("" for the run's own list), its path without
    indexes, its step id."""
    return f"{body}|{node_path(path)}|{step_id}"


def dominant(counts: Mapping[str, int]) -> str | None:
    """The status a node is coloured by (see :data:`SEVERITY`); None when it never ran."""
    for status in SEVERITY:
        if counts.get(status):
            return status
    return next(iter(counts), None)


# --- the document as a tree -----------------------------------------------------------------


@dataclass
class Lane:
    """What runs below a composite or condition: a branch, then/else, or the body of every item
    or iteration."""

    label: str
    steps: list[Node]


@dataclass
class Node:
    key: str
    step_id: str
    kind: str
    # Statuses of the latest attempt of every instance (one for a top-level step; one per item
    # for a step inside a foreach).
    counts: dict[str, int] = field(default_factory=dict)
    lanes: list[Lane] = field(default_factory=list)
    # For a foreach or loop: the node whose instances are its items or iterations (its one
    # step, or the stand-in row of a body of several), and their statuses.
    items_key: str | None = None
    items: dict[str, int] | None = None
    # For a condition: the branches taken ("then"/"else") in its latest attempts.
    taken: list[str] = field(default_factory=list)
    # Where a click on it leads (the page sets it: its latest attempt, its child run).
    href: str = ""

    @property
    def status(self) -> str | None:
        return dominant(self.counts)

    @property
    def instances(self) -> int:
        return sum(self.counts.values())

    @property
    def summary(self) -> str:
        """The statuses of its instances, most severe first: "48 succeeded · 2 failed"; for a
        foreach or loop, of its items or iterations; "not reached" when it never ran."""
        if self.items is not None:
            counted = self.items
            noun = "item" if self.kind == "foreach" else "iteration"
            total = sum(counted.values())
            if not total:
                return "no items yet" if self.kind == "foreach" else "no iterations yet"
            plural = "s" if total != 1 else ""
            return f"{total} {noun}{plural}: " + _counted(counted)
        if not self.counts:
            return "not reached"
        if self.instances == 1:
            return next(iter(self.counts))
        return _counted(self.counts)


def _counted(counts: Mapping[str, int]) -> str:
    order = {status: rank for rank, status in enumerate(SEVERITY)}
    ranked = sorted(counts.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
    return " · ".join(f"{n} {status}" for status, n in ranked if n)


def _body_steps(body: Any) -> list[Mapping[str, Any]]:
    if isinstance(body, list):
        return [step for step in body if isinstance(step, Mapping)]
    return [body] if isinstance(body, Mapping) else []


def outline(document: Mapping[str, Any]) -> list[Node]:
    """The document's steps as nodes, nested as they are nested (without statuses); its
    on_failure steps, when it has some, last, in a lane below a node of their own."""
    nodes = _sequence(document.get("steps") or [], body="", path="")
    handler = document.get("on_failure")
    if isinstance(handler, list) and handler:
        node = Node(key("", "", ON_FAILURE), "on_failure", "on_failure")
        lane = _sequence(handler, body="", path=f"{ON_FAILURE}[]/")
        node.lanes = [Lane("when a step fails the run", lane)]
        nodes.append(node)
    return nodes


def _sequence(steps: Iterable[Any], *, body: str, path: str) -> list[Node]:
    return [_node(step, body=body, path=path) for step in steps if isinstance(step, Mapping)]


def _node(step: Mapping[str, Any], *, body: str, path: str) -> Node:
    step_id, kind = str(step.get("id", "?")), str(step.get("kind", "?"))
    node = Node(key(body, path, step_id), step_id, kind)
    if kind == "condition":
        node.lanes = [
            Lane("then", _sequence(step.get("then") or [], body=body, path=path)),
            Lane("else", _sequence(step.get("else") or [], body=body, path=path)),
        ]
    elif kind == "parallel":
        branches = step.get("branches") or {}
        node.lanes = [
            _inside(
                inner,
                body=body,
                path=f"{path}{step_id}[{name}]/",
                ref=f"{step_id}.branches.{name}",
                label=name,
            )
            for name, inner in branches.items()
        ]
    elif kind in ("foreach", "loop"):
        label = "each item" if kind == "foreach" else "each iteration"
        inner_path = f"{path}{step_id}[]/"
        do = _body_steps(step.get("do"))
        node.lanes = [
            _inside(step.get("do"), body=body, path=inner_path, ref=f"{step_id}.do", label=label)
        ]
        first = str(do[0].get("id", "?")) if len(do) == 1 else BODY
        node.items_key = key(body, inner_path, first)
    return node


def _inside(inner: Any, *, body: str, path: str, ref: str, label: str) -> Lane:
    """The lane of a branch, item or iteration: one step runs at ``path`` in this run; a body
    of several runs as a child run named ``ref``, whose own steps start at its root path."""
    steps = _body_steps(inner)
    if len(steps) == 1:
        return Lane(label, [_node(steps[0], body=body, path=path)])
    return Lane(label, _sequence(steps, body=ref, path=""))


# --- statuses onto the tree -----------------------------------------------------------------


def colour(nodes: list[Node], latest: Iterable[tuple[str, str, str, str, str]]) -> None:
    """Count the statuses of ``latest`` (body, path, step_id, status, branch: the latest
    attempt of every step instance) onto the nodes they belong to."""
    counts: dict[str, Counter[str]] = {}
    taken: dict[str, set[str]] = {}
    for body, path, step_id, status, branch in latest:
        node_key = key(body, path, step_id)
        counts.setdefault(node_key, Counter())[status] += 1
        if branch:
            taken.setdefault(node_key, set()).add(branch)
    for node in walk(nodes):
        node.counts = dict(counts.get(node.key, {}))
        node.taken = sorted(taken.get(node.key, ()))
        if node.items_key is not None:
            node.items = dict(counts.get(node.items_key, {}))
        if node.kind == "on_failure":
            # No row of its own: it shows how its steps went.
            for inner in node.lanes[0].steps:
                for status, n in counts.get(inner.key, {}).items():
                    node.counts[status] = node.counts.get(status, 0) + n


def walk(nodes: Iterable[Node]) -> Iterable[Node]:
    for node in nodes:
        yield node
        for lane in node.lanes:
            yield from walk(lane.steps)


# --- layout ---------------------------------------------------------------------------------

BOX_W, BOX_H = 184, 58
GAP_Y = 30  # between a node and the next
GAP_X = 24  # between lanes
PAD = 12  # inside a lane's frame
LABEL_H = 18  # a lane's label, above its first node
JOIN = 18  # the line from the lanes' ends to their join
MARGIN = 16
# An empty lane (a condition's missing ``else``) is no frame but a line past the steps, from
# the split to the join, with its label beside it: as Airflow and Prefect draw a skipped
# branch. (It was an empty box with an arrow into it and a line through it, issue 37.)
BYPASS_W = 56


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float
    node: Node

    @property
    def cx(self) -> float:
        return self.x + self.w / 2


@dataclass(frozen=True)
class Frame:
    x: float
    y: float
    w: float
    h: float
    label: str
    # Dashed: what runs once per item or iteration.
    repeated: bool


@dataclass(frozen=True)
class Line:
    points: tuple[tuple[float, float], ...]
    arrow: bool = True

    @property
    def d(self) -> str:
        head, *rest = self.points
        return f"M{head[0]:g},{head[1]:g}" + "".join(f" L{x:g},{y:g}" for x, y in rest)


@dataclass(frozen=True)
class Label:
    """The name of a lane drawn without a frame (an empty one), beside its line."""

    x: float
    y: float
    text: str


@dataclass
class Drawing:
    width: float
    height: float
    boxes: list[Box] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    joins: list[tuple[float, float]] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)


def _size(nodes: Sequence[Node]) -> tuple[float, float]:
    """Width and height of a list of steps drawn one under the other."""
    if not nodes:
        return BOX_W * 0.6, 24.0
    sizes = [_node_size(node) for node in nodes]
    return max(w for w, _ in sizes), sum(h for _, h in sizes) + GAP_Y * (len(nodes) - 1)


def _lane_size(lane: Lane) -> tuple[float, float]:
    if not lane.steps:
        return BYPASS_W, LABEL_H + PAD
    w, h = _size(lane.steps)
    return w + 2 * PAD, h + 2 * PAD + LABEL_H


def _node_size(node: Node) -> tuple[float, float]:
    if not node.lanes:
        return BOX_W, BOX_H
    lanes = [_lane_size(lane) for lane in node.lanes]
    width = sum(w for w, _ in lanes) + GAP_X * (len(lanes) - 1)
    height = BOX_H + GAP_Y + max(h for _, h in lanes) + JOIN
    return max(width, BOX_W), height


def layout(nodes: Sequence[Node]) -> Drawing:
    """Boxes, frames and lines for ``nodes``, top to bottom, every container's lanes side by
    side under its own box and joined again below them. Sizes are in SVG user units."""
    width, height = _size(nodes)
    drawing = Drawing(width + 2 * MARGIN, height + 2 * MARGIN)
    _place_sequence(drawing, nodes, MARGIN, MARGIN, width)
    return drawing


def _place_sequence(
    drawing: Drawing, nodes: Sequence[Node], x: float, y: float, width: float
) -> tuple[float, float, float]:
    """Place ``nodes`` in the column [x, x + width) from ``y`` down; returns the column's
    centre, where its first node starts and where its last ends (for the lines in and out)."""
    centre = x + width / 2
    if not nodes:
        drawing.lines.append(Line(((centre, y), (centre, y + 24)), arrow=False))
        return centre, y, y + 24
    top, previous_end = y, None
    for node in nodes:
        w, h = _node_size(node)
        start, end = _place_node(drawing, node, centre - w / 2, y)
        if previous_end is not None:
            drawing.lines.append(Line(((centre, previous_end), (centre, start))))
        previous_end = end
        y += h + GAP_Y
    assert previous_end is not None
    return centre, top, previous_end


def _place_node(drawing: Drawing, node: Node, x: float, y: float) -> tuple[float, float]:
    """Place one node with its top-left at (x, y); returns where lines enter and leave it."""
    w, h = _node_size(node)
    centre = x + w / 2
    drawing.boxes.append(Box(centre - BOX_W / 2, y, BOX_W, BOX_H, node))
    if not node.lanes:
        return y, y + BOX_H
    lanes_top = y + BOX_H + GAP_Y
    lanes_width = sum(_lane_size(lane)[0] for lane in node.lanes) + GAP_X * (len(node.lanes) - 1)
    lane_x = centre - lanes_width / 2
    join_y = y + h
    repeated = node.kind in ("foreach", "loop")
    for lane in node.lanes:
        lw, lh = _lane_size(lane)
        if not lane.steps:
            _place_bypass(drawing, lane, centre, lane_x + lw / 2, y + BOX_H, join_y)
            lane_x += lw + GAP_X
            continue
        drawing.frames.append(Frame(lane_x, lanes_top, lw, lh, lane.label, repeated))
        inner_w = lw - 2 * PAD
        lane_centre, first, last = _place_sequence(
            drawing, lane.steps, lane_x + PAD, lanes_top + PAD + LABEL_H, inner_w
        )
        # Down from the container's box to the lane's first step, and from its last step to
        # the join below all lanes.
        drawing.lines.append(
            Line(
                (
                    (centre, y + BOX_H),
                    (centre, y + BOX_H + GAP_Y / 2),
                    (lane_centre, y + BOX_H + GAP_Y / 2),
                    (lane_centre, first),
                )
            )
        )
        drawing.lines.append(
            Line(
                (
                    (lane_centre, last),
                    (lane_centre, join_y - JOIN / 2),
                    (centre, join_y - JOIN / 2),
                    (centre, join_y),
                ),
                arrow=False,
            )
        )
        lane_x += lw + GAP_X
    drawing.joins.append((centre, join_y))
    return y, join_y


def _place_bypass(
    drawing: Drawing, lane: Lane, centre: float, x: float, top: float, join_y: float
) -> None:
    """An empty lane: one line from the container's box straight down to the join, no arrow
    (nothing runs there), its label beside it."""
    split_y, merge_y = top + GAP_Y / 2, join_y - JOIN / 2
    points = ((centre, top), (centre, split_y), (x, split_y), (x, merge_y), (centre, merge_y))
    drawing.lines.append(Line((*points, (centre, join_y)), arrow=False))
    drawing.labels.append(Label(x + 4, split_y + LABEL_H, lane.label))
