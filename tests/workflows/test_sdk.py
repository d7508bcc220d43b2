"""The Python builder (contract section 6) and the handler registry."""

from __future__ import annotations

import copy
import importlib
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from workflows import registry, sdk
from workflows.errors import InvalidDocument, InvalidInput
from workflows.sdk import RetryPolicy, StepFailure, when, workflow
from workflows.services import definition_save

from .documents import support_ticket_body

EXAMPLE = "workflows.examples.support_ticket"

# Contract section 1, copied literally, without "version".
CONTRACT_DOCUMENT = support_ticket_body()


@pytest.fixture(autouse=True)
def isolated_registry() -> Iterator[None]:
    """An empty registry for each test; whatever other tests registered comes back after."""
    state = registry.snapshot()
    example = sys.modules.pop(EXAMPLE, None)
    registry.clear()
    yield
    sys.modules.pop(EXAMPLE, None)
    if example is not None:
        sys.modules[EXAMPLE] = example
    registry.restore(state)


def _validate(document: dict[str, Any]) -> dict[str, Any]:
    from workflows.validation import prepare_document

    return prepare_document(document, workflow_exists=lambda workflow_id, version: True)


class FakeSpan:
    def __init__(self) -> None:
        self.model: tuple[str, str] | None = None
        self.usage: dict[str, int] = {}

    def __enter__(self) -> FakeSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_model(self, model: str, provider: str) -> None:
        self.model = (model, provider)

    def set_usage(self, **usage: int) -> None:
        self.usage = usage


class FakeContext:
    idempotency_key = "run-1:send"

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, FakeSpan]] = []

    def span(self, name: str, kind: str) -> FakeSpan:
        span = FakeSpan()
        self.spans.append((name, kind, span))
        return span


# --- the contract's example ------------------------------------------------------------------


def test_support_ticket_example_builds_the_contract_document() -> None:
    module = importlib.import_module(EXAMPLE)

    document = module.support.document()

    assert document == CONTRACT_DOCUMENT
    assert list(document) == ["id", "description", "input_schema", "limits", "steps", "output"]
    assert document["steps"][2]["timeout_ms"] == 7 * 24 * 3_600_000


def test_support_ticket_example_registers_runnable_handlers() -> None:
    module = importlib.import_module(EXAMPLE)
    ctx = FakeContext()

    classify = registry.lookup("support_ticket", "classify")
    draft = registry.lookup("support_ticket", "draft")
    send = registry.lookup("support_ticket", "send")

    assert classify is module.classify
    assert draft is module.draft
    assert send is module.send
    assert classify(ctx, {"ticket": "Q: how?"}, {}) == {"kind": "question"}
    assert classify(ctx, {"ticket": "it crashes"}, {}) == {"kind": "bug"}
    assert draft(ctx, {"kind": "bug"}, {}) == "an answer to a bug"
    assert ctx.spans[0][:2] == ("model_call", "model_generation")
    # The offline stand-in's, not claude-sonnet-4's: its usage is made up (issue 37).
    assert ctx.spans[0][2].model == ("echo", "standin")
    assert send(ctx, {"text": "hello"}, {}) == {"sent": True}
    assert module.deliver("hello", "key") is True
    assert registry.builders() == [module.support]


def test_support_ticket_example_send_raises_retryable_when_the_relay_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = importlib.import_module(EXAMPLE)
    monkeypatch.setattr(module, "deliver", lambda text, key: False)

    with pytest.raises(StepFailure) as caught:
        module.send(FakeContext(), {"text": "hello"}, {})

    assert caught.value.error_class == "retryable"
    assert caught.value.retry_after_ms == 2_000
    assert caught.value.as_error() == {"class": "retryable", "message": "mail relay busy"}


def test_section_6_code_verbatim() -> None:
    """The code of contract section 6 as written, with no top-level fields."""

    def deliver(text: str, key: str) -> bool:
        return True

    support = workflow("support_ticket")

    @support.step("classify")
    def classify(ctx, input, prior):  # type: ignore[no-untyped-def]
        return {"kind": "question" if input["ticket"].startswith("Q") else "bug"}

    @support.agent("draft", input={"kind": "${steps.classify.output.kind}"})
    def draft(ctx, input, prior):  # type: ignore[no-untyped-def]
        with ctx.span("model_call", kind="model_generation") as span:
            span.set_model("claude-sonnet-4", "anthropic")
            span.set_usage(input_tokens=812, output_tokens=37)
            return f"an answer to a {input['kind']}"

    support.wait_for(
        "approval",
        event="approved",
        key="${input.ticket}",
        timeout_ms=7 * 24 * 3_600_000,
        when=when("steps.classify.output.kind", "eq", "bug"),
    )

    @support.step(
        "send",
        input={"text": "${steps.draft.output}"},
        effect="at_most_once",
        retry=RetryPolicy(max_attempts=3, backoff="exponential", initial_ms=500),
    )
    def send(ctx, input, prior):  # type: ignore[no-untyped-def]
        if not deliver(input["text"], ctx.idempotency_key):
            raise StepFailure("mail relay busy", class_="retryable", retry_after_ms=2_000)
        return {"sent": True}

    support.output({"sent": "${steps.send.output.sent}"})

    expected = {
        key: value
        for key, value in CONTRACT_DOCUMENT.items()
        if key not in ("description", "input_schema", "limits")
    }
    assert support.document() == expected
    assert list(support.document()) == ["id", "steps", "output"]


