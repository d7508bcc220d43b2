"""What a run of a workflow document will do and cost, before it starts (contract section 17).

Pure: a document, the run's input and a few callables in (prices, recipes, child documents,
the workflow's history), a :class:`Forecast` out; no Django, no database (import-linter
keeps it so). ``POST /api/v1/runs/forecast``, the start page and the admin ask it through
``runs.forecasts``, and the save-time check of the worst-case step count
(``workflows.validation``) walks the same way without prices.

What it counts, as the engine counts it (``runs.engine.plan``):

* ``steps``: attempts as ``limits.max_steps`` counts them (``_counts_as_attempt``): every
  attempt of a worker, wait, people or subworkflow step, and the row that starts a body of
  several steps (an anonymous child run); a composite step's own row and a condition's are
  not counted. A subworkflow's child run counts too: the root's ``max_steps`` bounds its
  whole tree.
* bounds: a ``foreach`` runs ``do`` for each item: exactly the length of a literal list, or
  of ``${input.<path>}`` when the input is given, else 0 to ``max_items`` (1,000 by
  default: the planner refuses more); a ``loop`` 1 to ``max_iterations`` times
  (``max_iterations`` exactly without ``until``); a ``condition`` the cheaper branch for the
  minimum, the dearer for the maximum; a step with ``when`` may be skipped (minimum 0); a
  worker or subworkflow step 1 to ``retry.max_attempts`` attempts (its kind's default, 3 for
  ``recipe``, ``http`` and ``write_kb``); the run's ``on_failure`` steps add to the maximum.
* a ``recipe`` call's worst case as the engine reserves it: the prompt's tokens estimated
  as the engine estimates them (``workers.providers.estimate_input_tokens``: a token per
  byte, plus the messages' framing) at the input price, plus ``max_tokens`` at the output
  price; a JSON recipe may ask once more (its reply and the complaint sent back with the
  prompt). The prompt is the template as written: values a run substitutes into it (its
  input, retrieved context) are not known before the run. Its least: the template's literal
  text at four bytes a token, no output.
* ``expected``: the median of the workflow's last completed runs (``history``); without
  history, the midpoint of min and max (unknown when max is).

A maximum that cannot be known is ``None`` and ``unbounded`` says why (an ``agent`` step's
model use, a model without a price, a recipe or child workflow that cannot be found, a
workflow that starts itself).

Invariant: min <= max wherever max is known, for every step and for the totals. The walk is
linear in the document's size times the depth of its subworkflows: a 500-step document
forecasts in a median 12 to 14 ms on this 2-core machine under other test runs' load
(``bench/forecast.py``, 2026-12-08; the goal is under 50 ms).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from . import kinds
from .schema import DEFAULT_MAX_ITEMS
from .templates import REFERENCE, is_valid_path, split_path

__all__ = [
    "DEFAULT_MAX_STEPS",
    "MAX_DEPTH",
    "Forecast",
    "Sources",
    "StepForecast",
    "forecast",
]

# limits.max_steps when a document gives none (runs.engine.plan.DEFAULT_MAX_STEPS; a test
# holds them equal: this layer may not import the planner).
DEFAULT_MAX_STEPS = 1000
# The longest chain of subworkflows (runs.kinds.subworkflow.MAX_SUBWORKFLOW_DEPTH; a test
# holds them equal).
MAX_DEPTH = 8
# The recipe defaults (workflows.recipes.DEFAULT_MAX_TOKENS is what a normalised recipe has).
DEFAULT_RECIPE_MAX_TOKENS = 1024
# The least a token holds, for the least a call costs: about four bytes of English text.
BYTES_PER_TOKEN = 4
# A JSON recipe's second call sends its first reply back (at most max_tokens of text, at
# BYTES_PER_TOKEN bytes each, counted a token per byte as the engine estimates) and the
# complaint (workers.kinds.recipe.REASK with the parser's problem: bounded by this).
REASK_BYTES = 2048
# The messages' framing in the engine's estimate (workers.providers.base).
PER_MESSAGE_TOKENS = 8
PER_REQUEST_TOKENS = 16

ZERO = Decimal(0)

# (model "<provider>:<model>", input tokens, output tokens) -> USD, None when unpriced.
Price = Callable[[str, int, int], "Decimal | None"]
# A recipe step -> the recipe it runs (as workflows.recipes.recipe_of_step, with its model
# resolved: the deployment's default when neither names one), None when it cannot be found.
RecipeOf = Callable[[Mapping[str, Any]], "Mapping[str, Any] | None"]
# (workflow id, pinned version or None) -> the child's document, None when not found.
ChildOf = Callable[[str, "int | None"], "Mapping[str, Any] | None"]
# (system, [message texts]) -> input tokens as the engine estimates them.
Tokens = Callable[[str, Sequence[str]], int]


def estimate_tokens(system: str, messages: Sequence[str]) -> int:
    """``workers.providers.estimate_input_tokens`` over plain texts: a token per UTF-8 byte
    (byte-level BPE never packs less), plus each message's framing."""
    size = len(system.encode()) + sum(len(text.encode()) for text in messages)
    return size + PER_MESSAGE_TOKENS * (len(messages) + 1) + PER_REQUEST_TOKENS


