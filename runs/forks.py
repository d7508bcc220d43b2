"""Forks (CONTRACT section 16): a new run of an ended run's workflow that begins at one of its
top-level steps, the steps before it taken as they ended in the source run.

``POST /runs/{id}/fork {from_step?, document?, recipes?, input?, dry_run?}`` and
``manage.py run_replay --from-step`` both come here. The fork is started as ``POST /runs``
starts a run (``runs.services.run_start``: the same permission, pre-flight and input
checks), with ``forked_from`` and ``fork_step`` set, and before its first plan its journal
is given a copy of the source's rows of the steps kept: the planner walks past them as past
any settled step (their outputs feed the templates of the steps after), so nothing of them
runs again.

- What is kept is what a retry from ``from_step`` would keep (``runs.retries.split``): the
  top-level steps before it that settled (succeeded, skipped, or failed and gone past with
  ``on_error: continue``), with every row inside them; attempts a retry from a step
  superseded are left out. Rows are copied with generation 1, no cost (the source paid it)
  and no claim; a kept step's child runs stay the source's.
- ``document`` is a saved version number of the same workflow (the source's by default), and
  ``recipes`` pins saved recipe versions by name for every recipe step of the fork
  (``Run.recipe_pins``, applied by the worker). A document or recipe not saved yet is tried
  offline with ``manage.py run_replay --document/--recipe``: a fork runs for real, and a
  version saved only to fork it would become the one new runs start on.
- Secrets: the fork runs on the source's input unless ``input`` is given (merged as a retry's
  edit is: a secret it omits, or sends as ``••••``, keeps the source's value and token). Keeping
  a stored secret is for an author of the workflow or the source's starter, as for a retry
  with an edited input; anyone else gives each secret again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from workflows import access, secrets, selectors
from workflows.errors import FieldError, InvalidInput, NotFound, echo
from workflows.input_schema import write_only_values
from workflows.inputs import input_errors
from workflows.models import Recipe, WorkflowVersion
from workflows.templates import encoded_size

from . import retries, vault
from .engine import journal
from .engine.plan import superseded, top_level_ids
from .models import Run, StepRun
from .selectors import run_readable
from .status import RUN_TERMINAL, IllegalTransition

# The largest number a version column holds (a larger one would be a database error).
MAX_VERSION = 2_147_483_647
# The fields of a journal row a fork copies (with generation 1, no cost and no claim).
COPIED = (
    "step_id",
    "path",
    "kind",
    "attempt",
    "status",
    "branch",
    "input",
    "output",
    "error",
    "effect",
    "queue",
    "timeout_ms",
    "idempotency_key",
    "usage",
    "spans",
    "scheduled_at",
    "started_at",
    "finished_at",
)


@dataclass(frozen=True)
class ForkPreview:
    """What a fork would do, answered by ``dry_run`` without starting anything: the version it
    runs, the top-level step it begins at, the top-level steps whose outputs it takes from the
    source (``reused``) and those that run (``rerun``), in the fork's document order, and the
    recipe versions it pins."""

    source: Any
    version: int
    from_step: str | None
    reused: list[str]
    rerun: list[str]
    recipes: dict[str, int]


@dataclass
class Seed:
    """What ``runs.services.run_start`` needs to start a fork: the fields of the new run, the
    source's secrets (the fork's input keeps their tokens) and the rows to copy."""

    source: Run
    fork_step: str
    recipe_pins: dict[str, int]
    inherited: dict[str, Any]
    rows: list[StepRun] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        return {
            "forked_from": self.source,
            "fork_step": self.fork_step,
            "recipe_pins": self.recipe_pins,
        }

    def copy_into(self, run: Run) -> None:
        """Write the kept rows into ``run``'s journal (before its first plan), counted as its
        attempts and stored bytes as the planner and the run's byte cap count them."""
        copies = [
            StepRun(run=run, generation=1, **{name: getattr(row, name) for name in COPIED})
            for row in self.rows
        ]
        StepRun.objects.bulk_create(copies)
        stored = sum(
            encoded_size(row.input) + encoded_size(row.output) + encoded_size(row.error)
            for row in copies
        )
        counted = sum(1 for row in copies if row.status != "skipped")
        Run.objects.filter(id=run.id).update(stored_bytes=stored, attempts=counted)
        run.stored_bytes, run.attempts = stored, counted