# --- every builder method --------------------------------------------------------------------

# (name, builder call, the module-level constructor call, the expected step). Each builds a
# one-step workflow that is valid on its own, so the same table checks validation below.
BUILDER_CASES: list[tuple[str, Callable[[sdk.Workflow], Any], Callable[[], Any], dict[str, Any]]]
BUILDER_CASES = [
    (
        "task",
        lambda wf: wf.task("t", handler="mail.send"),
        lambda: sdk.task("t", handler="mail.send"),
        {"id": "t", "kind": "task", "handler": "mail.send"},
    ),
    (
        "task_all_common_fields",
        lambda wf: wf.task(
            "t",
            input={"x": "${input.x}"},
            when=when("input.x", "exists"),
            retry={"max_attempts": 2, "backoff": "fixed"},
            on_error="continue",
            effect="at_most_once",
            timeout_ms=1_000,
            queue="slow",
        ),
        lambda: sdk.task(
            "t",
            input={"x": "${input.x}"},
            when=when("input.x", "exists"),
            retry={"max_attempts": 2, "backoff": "fixed"},
            on_error="continue",
            effect="at_most_once",
            timeout_ms=1_000,
            queue="slow",
        ),
        {
            "id": "t",
            "kind": "task",
            "input": {"x": "${input.x}"},
            "when": {"path": "input.x", "op": "exists"},
            "retry": {"max_attempts": 2, "backoff": "fixed"},
            "on_error": "continue",
            "effect": "at_most_once",
            "timeout_ms": 1_000,
            "queue": "slow",
        },
    ),
    (
        "wait_for",
        lambda wf: wf.wait_for("w", event="paid", key="${input.order}", timeout_ms=60_000),
        lambda: sdk.wait_event("w", event="paid", key="${input.order}", timeout_ms=60_000),
        {
            "id": "w",
            "kind": "wait_event",
            "event": "paid",
            "key": "${input.order}",
            "timeout_ms": 60_000,
        },
    ),
    (
        "wait_for_minimal",
        lambda wf: wf.wait_for("w", event="paid"),
        lambda: sdk.wait_for("w", event="paid"),
        {"id": "w", "kind": "wait_event", "event": "paid"},
    ),
    (
        "sleep",
        lambda wf: wf.sleep("s", ms=250, queue="timers"),
        lambda: sdk.sleep("s", ms=250, queue="timers"),
        {"id": "s", "kind": "sleep", "ms": 250, "queue": "timers"},
    ),
    (
        "sleep_until",
        lambda wf: wf.sleep_until("s", until="${input.at}"),
        lambda: sdk.sleep_until("s", until="${input.at}"),
        {"id": "s", "kind": "sleep_until", "until": "${input.at}"},
    ),
    (
        "approval",
        lambda wf: wf.approval(
            "ok",
            approvers={"users": ["ada"], "groups": ["ops"], "emails": ["x@example.com"]},
            quorum=2,
            timeout_ms=120_000,
            message="Approve ${input.amount}?",
            remind_after_ms=60_000,
            escalate_to={"users": ["root"], "groups": ["leads"]},
        ),
        lambda: sdk.approval(
            "ok",
            approvers={"users": ["ada"], "groups": ["ops"], "emails": ["x@example.com"]},
            quorum=2,
            timeout_ms=120_000,
            message="Approve ${input.amount}?",
            remind_after_ms=60_000,
            escalate_to={"users": ["root"], "groups": ["leads"]},
        ),
        {
            "id": "ok",
            "kind": "approval",
            "approvers": {"users": ["ada"], "groups": ["ops"], "emails": ["x@example.com"]},
            "quorum": 2,
            "timeout_ms": 120_000,
            "message": "Approve ${input.amount}?",
            "remind_after_ms": 60_000,
            "escalate_to": {"users": ["root"], "groups": ["leads"]},
        },
    ),
    (
        "approval_minimal",
        lambda wf: wf.approval("ok", approvers={"groups": ["ops"]}),
        lambda: sdk.approval("ok", approvers={"groups": ["ops"]}),
        {"id": "ok", "kind": "approval", "approvers": {"groups": ["ops"]}},
    ),
    (
        "parallel",
        lambda wf: wf.parallel(
            "fan",
            branches={
                "a": sdk.task("fetch_a"),
                "b": [sdk.sleep("pause", ms=5), sdk.agent("summarise", handler="llm.sum")],
                "c": sdk.subworkflow("child", workflow="other"),
            },
        ),
        lambda: sdk.parallel(
            "fan",
            branches={
                "a": sdk.task("fetch_a"),
                "b": [sdk.sleep("pause", ms=5), sdk.agent("summarise", handler="llm.sum")],
                "c": sdk.subworkflow("child", workflow="other"),
            },
        ),
        {
            "id": "fan",
            "kind": "parallel",
            "branches": {
                "a": {"id": "fetch_a", "kind": "task"},
                "b": [
                    {"id": "pause", "kind": "sleep", "ms": 5},
                    {"id": "summarise", "kind": "agent", "handler": "llm.sum"},
                ],
                "c": {"id": "child", "kind": "subworkflow", "workflow": "other"},
            },
        },
    ),
    (
        "foreach",
        lambda wf: wf.foreach(
            "each",
            items="${input.urls}",
            do=sdk.http("get", method="GET", url="${item}"),
            max_items=10,
            concurrency=2,
        ),
        lambda: sdk.foreach(
            "each",
            items="${input.urls}",
            do=sdk.http("get", method="GET", url="${item}"),
            max_items=10,
            concurrency=2,
        ),
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.urls}",
            "do": {"id": "get", "kind": "http", "method": "GET", "url": "${item}"},
            "max_items": 10,
            "concurrency": 2,
        },
    ),
    (
        "foreach_literal_items_and_step_list",
        lambda wf: wf.foreach(
            "each",
            items=[1, 2],
            do=[sdk.task("first"), sdk.task("second", input="${steps.first.output}")],
        ),
        lambda: sdk.foreach(
            "each",
            items=[1, 2],
            do=[sdk.task("first"), sdk.task("second", input="${steps.first.output}")],
        ),
        {
            "id": "each",
            "kind": "foreach",
            "items": [1, 2],
            "do": [
                {"id": "first", "kind": "task"},
                {"id": "second", "kind": "task", "input": "${steps.first.output}"},
            ],
        },
    ),
    (
        "loop",
        lambda wf: wf.loop(
            "again",
            do=sdk.task("attempt", input={"n": "${iter.index}"}),
            max_iterations=5,
            until=when("steps.attempt.output.done", "eq", True),
        ),
        lambda: sdk.loop(
            "again",
            do=sdk.task("attempt", input={"n": "${iter.index}"}),
            max_iterations=5,
            until=when("steps.attempt.output.done", "eq", True),
        ),
        {
            "id": "again",
            "kind": "loop",
            "do": {"id": "attempt", "kind": "task", "input": {"n": "${iter.index}"}},
            "max_iterations": 5,
            "until": {"path": "steps.attempt.output.done", "op": "eq", "value": True},
        },
    ),
    (
        "subworkflow",
        lambda wf: wf.subworkflow("child", workflow="other", version=2, input="${input}"),
        lambda: sdk.subworkflow("child", workflow="other", version=2, input="${input}"),
        {
            "id": "child",
            "kind": "subworkflow",
            "workflow": "other",
            "version": 2,
            "input": "${input}",
        },
    ),
    (
        "condition",
        lambda wf: wf.condition(
            "route",
            if_=when.any(when("input.vip", "eq", True), when("input.amount", "gt", 100)),
            then=[sdk.handoff("escalate", group="ops")],
            else_=sdk.condition(
                "inner",
                if_=when.not_(when("input.kind", "in", ["spam", "junk"])),
                then=sdk.task("answer"),
            ),
        ),
        lambda: sdk.condition(
            "route",
            if_=when.any(when("input.vip", "eq", True), when("input.amount", "gt", 100)),
            then=[sdk.handoff("escalate", group="ops")],
            else_=sdk.condition(
                "inner",
                if_=when.not_(when("input.kind", "in", ["spam", "junk"])),
                then=sdk.task("answer"),
            ),
        ),
        {
            "id": "route",
            "kind": "condition",
            "if": {
                "any": [
                    {"path": "input.vip", "op": "eq", "value": True},
                    {"path": "input.amount", "op": "gt", "value": 100},
                ]
            },
            "then": [{"id": "escalate", "kind": "handoff", "group": "ops"}],
            "else": [
                {
                    "id": "inner",
                    "kind": "condition",
                    "if": {"not": {"path": "input.kind", "op": "in", "value": ["spam", "junk"]}},
                    "then": [{"id": "answer", "kind": "task"}],
                }
            ],
        },
    ),
    (
        "recipe",
        lambda wf: wf.recipe(
            "ask",
            prompt="Summarise {ticket}",
            model="anthropic:claude-sonnet-4",
            output="json",
            context={"kb": "docs", "query": "${input.ticket}", "top_k": 3},
            retry=RetryPolicy(max_attempts=5, backoff="fixed", initial_ms=100, jitter=False),
        ),
        lambda: sdk.recipe(
            "ask",
            prompt="Summarise {ticket}",
            model="anthropic:claude-sonnet-4",
            output="json",
            context={"kb": "docs", "query": "${input.ticket}", "top_k": 3},
            retry=RetryPolicy(max_attempts=5, backoff="fixed", initial_ms=100, jitter=False),
        ),
        {
            "id": "ask",
            "kind": "recipe",
            "prompt": "Summarise {ticket}",
            "model": "anthropic:claude-sonnet-4",
            "output": "json",
            "context": {"kb": "docs", "query": "${input.ticket}", "top_k": 3},
            "retry": {"max_attempts": 5, "backoff": "fixed", "initial_ms": 100, "jitter": False},
        },
    ),
    (
        "recipe_by_name",
        lambda wf: wf.recipe("ask", recipe="triage"),
        lambda: sdk.recipe("ask", recipe="triage"),
        {"id": "ask", "kind": "recipe", "recipe": "triage"},
    ),
    (
        "http",
        lambda wf: wf.http(
            "call",
            method="POST",
            url="https://api.example.com/${input.id}",
            headers={"X-Trace": "${run.id}"},
            body={"q": "${input.q}"},
            timeout_ms=5_000,
        ),
        lambda: sdk.http(
            "call",
            method="POST",
            url="https://api.example.com/${input.id}",
            headers={"X-Trace": "${run.id}"},
            body={"q": "${input.q}"},
            timeout_ms=5_000,
        ),
        {
            "id": "call",
            "kind": "http",
            "method": "POST",
            "url": "https://api.example.com/${input.id}",
            "headers": {"X-Trace": "${run.id}"},
            "body": {"q": "${input.q}"},
            "timeout_ms": 5_000,
        },
    ),
    (
        "mcp_tool",
        lambda wf: wf.mcp_tool("lookup", server="crm", tool="find", arguments={"q": "${input}"}),
        lambda: sdk.mcp_tool("lookup", server="crm", tool="find", arguments={"q": "${input}"}),
        {
            "id": "lookup",
            "kind": "mcp_tool",
            "server": "crm",
            "tool": "find",
            "arguments": {"q": "${input}"},
        },
    ),
    (
        "write_kb",
        lambda wf: wf.write_kb(
            "remember", kb="faq", key="${input.id}", title="Answer", content="${input.text}"
        ),
        lambda: sdk.write_kb(
            "remember", kb="faq", key="${input.id}", title="Answer", content="${input.text}"
        ),
        {
            "id": "remember",
            "kind": "write_kb",
            "kb": "faq",
            "key": "${input.id}",
            "title": "Answer",
            "content": "${input.text}",
        },
    ),
    (
        "handoff",
        lambda wf: wf.handoff("tell", group="ops", message="Look at ${run.id}"),
        lambda: sdk.handoff("tell", group="ops", message="Look at ${run.id}"),
        {"id": "tell", "kind": "handoff", "group": "ops", "message": "Look at ${run.id}"},
    ),
    (
        "add_raw_dict",
        lambda wf: wf.add({"id": "raw", "kind": "sleep", "ms": 1}),
        lambda: {"id": "raw", "kind": "sleep", "ms": 1},
        {"id": "raw", "kind": "sleep", "ms": 1},
    ),
]
CASE_IDS = [case[0] for case in BUILDER_CASES]


