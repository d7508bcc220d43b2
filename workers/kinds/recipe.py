"""``recipe``: render a prompt (a stored recipe's, or the step's own) with the step input,
call the model through its provider's SDK, and answer its text, or its JSON checked against
``output_schema`` (CONTRACT section 10).

One attempt is one durable step: the SDKs' own retries are off (``workers.providers``), and
the step's retry policy (3 attempts, ``min(30 s, 2 s * 2^n + jitter)`` by default) is the only
one. Around each model call, in this order:

1. a slot of the run's account (``workers.slots``): when every slot stays taken for
   ``MODEL_SLOT_WAIT_SECONDS`` the attempt is handed back (``Deferred``), its budget untouched,
   and offered again a moment later, so no worker process idles long waiting for one;
2. the call's worst case reserved against ``max_cost_usd`` (``runs.engine.costs``): a call
   that does not fit is never made, and the step fails with class ``limit``, which fails the
   run naming the limit;
3. the call; what it asked and answered, its tokens, latency and cost are kept on the attempt
   (``ctx.model_calls``) and recorded, the reservation settled to the actual cost, in the
   transaction that records the attempt (``runs.engine.calls``): a call costs no transaction
   of its own. A worker lost before then leaves the reservation held, and the reconciler
   charges it at its worst case.

A JSON reply that does not parse, or does not validate against ``output_schema``, is asked
for once more with the error; a second bad reply fails the step with class
``invalid_output`` (never retried: the same prompt would likely fail the same way).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from decimal import Decimal
from functools import partial
from itertools import islice
from typing import Any

from django.conf import settings
from django.utils import timezone

from runs.engine import calls, costs
from workflows import kb_search, kinds, recipes
from workflows.errors import InvalidDocument, echo
from workflows.failures import BudgetWait, Deferred, KindFailure
from workflows.input_schema import input_validator
from workflows.kinds import Kind, Role
from workflows.models import KnowledgeBase, Recipe
from workflows.templates import TooLarge, interpolate

from .. import kb_embed, pricing, providers
from ..context import StepContext
from ..slots import SlotsBusy, slots

# What the model is told when its JSON reply failed; the error follows.
REASK = (
    "Your reply could not be used: {problem}. Answer again with only the JSON value, no other text."
)
# A reply wrapped in a Markdown code fence (models do it when asked for JSON) is unwrapped.
_FENCED = re.compile(r"^\s*```(?:json)?\s*\n(.*?)\n?```\s*$", re.DOTALL)
# Passages a context retrieves when it gives no top_k.
DEFAULT_TOP_K = 5
# Time kept back from the attempt's deadline for recording the call after it.
_RECORD_SECONDS = 1.0


class _Unready(Exception):
    """What stops a recipe step before its first call, by the step's field: a start refuses
    it (pre-flight), a step that meets it anyway fails naming it (a subworkflow's steps
    are not checked at the start, and a recipe or a provider may go meanwhile)."""

    def __init__(self, problems: list[tuple[str, str]], *, class_: str = "fatal") -> None:
        super().__init__("; ".join(f"{field}: {message}" for field, message in problems))
        self.problems = problems
        self.class_ = class_


def _ready(step: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The recipe the step runs and its model's name, or _Unready."""
    stored = None
    if "recipe" in step:
        found = Recipe.objects.resolve(step["recipe"], step.get("recipe_version"))
        if found is None:
            raise _Unready([("recipe", f"{_named(step)} does not exist")])
        stored = found.document
    try:
        recipe = recipes.recipe_of_step(step, stored)
    except InvalidDocument as invalid:
        # A stored recipe the step's overrides do not fit (checked at save for inline ones).
        problems = [(error.field or "recipe", error.message) for error in invalid.errors]
        raise _Unready(problems, class_="invalid_input") from None
    model = recipe.get("model") or providers.default_model()
    if not model:
        why = "names no model, nor does its recipe, and DJFLOW_DEFAULT_MODEL is unset"
        raise _Unready([("model", why)])
    unconfigured = providers.unconfigured(model)
    if unconfigured:
        field = "recipe" if stored is not None and "model" not in step else "model"
        raise _Unready([(field, f"model '{model}': {unconfigured}")])
    return recipe, model