@dataclass(frozen=True)
class Request:
    """A fork as asked, checked for types (``check``)."""

    from_step: str | None = None
    document: int | None = None
    recipes: dict[str, int] = field(default_factory=dict)
    input: Mapping[str, Any] | None = None

    @classmethod
    def check(
        cls, *, from_step: Any = None, document: Any = None, recipes: Any = None, input: Any = None
    ) -> Request:
        errors = []
        if from_step is not None and not isinstance(from_step, str):
            errors.append(FieldError("from_step", "must be a top-level step id (a string)"))
        if document is not None and not _version_number(document):
            errors.append(
                FieldError(
                    "document",
                    "must be a saved version number of the run's workflow; to try a document "
                    "not saved, replay the run's export offline (manage.py run_replay "
                    "--document FILE)",
                )
            )
        pins: dict[str, int] = {}
        if recipes is not None and not isinstance(recipes, Mapping):
            errors.append(FieldError("recipes", "must be an object of recipe name: version"))
        for name, version in (recipes or {}).items() if isinstance(recipes, Mapping) else ():
            if not _version_number(version):
                errors.append(
                    FieldError(
                        f"recipes.{echo(name)}",
                        f"must be a saved version number of the recipe (an integer from 1 to "
                        f"{MAX_VERSION})",
                    )
                )
            else:
                pins[str(name)] = version
        if input is not None and not isinstance(input, Mapping):
            errors.append(FieldError("input", "must be a JSON object"))
        if errors:
            raise InvalidInput(errors=errors)
        return cls(from_step=from_step, document=document, recipes=pins, input=input)


def _version_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_VERSION


def prepare(
    *, run_id: Any, user: AbstractBaseUser | None, asked: Request
) -> tuple[WorkflowVersion, Any, Seed, ForkPreview]:
    """Check the fork and work out what it keeps. Returns (the version it runs, its input in
    plaintext, its seed, what a dry run answers); any problem is a 404 (the run), a 409 (a run not
    ended, a child run) or a 400 naming the field."""
    readable = run_readable(run_id=run_id, user=user)
    # Before anything of the run's input is read: one who may not start its workflow is
    # told so, and nothing else (a 400 could quote a value of the input).
    access.require_start(user, readable.workflow_id)
    source = Run.objects.select_related("version").get(id=readable.id)
    if source.parent_run_id is not None:
        raise IllegalTransition(
            errors=[
                FieldError(
                    "id",
                    f"run {source.id} is a child run (of run {source.parent_run_id}): fork its "
                    "root run",
                )
            ]
        )
    if source.status not in RUN_TERMINAL:
        raise IllegalTransition(
            errors=[
                FieldError(
                    "status", f"a run is forked once it has ended; this one is {source.status}"
                )
            ]
        )
    version = _version(source, asked.document)
    document = version.document
    source_document = journal.document_of(source.version_id)
    fork_step = _fork_step(asked.from_step, document, source_document, source)
    _check_recipes(asked.recipes, document)
    plain, inherited = _input(source, version, asked.input, user)
    rows, reused, rerun = _kept(source, source_document, document, fork_step)
    seed = Seed(
        source=source,
        fork_step=fork_step or "",
        recipe_pins=dict(asked.recipes),
        inherited=inherited,
        rows=rows,
    )
    preview = ForkPreview(
        source=source.id,
        version=version.number,
        from_step=fork_step,
        reused=reused,
        rerun=rerun,
        recipes=dict(asked.recipes),
    )
    return version, plain, seed, preview