@pytest.mark.parametrize(("name", "build", "construct", "expected"), BUILDER_CASES, ids=CASE_IDS)
def test_builder_method_writes_the_step(
    name: str,
    build: Callable[[sdk.Workflow], Any],
    construct: Callable[[], Any],
    expected: dict[str, Any],
) -> None:
    wf = workflow("w")

    build(wf)

    assert wf.document() == {"id": "w", "steps": [expected]}
    assert construct() == expected


def test_decorators_register_the_function_and_return_it_unchanged() -> None:
    wf = workflow("w")

    def body(ctx: Any, input: Any, prior: Any) -> Any:
        return input

    returned = wf.step("a", input="${input}", queue="io")(body)
    agent_body = wf.agent("b", handler="llm.answer", timeout_ms=30_000)(lambda c, i, p: i)

    assert returned is body
    assert wf.document()["steps"] == [
        {"id": "a", "kind": "task", "input": "${input}", "queue": "io"},
        {"id": "b", "kind": "agent", "handler": "llm.answer", "timeout_ms": 30_000},
    ]
    assert registry.lookup("w", "a") is body
    assert registry.lookup("w", "b", "llm.answer") is agent_body
    assert registry.lookup("w", "b") is agent_body


def test_a_keyword_left_as_none_is_not_written() -> None:
    spec = sdk.task(
        "t",
        handler=None,
        input=None,
        when=None,
        retry=None,
        on_error=None,
        effect=None,
        timeout_ms=None,
        queue=None,
    )
    approval = sdk.approval("a", approvers={"users": ["ada"]}, quorum=None, message=None)

    assert spec == {"id": "t", "kind": "task"}
    assert approval == {"id": "a", "kind": "approval", "approvers": {"users": ["ada"]}}