def preflight(step: Mapping[str, Any], scope: kinds.PreflightScope) -> list[tuple[str, str]]:
    """What a start can know (``workflows.preflight``): the named recipe exists, the model's
    provider is configured, and the context's knowledge base exists or an earlier step of
    the document writes it (a ``write_kb`` naming it literally)."""
    problems = []
    try:
        _ready(step)
    except _Unready as unready:
        problems += unready.problems
    context = step.get("context")
    if isinstance(context, Mapping) and isinstance(context.get("kb"), str):
        name = context["kb"]
        written = any(other.get("kb") == name for other in scope.earlier_of("write_kb"))
        if not written and not KnowledgeBase.objects.filter(name=name).exists():
            problems.append(
                (
                    "context.kb",
                    f"knowledge base '{echo(name)}' does not exist, and no earlier "
                    "write_kb step of this workflow writes it",
                )
            )
    return problems


def body_of(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any]:
    return partial(run_recipe, step)


def run_recipe(step: Mapping[str, Any], ctx: StepContext, input: Any, prior: Any) -> Any:
    try:
        recipe, model_name = _ready(step)
    except _Unready as unready:
        raise KindFailure(f"recipe: {unready}", class_=unready.class_) from None
    context, retrieved = "", None
    if "context" in step:
        context, retrieved = _retrieve(ctx, step["context"], input)
    try:
        rendered = recipes.render(recipe, input, context)
    except recipes.RenderTooLarge as error:
        raise KindFailure(f"recipe: {error}", class_="invalid_input") from None
    _, model = providers.split_model(model_name)
    wants_json = recipe.get("output") == "json"
    request = providers.ModelRequest(
        model=model,
        messages=[{"role": "user", "content": rendered.prompt}],
        system=rendered.system,
        max_tokens=int(recipe.get("max_tokens", recipes.DEFAULT_MAX_TOKENS)),
        temperature=recipe.get("temperature"),
        json=wants_json,
        json_schema=recipe.get("output_schema"),
    )
    wait = settings.DJFLOW["MODEL_SLOT_WAIT_SECONDS"]
    # One slot for the whole attempt, taken before its first call: an attempt is never handed
    # back after a call it made (its retry would make and pay for that call again).
    with contextlib.ExitStack() as slot:
        try:
            slot.enter_context(slots().held(ctx.account, wait_seconds=wait))
        except SlotsBusy:
            # Offered again in 1 to 3 s: spread, so the waiters do not all come back at once.
            seconds = 1.0 + 2.0 * random.random()
            raise Deferred(
                f"every model slot of account '{ctx.account}' is taken", seconds=seconds
            ) from None
        return _ask(ctx, model_name, request, recipe, retrieved)


def _ask(
    ctx: StepContext,
    model_name: str,
    request: providers.ModelRequest,
    recipe: Mapping[str, Any],
    retrieved: dict[str, Any] | None = None,
) -> Any:
    reply = _call(ctx, model_name, request, recipe, retrieved)
    if not request.json:
        return reply.text
    value, problem = _parse(reply.text, recipe.get("output_schema"))
    if problem is None:
        return value
    again = replace(
        request,
        messages=[
            *request.messages,
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": REASK.format(problem=problem)},
        ],
    )
    reply = _call(ctx, model_name, again, recipe, retrieved)
    value, problem = _parse(reply.text, recipe.get("output_schema"))
    if problem is None:
        return value
    raise KindFailure(
        f"recipe: the model's reply is not the JSON asked for, also when asked again: {problem}",
        class_="invalid_output",
    )