def _version(source: Run, number: int | None) -> WorkflowVersion:
    if number is None:
        return source.version
    try:
        return selectors.version_get(workflow_id=source.workflow_id, number=number)
    except NotFound:
        # As POST /runs answers a version it does not have: a 404 naming the field.
        raise NotFound(
            errors=[
                FieldError("document", f"workflow '{source.workflow_id}' has no version {number}")
            ]
        ) from None


def _fork_step(
    from_step: str | None,
    document: Mapping[str, Any],
    source_document: Mapping[str, Any],
    source: Run,
) -> str | None:
    """The top-level step the fork begins at: ``from_step``'s own, or the one it is inside."""
    if from_step is None:
        return None
    mine = top_level_ids(document["steps"])
    theirs = top_level_ids(source_document["steps"])
    if from_step not in mine or from_step not in theirs:
        where = "the fork's document" if from_step not in mine else f"run {source.id}'s document"
        raise InvalidInput(
            errors=[FieldError("from_step", f"'{echo(from_step)}' is not a step of {where}")]
        )
    if mine[from_step] != theirs[from_step]:
        raise InvalidInput(
            errors=[
                FieldError(
                    "from_step",
                    f"'{echo(from_step)}' is inside '{mine[from_step]}' in the fork's document "
                    f"and inside '{theirs[from_step]}' in the run's",
                )
            ]
        )
    return mine[from_step]


def _check_recipes(pins: Mapping[str, int], document: Mapping[str, Any]) -> None:
    """Each pin is a saved version of a recipe the fork's document names: a pin changes
    which version of the author's chosen recipe runs, never which recipe."""
    named = _recipes_named(document["steps"])
    unnamed = [
        FieldError(
            f"recipes.{echo(name)}",
            f"no recipe step of the fork's document names recipe '{echo(name)}'",
        )
        for name in pins
        if name not in named
    ]
    if unnamed:
        raise InvalidInput(errors=unnamed)
    missing = [
        FieldError(f"recipes.{echo(name)}", f"recipe '{echo(name)}' has no version {version}")
        for name, version in pins.items()
        if Recipe.objects.resolve(name, version) is None
    ]
    if missing:
        # A version not saved (yet): a 404 naming it, as for the document's version.
        raise NotFound(errors=missing)


def _recipes_named(body: Any) -> set[str]:
    found: set[str] = set()
    for step in body if isinstance(body, list) else [body]:
        if not isinstance(step, Mapping):
            continue
        if isinstance(step.get("recipe"), str):
            found.add(step["recipe"])
        for name in ("then", "else", "do"):
            if name in step:
                found |= _recipes_named(step[name])
        for branch in (step.get("branches") or {}).values():
            found |= _recipes_named(branch)
    return found


def _input(
    source: Run, version: WorkflowVersion, given: Mapping[str, Any] | None, user: Any
) -> tuple[Any, dict[str, Any]]:
    """The fork's input in plaintext and the source's secrets (their tokens are kept).

    A stored secret is the source version's ``writeOnly`` field. It goes into the fork only
    for those who may keep it (an author, the source's starter), and only where the fork's
    version marks a secret too: elsewhere it would be stored, and shown, in plaintext."""
    registry = vault.decrypt(source.secrets, run_id=source.id) if source.secrets else {}
    plaintexts = secrets.plaintexts(registry)
    secrets.expose(plaintexts)
    schema = version.document.get("input_schema")
    revealed = secrets.reveal(source.input, registry)
    if given is None:
        plain = revealed
        kept = _secret_fields(source.version.document.get("input_schema"), revealed)
    else:
        named: list[str] = []
        plain = (
            retries.merged_input(schema, source.input, given, registry, named)
            if schema
            else dict(given)
        )
        kept = [name.removeprefix("input.") for name in named]
    if kept and not _may_keep_secrets(user, source):
        raise InvalidInput(
            errors=[
                FieldError(
                    f"input.{name}",
                    "is a secret: give it again to fork the run (only an author of the workflow "
                    "or the run's starter may keep the stored one)",
                )
                for name in kept
            ]
        )
    marked = set(_secret_fields(schema, plain))
    unmarked = [name for name in kept if name not in marked]
    if unmarked:
        raise InvalidInput(
            errors=[
                FieldError(
                    f"input.{name}",
                    f"is a secret of run {source.id}, and version {version.number} does not "
                    "mark it writeOnly: give a value for it, or fork onto a version that marks it",
                )
                for name in unmarked
            ]
        )
    problems = input_errors(version, plain)
    if problems:
        # A message may quote the value it refuses: never one of the source's secrets.
        mask = secrets.masker(plaintexts)
        raise InvalidInput(
            errors=[FieldError(error.field, mask(error.message)) for error in problems]
        )
    return plain, registry