def test_an_unknown_keyword_is_a_type_error() -> None:
    wf = workflow("w")

    with pytest.raises(TypeError, match="retries"):
        wf.task("t", retries=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        wf.sleep("s", seconds=3)  # type: ignore[call-arg]
    assert wf.document()["steps"] == []


def test_nested_task_handlers_are_registered_without_adding_a_step() -> None:
    wf = workflow("w")
    wf.parallel("fan", branches={"a": sdk.task("fetch_a"), "b": sdk.task("fetch_b", handler="x")})

    @wf.handler("fetch_a")
    def fetch_a(ctx: Any, input: Any, prior: Any) -> Any:
        return "a"

    @sdk.handler("x")
    def fetch_b(ctx: Any, input: Any, prior: Any) -> Any:
        return "b"

    assert [step["id"] for step in wf.document()["steps"]] == ["fan"]
    assert registry.lookup("w", "fetch_a") is fetch_a
    assert registry.lookup("w", "fetch_b", "x") is fetch_b


def test_nested_specs_are_copied_not_shared() -> None:
    inner = sdk.task("inner", input={"a": 1})
    wf = workflow("w")
    wf.foreach("each", items="${input.xs}", do=inner)

    inner["input"]["a"] = 2

    assert wf.document()["steps"][0]["do"] == {"id": "inner", "kind": "task", "input": {"a": 1}}


def test_top_level_fields_are_written_only_when_given_in_the_contract_order() -> None:
    bare = workflow("bare")
    full = workflow(
        "full",
        description="d",
        input_schema={"type": "object"},
        limits={"run_timeout_ms": 1000},
        version=4,
    )
    full.output({"x": "${input.x}"})
    full.sleep("s", ms=1)

    assert bare.document() == {"id": "bare", "steps": []}
    assert list(full.document()) == [
        "id",
        "version",
        "description",
        "input_schema",
        "limits",
        "steps",
        "output",
    ]


def test_document_returns_a_copy() -> None:
    schema = {"type": "object", "properties": {}}
    wf = workflow("w", input_schema=schema)
    wf.task("t", input={"a": [1]})
    wf.output({"o": "${steps.t.output}"})
    schema["properties"]["leak"] = {"type": "string"}

    first = wf.document()
    first["steps"][0]["input"]["a"].append(2)
    first["steps"].append({"id": "x", "kind": "task"})
    first["output"]["o"] = "changed"
    first["input_schema"]["type"] = "array"

    assert wf.document() == {
        "id": "w",
        "input_schema": {"type": "object", "properties": {}},
        "steps": [{"id": "t", "kind": "task", "input": {"a": [1]}}],
        "output": {"o": "${steps.t.output}"},
    }


# --- ids ---------------------------------------------------------------------------------------


def test_a_duplicate_top_level_step_id_raises_naming_it() -> None:
    wf = workflow("w")
    wf.sleep("nap", ms=1)

    with pytest.raises(ValueError, match="'nap'"):
        wf.sleep("nap", ms=2)

    @wf.step("work")
    def work(ctx: Any, input: Any, prior: Any) -> Any:
        return None

    with pytest.raises(ValueError, match="'work'"):

        @wf.step("work")
        def work_again(ctx: Any, input: Any, prior: Any) -> Any:
            return None

    assert [s["id"] for s in wf.document()["steps"]] == ["nap", "work"]
    assert registry.lookup("w", "work") is work


def test_duplicate_ids_in_nested_steps_raise() -> None:
    wf = workflow("w")
    wf.task("fetch")

    with pytest.raises(ValueError, match="'fetch'"):
        wf.parallel("fan", branches={"a": sdk.task("fetch")})
    with pytest.raises(ValueError, match="'x'"):
        wf.parallel("fan", branches={"a": sdk.task("x"), "b": [sdk.sleep("x", ms=1)]})
    with pytest.raises(ValueError, match="'deep'"):
        wf.condition(
            "c",
            if_=when("input.a", "exists"),
            then=[sdk.loop("l", do=sdk.task("deep"), max_iterations=2)],
            else_=[{"id": "deep", "kind": "task"}],
        )
    wf.foreach("each", items="${input.xs}", do=sdk.task("inner"))
    with pytest.raises(ValueError, match="'inner'"):
        wf.task("inner")

    assert [s["id"] for s in wf.document()["steps"]] == ["fetch", "each"]


@pytest.mark.parametrize("bad", ["Upper", "1st", "has-dash", "", "with space"])
def test_ids_must_match_the_pattern(bad: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        workflow(bad)
    with pytest.raises(ValueError, match="must match"):
        sdk.task(bad)
    with pytest.raises(ValueError, match="must match"):
        workflow("w").handler(bad)


# --- guards ----------------------------------------------------------------------------------


def test_when_builds_guards() -> None:
    bug = when("steps.classify.output.kind", "eq", "bug")
    has_ticket = when("input.ticket", "exists")

    assert bug == {"path": "steps.classify.output.kind", "op": "eq", "value": "bug"}
    assert has_ticket == {"path": "input.ticket", "op": "exists"}
    assert when("input.x", "eq", None) == {"path": "input.x", "op": "eq", "value": None}
    assert when.all(bug, has_ticket) == {"all": [bug, has_ticket]}
    assert when.all([bug, has_ticket]) == {"all": [bug, has_ticket]}
    assert when.any(bug, has_ticket) == {"any": [bug, has_ticket]}
    assert when.not_(bug) == {"not": bug}
    assert sdk.all_(bug) == {"all": [bug]}
    assert sdk.any_(bug) == {"any": [bug]}
    assert sdk.not_(when.any(bug, has_ticket)) == {"not": {"any": [bug, has_ticket]}}


def test_guards_are_copied() -> None:
    guard = when("input.tags", "in", ["a"])
    combined = when.all(guard)
    guard["value"].append("b")

    assert combined == {"all": [{"path": "input.tags", "op": "in", "value": ["a"]}]}


@pytest.mark.parametrize("op", ["equals", "EQ", "contains", ""])
def test_a_misspelt_guard_op_is_an_error(op: str) -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        when("input.x", op, 1)


def test_a_guard_combinator_takes_guards_only() -> None:
    with pytest.raises(TypeError):
        when.all("input.x")
    with pytest.raises(TypeError):
        sdk.task("t", when="input.x")  # type: ignore[typeddict-item]


# --- retry policies and failures -------------------------------------------------------------


def test_retry_policy_serialisation_leaves_out_none_fields() -> None:
    assert RetryPolicy(max_attempts=3, backoff="exponential", initial_ms=500).as_dict() == {
        "max_attempts": 3,
        "backoff": "exponential",
        "initial_ms": 500,
    }
    assert RetryPolicy().as_dict() == {"max_attempts": 1, "backoff": "exponential"}
    assert RetryPolicy(5, "fixed", 10, 20, True).as_dict() == {
        "max_attempts": 5,
        "backoff": "fixed",
        "initial_ms": 10,
        "max_ms": 20,
        "jitter": True,
    }


def test_retry_accepts_a_policy_or_a_plain_dict() -> None:
    as_policy = sdk.task("t", retry=RetryPolicy(max_attempts=2, backoff="none"))
    as_dict = sdk.task("t", retry={"max_attempts": 2, "backoff": "none"})

    assert (
        as_policy
        == as_dict
        == {
            "id": "t",
            "kind": "task",
            "retry": {"max_attempts": 2, "backoff": "none"},
        }
    )
    with pytest.raises(TypeError, match="RetryPolicy"):
        sdk.task("t", retry=3)  # type: ignore[typeddict-item]


def test_step_failure_fields() -> None:
    failure = StepFailure("mail relay busy", class_="retryable", retry_after_ms=2_000)

    assert isinstance(failure, Exception)
    assert str(failure) == "mail relay busy"
    assert failure.message == "mail relay busy"
    assert failure.error_class == "retryable"
    assert failure.retry_after_ms == 2_000
    assert failure.as_error() == {"class": "retryable", "message": "mail relay busy"}
    assert StepFailure("no").error_class == "fatal"
    assert StepFailure("no").retry_after_ms is None
    for error_class in ("retryable", "fatal", "invalid_input", "unservable"):
        assert StepFailure("x", error_class).error_class == error_class
    assert StepFailure("x", retry_after_ms=0).retry_after_ms == 0
    assert StepFailure("x", retry_after_ms=315_360_000_000).retry_after_ms == 315_360_000_000


def test_step_failure_survives_pickling() -> None:
    failure = pickle.loads(pickle.dumps(StepFailure("busy", "retryable", 50)))

    assert (failure.message, failure.error_class, failure.retry_after_ms) == (
        "busy",
        "retryable",
        50,
    )


@pytest.mark.parametrize("error_class", ["timeout", "rejected", "Fatal", "", None])
def test_step_failure_rejects_an_unknown_class(error_class: Any) -> None:
    with pytest.raises(ValueError, match="retryable, fatal, invalid_input, unservable"):
        StepFailure("x", class_=error_class)


@pytest.mark.parametrize("value", [-1, 315_360_000_001, 1.5, "100", True])
def test_step_failure_rejects_a_retry_after_out_of_range(value: Any) -> None:
    with pytest.raises(ValueError, match="315360000000") as caught:
        StepFailure("x", class_="retryable", retry_after_ms=value)

    assert repr(value) in str(caught.value)


# --- the registry ----------------------------------------------------------------------------


def _function(module: str, qualname: str) -> Callable[..., Any]:
    def fn(ctx: Any, input: Any, prior: Any) -> Any:
        return None

    fn.__module__ = module
    fn.__qualname__ = qualname
    return fn


def test_registry_lookup_by_step_and_by_name() -> None:
    by_step = _function("m", "by_step")
    by_name = _function("m", "by_name")
    registry.register("wf", "s", by_step)
    registry.register_named("mail.send", by_name)

    assert registry.lookup("wf", "s") is by_step
    assert registry.lookup("wf", "s", "mail.send") is by_name
    assert registry.lookup("wf", "other") is None
    assert registry.lookup("wf", "s", "missing") is None
    assert registry.handler_names() == ["mail.send", "wf.s"]


def test_a_handler_name_of_the_default_form_finds_the_step_handler() -> None:
    """Contract section 1: a task runs the handler for ``handler`` or ``<workflow>.<step>``."""
    fn = _function("m", "fn")
    registry.register("support_ticket", "classify", fn)

    assert registry.lookup("other", "step", "support_ticket.classify") is fn


def test_registering_a_different_function_for_a_key_raises() -> None:
    registry.register("wf", "s", _function("m", "one"))
    registry.register_named("n", _function("m", "one"))

    with pytest.raises(ValueError, match=r"step 's' of workflow 'wf'.*m\.one.*m\.two"):
        registry.register("wf", "s", _function("m", "two"))
    with pytest.raises(ValueError, match="handler name 'n'"):
        registry.register_named("n", _function("other", "one"))


def test_registering_the_same_function_again_is_allowed() -> None:
    fn = _function("m", "fn")
    reloaded = _function("m", "fn")  # what a module reload produces

    registry.register("wf", "s", fn)
    registry.register("wf", "s", fn)
    registry.register("wf", "s", reloaded)

    assert registry.lookup("wf", "s") is reloaded


def test_registering_rejects_what_is_not_callable() -> None:
    with pytest.raises(TypeError):
        registry.register("wf", "s", "workflows.examples.send")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        registry.register_named("", _function("m", "fn"))


def test_a_handler_conflict_leaves_the_document_unchanged() -> None:
    registry.register_named("shared", _function("elsewhere", "fn"))
    wf = workflow("w")

    with pytest.raises(ValueError, match="shared"):
        wf.step("a", handler="shared")(_function("m", "fn"))

    assert wf.document()["steps"] == []


def test_builders_in_creation_order() -> None:
    first = workflow("first")
    second = workflow("second")

    assert registry.builders() == [first, second]
    assert first.module == __name__


def test_a_builder_created_again_by_its_module_replaces_the_old_one() -> None:
    first = workflow("first")
    second = workflow("second")
    again = workflow("first")

    assert registry.builders() == [again, second]
    assert again is not first


def test_a_workflow_id_defined_by_two_modules_raises() -> None:
    workflow("shared_id")

    with pytest.raises(ValueError, match=f"'shared_id'.*'{__name__}'.*'somewhere.else'"):
        sdk.Workflow("shared_id", module="somewhere.else")


def test_clear_forgets_everything() -> None:
    workflow("w").step("a")(_function("m", "fn"))
    registry.clear()

    assert registry.builders() == []
    assert registry.lookup("w", "a") is None


def test_reloading_a_module_replaces_its_builder_and_handlers() -> None:
    module = importlib.import_module(EXAMPLE)
    reloaded = importlib.reload(module)

    assert registry.builders() == [reloaded.support]
    assert registry.lookup("support_ticket", "send") is reloaded.send


# --- start and events, before runs exist -----------------------------------------------------


@pytest.mark.django_db
def test_start_saves_the_builder_once_and_runs_its_version() -> None:
    from runs.models import Run

    wf = workflow("starter", input_schema={"type": "object", "required": ["ticket"]})
    wf.task("only", handler="anything")
    run = wf.start({"ticket": "Q"})
    assert isinstance(run, Run)
    assert (run.workflow_id, run.version.number, run.input) == ("starter", 1, {"ticket": "Q"})
    assert run.status == "running"  # its first step is planned in the same transaction
    # A newer version saved elsewhere does not change what this builder starts.
    definition_save(document={"id": "starter", "steps": [{"id": "other", "kind": "task"}]})
    again = wf.start({"ticket": "Q2"}, idempotency_key="k1")
    assert again.version.number == 1
    assert wf.start({"ticket": "ignored"}, idempotency_key="k1").id == again.id
    assert Run.objects.count() == 2


@pytest.mark.django_db
def test_start_with_bad_input_names_the_field() -> None:
    wf = workflow("strict", input_schema={"type": "object", "required": ["ticket"]})
    wf.task("only", handler="anything")
    with pytest.raises(InvalidInput) as caught:
        wf.start({})
    assert caught.value.errors[0].field == "input.ticket"


# --- validation and saving (needs workflows.validation) --------------------------------------


@pytest.mark.parametrize(("name", "build", "construct", "expected"), BUILDER_CASES, ids=CASE_IDS)
def test_every_built_document_validates(
    name: str,
    build: Callable[[sdk.Workflow], Any],
    construct: Callable[[], Any],
    expected: dict[str, Any],
) -> None:
    wf = workflow("w", input_schema={"type": "object"})
    build(wf)
    document = wf.document()

    assert _validate(copy.deepcopy(document)) == document


def test_the_example_documents_validate() -> None:
    module = importlib.import_module(EXAMPLE)

    assert _validate(module.support.document()) == CONTRACT_DOCUMENT


def test_a_workflow_using_every_kind_validates() -> None:
    wf = workflow(
        "everything",
        description="One of each kind, reading what earlier steps answered.",
        input_schema={
            "type": "object",
            "properties": {"ticket": {"type": "string"}, "urls": {"type": "array"}},
        },
        limits={"run_timeout_ms": 3_600_000, "max_steps": 200},
    )

    @wf.step("classify", retry=RetryPolicy(max_attempts=2))
    def classify(ctx: Any, input: Any, prior: Any) -> Any:
        return {"kind": "bug"}

    @wf.agent("draft", input={"kind": "${steps.classify.output.kind}"})
    def draft(ctx: Any, input: Any, prior: Any) -> Any:
        return "text"

    wf.recipe("summarise", prompt="Summarise", output="json", input="${steps.draft.output}")
    wf.sleep("pause", ms=1_000)
    wf.sleep_until("later", until="${input.at}")
    wf.wait_for("ack", event="ack", key="${input.ticket}", timeout_ms=60_000)
    wf.approval("sign_off", approvers={"users": ["ada"]}, message="OK ${input.ticket}?")
    wf.parallel(
        "fan",
        branches={
            "mail": sdk.handoff("notify", group="ops", message="${steps.draft.output}"),
            "search": sdk.mcp_tool("search", server="crm", tool="find", arguments="${input}"),
        },
    )
    wf.foreach(
        "fetch_all",
        items="${input.urls}",
        do=sdk.http("fetch", method="GET", url="${item}"),
        concurrency=4,
    )
    wf.loop(
        "refine",
        do=sdk.task("improve", input={"n": "${iter.index}", "prev": "${iter.previous}"}),
        max_iterations=3,
        until=when("steps.improve.output.good", "eq", True),
    )
    wf.condition(
        "route",
        if_=when.all(
            when("steps.classify.output.kind", "eq", "bug"),
            when.not_(when("steps.fan.status", "eq", "failed")),
        ),
        then=[sdk.write_kb("remember", kb="bugs", key="${input.ticket}", content="${input}")],
        else_=[sdk.subworkflow("child", workflow="everything")],
        on_error="continue",
    )
    wf.output({"kind": "${steps.classify.output.kind}", "kb": "${steps.remember.output.key}"})

    document = wf.document()

    assert _validate(copy.deepcopy(document)) == document


def test_validation_rejects_what_the_builder_lets_through() -> None:
    wf = workflow("w")
    wf.sleep("nap", ms=315_360_000_001)

    with pytest.raises(InvalidDocument) as caught:
        _validate(wf.document())

    assert [e.field for e in caught.value.errors] == ["steps[0].ms"]


@pytest.mark.django_db
def test_save_twice_returns_the_same_version(user: Any) -> None:
    module = importlib.import_module(EXAMPLE)

    first = module.support.save(user=user)
    second = module.support.save()

    assert first.created is True
    assert second.created is False
    assert first.version.pk == second.version.pk
    assert first.version.number == 1
    assert first.version.created_by == user
    assert first.version.document == {"version": 1, **CONTRACT_DOCUMENT}


@pytest.mark.django_db
def test_save_of_a_changed_builder_creates_the_next_version() -> None:
    wf = workflow("grows")
    wf.sleep("a", ms=1)
    first = wf.save()
    wf.sleep("b", ms=1)
    second = wf.save()

    assert (first.version.number, first.created) == (1, True)
    assert (second.version.number, second.created) == (2, True)


@pytest.mark.django_db
def test_save_of_an_invalid_document_raises_and_stores_nothing() -> None:
    from workflows.models import WorkflowVersion

    wf = workflow("broken")
    wf.task("t", timeout_ms=-1)

    with pytest.raises(InvalidDocument):
        wf.save()
    assert not WorkflowVersion.objects.filter(workflow_id="broken").exists()