def _named(step: Mapping[str, Any]) -> str:
    version = step.get("recipe_version")
    return f"recipe '{step['recipe']}'" + (f" version {version}" if version else "")


def _call(
    ctx: StepContext,
    model_name: str,
    request: providers.ModelRequest,
    recipe: Mapping[str, Any],
    retrieved: dict[str, Any] | None = None,
) -> providers.ModelReply:
    provider, model = providers.split_model(model_name)
    request = replace(request, timeout_s=_seconds_left(ctx))
    worst = pricing.worst_case_cost(
        provider,
        model,
        input_tokens=providers.estimate_input_tokens(request),
        max_tokens=request.max_tokens,
    )
    return _reserved_call(ctx, provider, model_name, request, worst, recipe, retrieved)


def _over_budget(ctx: StepContext, over: costs.OverBudget) -> Exception:
    """What a call that does not fit a budget does to its attempt (CONTRACT section 17):
    under ``limits.on_budget: "wait"`` (the default) it waits for budget, holding no worker;
    under "fail", or when waiting would not help (the model has no price), or once the
    attempt has made a call (handed back, its retry would make and pay for that call again),
    it fails with class ``budget_exceeded``."""
    message = f"recipe: call not made: {over}"
    waits = costs.on_budget(run_id=ctx.run_id) == "wait"
    if over.wait is not None and not ctx.model_calls and waits:
        return BudgetWait(message, wait=over.wait)
    return KindFailure(message, class_="budget_exceeded")


def _reserved_call(
    ctx: StepContext,
    provider: str,
    model_name: str,
    request: providers.ModelRequest,
    worst: Decimal | None,
    recipe: Mapping[str, Any],
    retrieved: dict[str, Any] | None = None,
) -> providers.ModelReply:
    try:
        reservation = costs.reserve(
            step_run_id=ctx.step_run_id, run_id=ctx.run_id, amount=worst, what=model_name
        )
    except costs.OverBudget as over:
        raise _over_budget(ctx, over) from None
    # The prompt as sent, after templates; a secret of the run in it is stored as its token.
    prompt = ctx.conceal({"system": request.system, "messages": request.messages})
    with ctx.span("model_call", kind="model_generation") as span:
        span.set_model(request.model, provider)
        # What was asked, in the GenAI semantic conventions (the trace shows them too).
        span.set_attribute("gen_ai.request.max_tokens", request.max_tokens)
        if request.temperature is not None:
            span.set_attribute("gen_ai.request.temperature", request.temperature)
        started = time.monotonic()

        def made(charged: Decimal | None, **call: Any) -> None:
            """Keep the call to be recorded with the attempt, and what it is charged."""
            span.charged = charged if charged is not None else Decimal(0)
            ctx.model_calls.append(
                (
                    reservation,
                    calls.Call(
                        provider=provider,
                        model=request.model,
                        prompt=prompt,
                        latency_ms=_ms_since(started),
                        cost_usd=charged,
                        recipe=recipe.get("name", ""),
                        recipe_version=recipe.get("version"),
                        retrieved=retrieved,
                        **call,
                    ),
                )
            )

        try:
            reply = providers.call(model_name, request)
        except providers.ModelError as error:
            span.set_attribute("error.type", error.error_class)
            # Failed with an answer (or none reached the provider): charged nothing. The
            # provider's message may echo what it was sent.
            made(
                None,
                reply=None,
                status=error.error_class,
                error=ctx.conceal({"class": error.error_class, "message": str(error)}),
            )
            raise KindFailure(
                f"recipe: {error}", class_=error.error_class, retry_after_ms=error.retry_after_ms
            ) from None
        except BaseException as interrupted:
            # The attempt's time limit (SIGALRM) or anything else cut the call short: the
            # provider may still answer and bill it, so the call is charged its worst case
            # (what was reserved), never nothing, and recorded as interrupted.
            made(
                reservation.amount if worst is not None else None,
                reply=None,
                status="interrupted",
                error={"class": "interrupted", "message": type(interrupted).__name__},
            )
            raise
        cost = pricing.call_cost(
            provider,
            request.model,
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            cached_tokens=reply.cached_tokens,
        )
        usage = {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens}
        for name in ("cached_tokens", "reasoning_tokens"):
            if getattr(reply, name) is not None:
                usage[name] = getattr(reply, name)
        span.set_usage(**usage)
        if cost is None:
            span.set_attribute("priced", False)
        span.set_attribute("gen_ai.response.model", reply.model)
        if reply.stop_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [reply.stop_reason])
        if reply.request_id:
            span.set_attribute("gen_ai.response.id", reply.request_id)
        # Charged with the reservation's settling, when the attempt is recorded: the
        # record's own charge (spans priced from their usage) leaves this one out.
        made(
            cost,
            reply=ctx.conceal({"text": reply.text}),
            status="ok",
            answered_by=reply.model,
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            cached_tokens=reply.cached_tokens,
            reasoning_tokens=reply.reasoning_tokens,
            request_id=reply.request_id or "",
        )
        return reply