@dataclass(frozen=True)
class Sources:
    """What the forecast may know besides the document. Without ``price`` no cost is
    forecast (the save-time check counts steps only)."""

    price: Price | None = None
    recipe_of: RecipeOf | None = None
    child_of: ChildOf | None = None
    tokens: Tokens = estimate_tokens
    # {step_id: [cost of each of the last completed runs that had it]} and how many runs
    # were read: a run without a step's rows cost nothing there.
    history: Mapping[str, Sequence[Decimal]] = field(default_factory=dict)
    history_totals: Sequence[Decimal] = ()
    # The run's input, when the caller gives one (``input_given``: null is an input too).
    input: Any = None
    input_given: bool = False
    # The save-time check counts only bounds an author wrote: a foreach without max_items
    # (1,000 by default, at run time) is then not a known worst case. Most documents that
    # fan out over a step's output give none, and every one of them with a step more would
    # pass limits.max_steps' default of 1,000; the run's own count still stops them.
    stated_bounds_only: bool = False
    # Whether a step's retries count (the forecast's max) or its first attempt only (the
    # save-time check: the contract's worst case is bounds x bodies; a retry happens on a
    # failure, and a storm of them is what limits.max_steps stops at run time).
    count_retries: bool = True


@dataclass
class StepForecast:
    step_id: str
    kind: str
    # Where the step is in the document ("steps[2].do").
    field: str
    attempts_min: int = 0
    attempts_max: int | None = 0
    calls_min: int = 0
    calls_max: int | None = 0
    cost_min: Decimal = ZERO
    cost_expected: Decimal | None = ZERO
    cost_max: Decimal | None = ZERO
    # How attempts_max is made ("1000 items (steps[2].max_items) x 3 attempts (...)").
    how: str = ""
    # The field whose bound multiplies this step the most (for a save-time error).
    bound_field: str = ""


@dataclass
class Forecast:
    steps_min: int
    steps_max: int | None
    cost_min: Decimal
    cost_expected: Decimal | None
    cost_max: Decimal | None
    per_step: list[StepForecast]
    unbounded: list[str]

    def as_json(self) -> dict[str, Any]:
        """The API's answer; money as numbers (the API's cost_usd is one everywhere)."""
        return {
            "steps": {"min": self.steps_min, "max": self.steps_max},
            "cost_usd": _money(self.cost_min, self.cost_expected, self.cost_max),
            "per_step": [
                {
                    "step_id": step.step_id,
                    "kind": step.kind,
                    "field": step.field,
                    "attempts": {"min": step.attempts_min, "max": step.attempts_max},
                    "calls": {"min": step.calls_min, "max": step.calls_max},
                    "cost_usd": _money(step.cost_min, step.cost_expected, step.cost_max),
                }
                for step in self.per_step
            ],
            "unbounded": list(self.unbounded),
        }


def _money(low: Decimal, expected: Decimal | None, high: Decimal | None) -> dict[str, Any]:
    def shown(value: Decimal | None) -> float | None:
        return None if value is None else float(value.quantize(Decimal("0.000001")))

    return {"min": shown(low), "expected": shown(expected), "max": shown(high)}


def forecast(document: Mapping[str, Any], sources: Sources | None = None) -> Forecast:
    """The forecast of one run of ``document`` (see the module's docstring)."""
    sources = sources or Sources()
    walk = _Walk(sources, depth=0, chain=(str(document.get("id", "")),), record=True)
    total = walk.document(document, given_input=sources.input_given)
    for step in walk.per_step:
        step.cost_expected = _expected(step, sources)
    if sources.history_totals:
        expected: Decimal | None = _median(sources.history_totals)
    else:
        expected = _midpoint(total.cost_min, total.cost_max)
    return Forecast(
        steps_min=total.attempts_min,
        steps_max=total.attempts_max,
        cost_min=total.cost_min,
        cost_expected=expected,
        cost_max=total.cost_max,
        per_step=walk.per_step,
        unbounded=_unique(walk.unbounded),
    )