def _secret_fields(schema: Any, plain: Any) -> list[str]:
    if schema is None:
        return []
    return [".".join(map(str, path)) for path, _ in write_only_values(schema, plain)]


def _may_keep_secrets(user: Any, source: Run) -> bool:
    if user is None:  # the engine's own callers, code with the database's rights
        return True
    if source.created_by_id is not None and source.created_by_id == user.pk:
        return True
    return access.may_author(user, source.workflow_id, exists=True)


def _kept(
    source: Run,
    source_document: Mapping[str, Any],
    document: Mapping[str, Any],
    fork_step: str | None,
) -> tuple[list[StepRun], list[str], list[str]]:
    """(the source's rows to copy, the top-level steps reused, those that run), the steps in
    the fork's document order. Without ``fork_step`` nothing is reused."""
    order = [str(step["id"]) for step in document["steps"]]
    if fork_step is None:
        return [], [], order
    attempts = journal.journal_of(source.id)
    _, kept = retries.split(source_document["steps"], attempts, fork_step)
    before = set(order[: order.index(fork_step)])
    reused = [step for step in order if step in before and step in kept]
    if not reused:
        return [], [], order
    tops = top_level_ids(source_document["steps"])
    # A row is copied only where its step sits under the same top-level step in both
    # documents: a step moved out of a kept condition runs in the fork.
    mine = top_level_ids(document["steps"])
    reruns = tuple((int(r["generation"]), str(r["from_step"])) for r in source.reruns or ())
    gone = superseded(source_document["steps"], reruns)
    chosen = set(reused)
    rows = [
        row
        for row in StepRun.objects.filter(run_id=source.id).order_by("id")
        if tops.get(_head(row.path, row.step_id)) in chosen
        and mine.get(_head(row.path, row.step_id)) == tops.get(_head(row.path, row.step_id))
        and not gone(row.path, row.step_id, row.generation)
    ]
    return rows, reused, [step for step in order if step not in chosen]


def _head(path: str, step_id: str) -> str:
    return path.split("[", 1)[0] if path else step_id


@transaction.atomic
def run_fork(
    *,
    run_id: Any,
    user: AbstractBaseUser | None = None,
    from_step: Any = None,
    document: Any = None,
    recipes: Any = None,
    input: Any = None,
    dry_run: bool = False,
) -> Any:
    """Fork an ended run (see the module). Returns the new run, or with ``dry_run`` a
    :class:`ForkPreview` (nothing started). ``user`` must read the source run (404) and
    start its workflow (404/403 as ``POST /runs``)."""
    from .services import run_start

    asked = Request.check(from_step=from_step, document=document, recipes=recipes, input=input)
    version, plain, seed, preview = prepare(run_id=run_id, user=user, asked=asked)
    if dry_run:
        return preview
    run = run_start(
        workflow=version.workflow_id,
        version=version.number,
        input=plain,
        user=user,
        priority=seed.source.priority,
        fork=seed,
    ).run
    # What it took from the source, for its caller (manage.py run_replay says so).
    run.reused = preview.reused  # type: ignore[attr-defined]
    return run