def _retrieve(
    ctx: StepContext, context: Mapping[str, Any], step_input: Any
) -> tuple[str, dict[str, Any]]:
    """The text for ``${context}`` and what was retrieved for it (recorded with each model
    call of the attempt, and as a ``retrieval`` span): the ``top_k`` best current documents of
    the context's knowledge base for its query, any of the query's words matching (its
    default, the whole step input, would rarely hold every word of a passage).

    With ``DJFLOW_EMBEDDINGS_MODEL`` set and vectors stored (``kb_embed.hybrid_model``), the
    query is embedded here, in the worker (a ``query_embedding`` span with its model and
    tokens, so the attempt's cost includes it), and the search is hybrid: each hit also
    records its rank in the full-text and the vector ranking. A query the provider refuses
    (``fatal``) falls back to full text, saying why on the record; a retryable failure fails
    the attempt as retryable (its retry policy decides)."""
    name = context["kb"]
    kb = KnowledgeBase.objects.filter(name=name).first()
    if kb is None:
        # Pre-flight checked it at the start, unless the step is a subworkflow's or the
        # earlier write_kb that was to create it wrote nothing.
        raise KindFailure(
            f"recipe: context.kb: knowledge base '{echo(name)}' does not exist", class_="fatal"
        )
    query = _query(context, step_input)
    top_k = int(context.get("top_k", DEFAULT_TOP_K))
    record: dict[str, Any] = {"kb": name, "query": ctx.conceal(query), "search": "fulltext"}
    embedding = None
    model = kb_embed.hybrid_model() if kb_search.words(query) else None
    if model is not None:
        embedding, fallback = _embed_query(ctx, model, query)
        record["search"] = "hybrid" if embedding is not None else "fulltext"
        if fallback:
            record["fallback"] = fallback
    with ctx.span("retrieval", "retrieval", kb=name, top_k=top_k) as span:
        hits = kb_search.search(
            kb,
            query,
            top_k,
            match="any",
            backend="hybrid" if embedding is not None else "fulltext",
            embedding=embedding,
        )
        text, used = format_context(hits, settings.DJFLOW["KB_CONTEXT_MAX_BYTES"])
        shown = [_shown_hit(hit) for hit in used]
        span.set_attribute("query", ctx.conceal(query))
        span.set_attribute("search", record["search"])
        span.set_attribute("hits", shown)
    return text, {**record, "hits": shown}


def _shown_hit(hit: kb_search.Hit) -> dict[str, Any]:
    shown: dict[str, Any] = {"key": hit.key, "version": hit.version, "score": round(hit.score, 6)}
    if hit.ranks is not None:
        fulltext, vector = hit.ranks
        shown["ranks"] = {"fulltext": fulltext, "vector": vector}
    return shown