# --- arithmetic with an unknown maximum ------------------------------------------------------


def _times(a: int | None, b: int | None) -> int | None:
    if a == 0 or b == 0:
        return 0
    return None if a is None or b is None else a * b


def _plus(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a + b


def _larger(a: Any, b: Any) -> Any:
    return None if a is None or b is None else max(a, b)


def _money_times(cost: Decimal | None, count: int | None) -> Decimal | None:
    if count == 0:
        return ZERO
    return None if cost is None or count is None else cost * count


def _median(values: Sequence[Decimal]) -> Decimal:
    return Decimal(statistics.median(values))


def _midpoint(low: Decimal, high: Decimal | None) -> Decimal | None:
    return None if high is None else (low + high) / 2


def _expected(step: StepForecast, sources: Sources) -> Decimal | None:
    runs = len(sources.history_totals)
    if runs:
        seen = list(sources.history.get(step.step_id, ()))[:runs]
        # A run without rows of this step (a branch not taken) spent nothing on it.
        return _median(seen + [ZERO] * (runs - len(seen)))
    return _midpoint(step.cost_min, step.cost_max)


def _unique(reasons: list[str]) -> list[str]:
    return list(dict.fromkeys(reasons))


# --- the walk ----------------------------------------------------------------------------


@dataclass
class _Sum:
    """What some steps do for the times their container runs."""

    attempts_min: int = 0
    attempts_max: int | None = 0
    calls_min: int = 0
    calls_max: int | None = 0
    cost_min: Decimal = ZERO
    cost_max: Decimal | None = ZERO

    def add(self, other: _Sum) -> None:
        self.attempts_min += other.attempts_min
        self.attempts_max = _plus(self.attempts_max, other.attempts_max)
        self.calls_min += other.calls_min
        self.calls_max = _plus(self.calls_max, other.calls_max)
        self.cost_min += other.cost_min
        self.cost_max = _plus(self.cost_max, other.cost_max)

    def either(self, other: _Sum) -> _Sum:
        """One of two branches: the cheaper's least, the dearer's most."""
        return _Sum(
            min(self.attempts_min, other.attempts_min),
            _larger(self.attempts_max, other.attempts_max),
            min(self.calls_min, other.calls_min),
            _larger(self.calls_max, other.calls_max),
            min(self.cost_min, other.cost_min),
            _larger(self.cost_max, other.cost_max),
        )


@dataclass(frozen=True)
class _Times:
    """How many times a body runs in one run: ``low`` at least (``shown`` is what its steps
    show as their least: 0 in a branch that may not be taken), ``high`` at most, and how."""

    low: int
    high: int | None
    shown: int
    factors: tuple[str, ...] = ()
    bound_field: str = ""

    def by(self, low: int, high: int | None, factor: str = "", bound_field: str = "") -> _Times:
        return _Times(
            self.low * low,
            _times(self.high, high),
            self.shown * low,
            (*self.factors, factor) if factor else self.factors,
            bound_field or self.bound_field,
        )

    def optional(self) -> _Times:
        """A step that may be skipped (``when``): it may not run at all."""
        return _Times(0, self.high, 0, self.factors, self.bound_field)

    def branch(self) -> _Times:
        """A condition's branch: it may not be taken, so its steps show 0 as their least,
        but one of the two runs whenever the condition does."""
        return _Times(self.low, self.high, 0, self.factors, self.bound_field)


_ONCE = _Times(1, 1, 1)
_LEAF_ROLES = frozenset({kinds.Role.WORKER, kinds.Role.WAIT, kinds.Role.PEOPLE, kinds.Role.CHILD})


class _Walk:
    def __init__(
        self, sources: Sources, *, depth: int, chain: tuple[str, ...], record: bool
    ) -> None:
        self.sources = sources
        self.depth = depth
        # The workflows from the root down to this one: one that comes again recurses.
        self.chain = chain
        # Only the root's steps are listed; a child's are summed into its subworkflow step.
        self.record = record
        self.per_step: list[StepForecast] = []
        self.unbounded: list[str] = []
        self.input: Any = None
        self.given_input = False

    def document(self, document: Mapping[str, Any], *, given_input: bool) -> _Sum:
        self.given_input = given_input
        self.input = self.sources.input if given_input else None
        total = self.steps(document.get("steps") or [], "steps", _ONCE)
        handler = document.get("on_failure")
        if isinstance(handler, list):
            # The handler runs only when a step fails the run: nothing at least.
            total.add(self.steps(handler, "on_failure", _ONCE.optional()))
        return total

    def steps(self, steps: Any, where: str, times: _Times) -> _Sum:
        total = _Sum()
        for index, step in enumerate(steps if isinstance(steps, list) else []):
            if isinstance(step, Mapping):
                total.add(self.step(step, f"{where}[{index}]", times))
        return total

    def body(self, body: Any, where: str, times: _Times) -> _Sum:
        """A ``do`` or a branch: one step, or a list of several run as a body run (whose
        starting row counts once each time)."""
        if isinstance(body, list) and len(body) > 1:
            total = _Sum(times.low, times.high)
            total.add(self.steps(body, where, times))
            return total
        one = body[0] if isinstance(body, list) and body else body
        if not isinstance(one, Mapping):
            return _Sum()
        return self.step(one, f"{where}[0]" if isinstance(body, list) else where, times)

    def step(self, step: Mapping[str, Any], where: str, times: _Times) -> _Sum:
        if "when" in step:
            times = times.optional()
        kind = str(step.get("kind", ""))
        if kind == "condition":
            then = self.steps(step.get("then"), f"{where}.then", times.branch())
            otherwise = self.steps(step.get("else"), f"{where}.else", times.branch())
            return then.either(otherwise)
        if kind == "parallel":
            total = _Sum()
            branches = step.get("branches")
            for name, body in (branches if isinstance(branches, Mapping) else {}).items():
                total.add(self.body(body, f"{where}.branches.{name}", times))
            return total
        if kind == "foreach":
            return self.body(step.get("do"), f"{where}.do", self._items(step, where, times))
        if kind == "loop":
            return self.body(step.get("do"), f"{where}.do", self._iterations(step, where, times))
        return self.leaf(step, kind, where, times)

    def _items(self, step: Mapping[str, Any], where: str, times: _Times) -> _Times:
        limit = step.get("max_items", DEFAULT_MAX_ITEMS)
        known = self._known_items(step.get("items"))
        if known is not None:
            count = min(known, limit) if isinstance(limit, int) else known
            return times.by(count, count, f"{count} items ({where}.items)", f"{where}.items")
        if "max_items" not in step and self.sources.stated_bounds_only:
            self.unbounded.append(f"{where}: a foreach without max_items")
            return times.by(0, None)
        given = "" if "max_items" in step else f", not given: {DEFAULT_MAX_ITEMS} by default"
        factor = f"{limit} items ({where}.max_items{given})"
        return times.by(0, limit, factor, f"{where}.max_items")

    def _known_items(self, items: Any) -> int | None:
        if isinstance(items, list):
            return len(items)
        if not (isinstance(items, str) and self.given_input):
            return None
        found = REFERENCE.fullmatch(items.strip())
        path = found.group("path") if found else ""
        if not is_valid_path(path):
            return None
        parts = split_path(path)
        if parts[0] != "input":
            return None
        value = self.input
        for part in parts[1:]:
            if isinstance(value, Mapping):
                value = value.get(part)
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                return None
        return len(value) if isinstance(value, list) else None

    def _iterations(self, step: Mapping[str, Any], where: str, times: _Times) -> _Times:
        bound = step.get("max_iterations")
        if not isinstance(bound, int) or bound < 1:
            return times.by(0, None)
        least = 1 if "until" in step else bound
        factor = f"{bound} iterations ({where}.max_iterations)"
        return times.by(least, bound, factor, f"{where}.max_iterations")

    def leaf(self, step: Mapping[str, Any], kind: str, where: str, times: _Times) -> _Sum:
        step_id = str(step.get("id", ""))
        registered = kinds.get(kind)
        if registered is not None and registered.role not in _LEAF_ROLES:
            return _Sum()  # a registered holder of other steps this walk does not know
        retry = step.get("retry")
        policy = retry if isinstance(retry, Mapping) else {}
        default = registered.max_attempts if registered is not None else 1
        tries = policy.get("max_attempts", default)
        tries = tries if isinstance(tries, int) and tries >= 1 else 1
        if not self.sources.count_retries:
            tries = 1
        if tries > 1:
            said = "retry.max_attempts" if "max_attempts" in policy else f"the {kind} default"
            times_tried = times.by(1, tries, f"{tries} attempts ({where}: {said})")
        else:
            times_tried = times
        total = _Sum(times_tried.low, times_tried.high)
        own = StepForecast(
            step_id,
            kind,
            where,
            attempts_min=times_tried.shown,
            attempts_max=times_tried.high,
            how=" x ".join(times_tried.factors) or "1 attempt",
            bound_field=times_tried.bound_field,
        )
        if kind == "subworkflow":
            child = self.child(step, where, times_tried)
            total.add(_Sum(0, 0, child.calls_min, child.calls_max, child.cost_min, child.cost_max))
            total.attempts_min += child.attempts_min
            total.attempts_max = _plus(total.attempts_max, child.attempts_max)
        elif kind == "recipe" and self.sources.price is not None:
            self.recipe(step, where, times_tried, total)
        elif kind == "agent" and self.sources.price is not None:
            total.calls_max = total.cost_max = None
            self.unbounded.append(
                f"{where} ('{step_id}', agent): its model use is not known before it runs"
            )
        # A step in a branch that may not be taken shows 0 as its least (shown is low or 0).
        shown = times_tried.shown != 0
        own.calls_min = total.calls_min if shown else 0
        own.calls_max = total.calls_max
        own.cost_min = total.cost_min if shown else ZERO
        own.cost_max = total.cost_max
        if self.record:
            self.per_step.append(own)
        return total

    def recipe(self, step: Mapping[str, Any], where: str, times: _Times, total: _Sum) -> None:
        step_id = str(step.get("id", ""))
        recipe = self.sources.recipe_of(step) if self.sources.recipe_of else None
        if recipe is None:
            total.calls_min, total.calls_max = times.low, _times(times.high, 2)
            total.cost_max = None
            self.unbounded.append(f"{where} ('{step_id}'): its recipe is not known")
            return
        model = recipe.get("model")
        max_tokens = int(recipe.get("max_tokens") or DEFAULT_RECIPE_MAX_TOKENS)
        system, prompt = str(recipe.get("system") or ""), str(recipe.get("prompt") or "")
        asks = 2 if recipe.get("output") == "json" else 1
        total.calls_min, total.calls_max = times.low, _times(times.high, asks)
        if not model:
            total.cost_max = None
            self.unbounded.append(f"{where} ('{step_id}'): no model is named or configured")
            return
        price = self.sources.price
        assert price is not None  # the caller checked
        tokens = self.sources.tokens
        first = price(str(model), tokens(system, [prompt]), max_tokens)
        worst = first
        if asks == 2:
            reply = "x" * (max_tokens * BYTES_PER_TOKEN)
            again = tokens(system, [prompt, reply, "x" * REASK_BYTES])
            worst = _plus(first, price(str(model), again, max_tokens))
        least = price(str(model), _literal_bytes(system, prompt) // BYTES_PER_TOKEN, 0)
        total.cost_min = (least or ZERO) * times.low
        total.cost_max = _money_times(worst, times.high)
        if first is None or worst is None:
            self.unbounded.append(f"{where} ('{step_id}'): model '{model}' has no price")

    def child(self, step: Mapping[str, Any], where: str, times: _Times) -> _Sum:
        """A subworkflow's child runs: its document walked as many times as the step's
        attempts (each attempt starts one), summed into the step."""
        target = str(step.get("workflow", ""))
        step_id = str(step.get("id", ""))
        version = step.get("version")
        unknown = _Sum(0, None, 0, None, ZERO, None)
        if target in self.chain or self.depth + 1 >= MAX_DEPTH:
            self.unbounded.append(
                f"{where} ('{step_id}'): workflow '{target}' starts itself, which its guards "
                "bound at run time, not before"
                if target in self.chain
                else f"{where} ('{step_id}'): subworkflows nest deeper than {MAX_DEPTH}"
            )
            return unknown
        found = self.sources.child_of(target, version) if self.sources.child_of else None
        if found is None:
            self.unbounded.append(f"{where} ('{step_id}'): workflow '{target}' is not known")
            return unknown
        walk = _Walk(self.sources, depth=self.depth + 1, chain=(*self.chain, target), record=False)
        once = walk.document(found, given_input=False)
        self.unbounded += [f"{where} ('{step_id}') -> {reason}" for reason in walk.unbounded]
        return _Sum(
            once.attempts_min * times.low,
            _times(once.attempts_max, times.high),
            once.calls_min * times.low,
            _times(once.calls_max, times.high),
            once.cost_min * times.low,
            _money_times(once.cost_max, times.high),
        )


def _literal_bytes(*templates: str) -> int:
    """The bytes of ``templates`` less their ``${...}`` references (what every rendering
    of them holds)."""
    return sum(len(REFERENCE.sub("", text).encode()) for text in templates)