def _embed_query(
    ctx: StepContext, model: providers.EmbeddingsModel, query: str
) -> tuple[kb_search.QueryEmbedding | None, str | None]:
    """The query's embedding (None and why, when the provider refuses it)."""
    provider, model_part = providers.split_model(model.name)
    with ctx.span("query_embedding", "embedding") as span:
        span.set_model(model_part, provider)
        try:
            reply = providers.embed(
                model.name, [query], dimensions=model.dimensions, timeout_s=_seconds_left(ctx)
            )
        except providers.ModelError as error:
            if error.error_class == "retryable":
                raise KindFailure(
                    f"recipe: context: embedding the query: {error}",
                    class_="retryable",
                    retry_after_ms=error.retry_after_ms,
                ) from None
            ctx.logger.warning("query embedding refused, full-text retrieval only: %s", error)
            return None, f"the query could not be embedded: {error}"
        span.set_usage(input_tokens=reply.input_tokens)
        span.set_attribute("dimensions", reply.dimensions)
    [vector] = reply.vectors
    return kb_search.QueryEmbedding(model.name, vector), None


def _query(context: Mapping[str, Any], step_input: Any) -> str:
    """The context's query rendered against the step input (as the prompt is), else the step
    input itself: text as it is, anything else as its compact JSON; cut to what a search
    reads."""
    limit = kb_search.MAX_QUERY_CHARS
    if "query" in context:
        try:
            rendered = interpolate(
                context["query"], {"input": step_input}, max_bytes=recipes.MAX_RENDERED_BYTES
            )
        except TooLarge:
            raise KindFailure(
                f"recipe: context.query: the rendered query is over "
                f"{recipes.MAX_RENDERED_BYTES} bytes",
                class_="invalid_input",
            ) from None
        return rendered[:limit]
    if isinstance(step_input, str):
        return step_input[:limit]
    return json.dumps(step_input, separators=(",", ":"), ensure_ascii=False)[:limit]


def format_context(hits: list[kb_search.Hit], max_bytes: int) -> tuple[str, list[kb_search.Hit]]:
    """``[title] content`` blocks, best first, separated by blank lines, at most ``max_bytes``
    of UTF-8 in all: the passages that fit whole, and the first that does not cut to what is
    left (it still says something); the rest left out. Answers the text and the hits in it."""
    blocks: list[str] = []
    used: list[kb_search.Hit] = []
    left = max_bytes
    for hit in hits:
        block = f"[{hit.title or hit.key}] {hit.content}"
        size = len(block.encode("utf-8", "surrogatepass")) + (2 if blocks else 0)
        if size > left:
            room = left - (2 if blocks else 0)
            if room > 0:
                blocks.append(block.encode("utf-8")[:room].decode("utf-8", "ignore"))
                used.append(hit)
            break
        blocks.append(block)
        used.append(hit)
        left -= size
    return "\n\n".join(blocks), used


def _parse(text: str, schema: Any) -> tuple[Any, str | None]:
    """The reply's JSON value and None, or None and what is wrong with it."""
    fenced = _FENCED.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except ValueError as error:
        return None, f"it is not JSON ({error})"
    if schema is None:
        return value, None
    # Only the first problem is reported: looking for more than a few is work for nothing.
    found = sorted(
        islice(input_validator(schema).iter_errors(value), 10), key=lambda e: list(e.path)
    )
    if not found:
        return value, None
    first = found[0]
    where = "/".join(str(part) for part in first.absolute_path) or "the value"
    return None, f"it does not match output_schema at {where}: {first.message[:300]}"


def _seconds_left(ctx: StepContext) -> float:
    if ctx.deadline_at is None:
        return 60.0
    left = (ctx.deadline_at - timezone.now()).total_seconds() - _RECORD_SECONDS
    return max(left, 0.5)


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


RECIPE = kinds.register(
    Kind("recipe", Role.WORKER, max_attempts=3, body=body_of, preflight=preflight)
)
