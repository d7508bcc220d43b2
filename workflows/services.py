"""Writes for workflow definitions. Views, admin, the builder and commands call these."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, connection, transaction

from . import access, heartbeats, kinds, knowledge, notify
from . import secrets as field_secrets
from .errors import Conflict, FieldError, Forbidden, InvalidDocument, echo
from .kb_names import is_template
from .models import Recipe, Workflow, WorkflowVersion
from .queues import queue_errors
from .recipes import MAX_VERSION as MAX_VERSION_NUMBER
from .recipes import prepare_recipe
from .validation import ApprovalRules, every_step, prepare_document

# Held by whoever may name e-mail approvers outside DJFLOW_APPROVER_EMAIL_DOMAINS (declared
# by the approvals app, ``ApprovalRequest.Meta.permissions``).
MAIL_EXTERNAL = "approvals.mail_external"
# Held by whoever may name site users (other than themselves) and groups in an approval's
# approvers or escalate_to, or a hand-off's group: each is mailed the author's text.
MAIL_USERS = "approvals.mail_users"
# Said for every name alike, existing or not, held or not: the answer must not tell names.
NAMING_PEOPLE = (
    "naming site users (other than yourself) or groups needs the permission "
    f"{MAIL_USERS}: they are mailed this step's text; name plain addresses in "
    "approvers.emails instead"
)


# Tries of a recipe save that lost a race for its version number to a concurrent save.
RECIPE_SAVE_TRIES = 5


@dataclass(frozen=True)
class SaveResult:
    version: WorkflowVersion
    created: bool


def content_hash(document: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``document`` without its ``version`` field."""
    body = {k: v for k, v in document.items() if k != "version"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _workflow_exists(workflow_id: str, version: int | None) -> bool:
    versions = WorkflowVersion.objects.filter(workflow_id=workflow_id)
    if version is not None:
        versions = versions.filter(number=version)
    return versions.exists()


def approval_rules(user: AbstractBaseUser | None) -> ApprovalRules:
    """The bounds on approval steps for a save by ``user``. ``None`` is a save by the
    deployment itself (the builders of ``WORKFLOW_MODULES`` synced at worker start-up or by
    ``manage.py sync_workflows``): its code and its environment are the operator's, so only
    the bounds apply, not the e-mail domains. Every save by a person passes that person,
    signed in or not."""
    djflow = settings.DJFLOW
    external = user is None or user.has_perm(MAIL_EXTERNAL)  # type: ignore[attr-defined]
    return ApprovalRules(
        min_remind_ms=djflow["MIN_REMIND_MS"],
        mail_domains=None if external else frozenset(djflow["APPROVER_EMAIL_DOMAINS"]),
    )


def definition_save(*, document: Any, user: AbstractBaseUser | None = None) -> SaveResult:
    """Save a workflow document as an immutable version.

    The same body again returns the version that holds it (``created`` false); a different
    body for an existing version number raises :class:`Conflict`; with no ``version`` the
    document gets the next number. Numbers are handed out under a lock on the workflow row,
    with the unique constraint as the backstop, so two concurrent saves never share one.
    A rejected document leaves no row. Approval steps are held to :func:`approval_rules`
    for ``user``.

    ``user`` must be an author of the workflow, or hold ``workflows.add_workflow`` for a
    new id (and then becomes its first author); ``None`` is trusted code (the builder's sync).
    What its steps name is held to the user's rights too: handlers (:func:`handler_errors`),
    subworkflows (:func:`subworkflow_errors`), recipes (:func:`recipe_name_errors`),
    knowledge bases (:func:`kb_name_errors`), queues (``workflows.queues``).
    """

    def visible_exists(workflow_id: str, version: int | None) -> bool:
        # A subworkflow target the user may not see is unknown to them, pinned version or
        # not: the answer must not tell an invisible workflow from a missing one.
        return access.may_see_definition(user, workflow_id) and _workflow_exists(
            workflow_id, version
        )

    def visible_document(workflow_id: str, version: int | None) -> dict[str, Any] | None:
        # The worst-case step count reads a subworkflow's document: only one the user sees.
        if not access.may_see_definition(user, workflow_id):
            return None
        found = WorkflowVersion.objects.resolve(workflow_id, version)
        return None if found is None else found.document

    prepared = prepare_document(
        document,
        workflow_exists=visible_exists,
        child_document=visible_document,
        approval_rules=approval_rules(user),
        max_steps=settings.DJFLOW["MAX_DOCUMENT_STEPS"],
    )
    raise_invalid(
        [
            *queue_errors(prepared, trusted=access.trusted(user)),
            *handler_errors(prepared, user),
            *subworkflow_errors(prepared, user),
            *recipe_name_errors(prepared, user),
            *kb_name_errors(prepared, user),
            *people_errors(prepared, user),
        ]
    )
    # notify secrets leave the document here: it stores ••••, the version keeps them
    # encrypted, and the hash holds their keyed fingerprints (workflows.notify).
    prepared, secrets = notify.seal(
        prepared, partial(_latest_with_secrets, prepared["id"], user=user)
    )
    # Held as a run's secret input is: this context's logs and error reports (which carry
    # the request's body and locals) mask them.
    field_secrets.expose(secrets.values())
    digests = notify.hashes(prepared, secrets, content_hash)
    requested = prepared.get("version")
    sealed = _Sealed(digests, notify.encrypt(secrets))
    try:
        with transaction.atomic():
            return _save_and_reserve(prepared, sealed, requested, user)
    except IntegrityError:
        # Only a concurrent save of the same explicit version number gets here; the row it
        # wrote is now visible, so the second pass answers 200 or 409 from it.
        with transaction.atomic():
            return _save_and_reserve(prepared, sealed, requested, user)


@dataclass(frozen=True)
class _Sealed:
    """A document's content hashes (the current key's first) and its notify secrets'
    stored form."""

    digests: list[str]
    secrets: str


def _latest_with_secrets(
    workflow_id: str, *, user: AbstractBaseUser | None
) -> tuple[dict[str, Any], str] | None:
    """The latest version's document and notify secrets, for a ••••: only an author's
    (otherwise whether •••• is taken would tell a non-author the URLs it lists)."""
    if not access.may_author(user, workflow_id, exists=True):
        return None
    latest = WorkflowVersion.objects.resolve(workflow_id)
    return None if latest is None else (latest.document, latest.secrets)


def _save_and_reserve(
    document: dict[str, Any],
    sealed: _Sealed,
    requested: int | None,
    user: AbstractBaseUser | None,
) -> SaveResult:
    saved = _save_locked(document, sealed, requested, user)
    reserve_kbs(document, user)
    return saved


def reserve_kbs(document: dict[str, Any], user: AbstractBaseUser | None) -> None:
    """Create, the saving person their creator (both object permissions), each knowledge base
    a ``write_kb`` step names literally that does not exist yet; in the save's transaction.

    Why at save: the right to name a new one is asked now and runs are trusted later. Left to
    the run's first write, the knowledge base would have no reader (a run is no person), and
    whoever created the name in between (with readers of their own) would get this
    workflow's writes. A name someone else took since :func:`kb_name_errors` asked fails the
    save, naming the step's field.

    Trusted saves reserve too: the deployment's builders, synced at worker start-up and by
    ``manage.py sync_workflows`` with no user, create their names with no creator (the
    deployment's, which no person reads or writes without a grant or a global permission),
    so a user who may add knowledge bases finds them taken. One a person other than a
    superuser created first is theirs, with their readers: the deployment's save fails
    naming the step's field rather than send its writes there. A name the deployment only
    reads (a recipe's ``context.kb``) is not reserved: such a knowledge base is curated by
    people (in the admin), and the run's pre-flight asks that it exists."""
    for step, where in every_step(document):
        name = _literal_write_kb(step)
        if name is None:
            continue
        kb = knowledge.kb_get_or_create(name=name, user=user)
        if user is None and _owned_by_a_person(kb):
            raise InvalidDocument(errors=[_owned_by_another(f"{where}.kb", kb)])
        if not access.may_write_kb(user, kb):
            raise InvalidDocument(errors=[_may_not_write(f"{where}.kb", name)])


def _owned_by_a_person(kb: Any) -> bool:
    """Was ``kb`` created by someone other than the deployment (no creator) or a
    superuser (who holds every right anyway)?"""
    creator = kb.created_by
    return creator is not None and not creator.is_superuser


def _owned_by_another(field: str, kb: Any) -> FieldError:
    return FieldError(
        field,
        f"knowledge base '{echo(kb.name)}' was created by user "
        f"'{echo(kb.created_by.get_username())}' before this workflow reserved it, and its "
        "readers are theirs: name another knowledge base, or have an operator check that "
        "one and hand it to the deployment (clear its creator and the object permissions on it)",
    )


def _literal_write_kb(step: Mapping[str, Any]) -> str | None:
    name = step.get("kb")
    if step.get("kind") != "write_kb" or not isinstance(name, str) or is_template(name):
        return None
    return name


def _save_locked(
    document: dict[str, Any],
    sealed: _Sealed,
    requested: int | None,
    user: AbstractBaseUser | None,
) -> SaveResult:
    workflow_id = document["id"]
    # INSERT ... ON CONFLICT DO NOTHING, then lock: the first save of a new workflow races
    # safely, and every later save of this workflow queues on the row lock.
    Workflow.objects.bulk_create([Workflow(id=workflow_id)], ignore_conflicts=True)
    Workflow.objects.select_for_update().get(id=workflow_id)
    versions = WorkflowVersion.objects.filter(workflow_id=workflow_id)
    # Under the workflow's lock: of two users racing to create one id, the second finds
    # the first's version 1 and needs the first's grant.
    first = not versions.exists()
    access.require_author(user, workflow_id, exists=not first)
    if first and access.AUTHOR not in access.global_roles(user):
        # Handlers belong to the workflow their name starts with: the first person to save
        # an id that deployed code already serves would become the author of that code.
        # Such a workflow is the deployment's (its module's sync, a superuser or a global
        # author, who authors every workflow anyway, creates it).
        served = heartbeats.served_under(f"{workflow_id}.")
        if served:
            raise Forbidden(
                errors=[
                    FieldError(
                        "id",
                        f"workflow '{workflow_id}' belongs to the deployment: running workers "
                        f"serve its handlers ({', '.join(served[:3])}); it is created by "
                        "sync_workflows or a superuser, whose authors then grant roles",
                    )
                ]
            )

    if requested is not None:
        existing = versions.filter(number=requested).first()
        if existing is not None:
            if existing.content_hash in sealed.digests:
                return SaveResult(existing, created=False)
            raise Conflict(
                errors=[
                    FieldError(
                        "version",
                        f"version {requested} of workflow '{workflow_id}' already exists with "
                        "a different body; versions are immutable: omit 'version' to save the "
                        "next one",
                    )
                ]
            )
        number = requested
    else:
        same = versions.filter(content_hash__in=sealed.digests).order_by("-number").first()
        if same is not None:
            return SaveResult(same, created=False)
        latest = versions.order_by("-number").values_list("number", flat=True).first()
        number = _next_version(latest, f"workflow '{workflow_id}'")

    stored = {**document, "version": number}
    # Keep the document's own key order: id and version first reads best in the API.
    stored = {"id": stored["id"], "version": number, **stored}
    version = WorkflowVersion.objects.create(
        workflow_id=workflow_id,
        number=number,
        document=stored,
        content_hash=sealed.digests[0],
        secrets=sealed.secrets,
        description=document.get("description", ""),
        created_by=user if user is not None and user.is_authenticated else None,
    )
    if first and user is not None and user.is_authenticated:
        access.grant(access.AUTHOR, workflow_id, user=user)
    return SaveResult(version, created=True)


def handler_errors(document: dict[str, Any], user: AbstractBaseUser | None) -> list[FieldError]:
    """A step's ``handler`` names a handler of the same workflow, or of a workflow the saving
    user also authors (CONTRACT section 8): else anyone could run anyone's code with any
    input (subworkflow targets: :func:`subworkflow_errors`). A handler name's workflow is
    the part before its first dot (``billing.charge`` belongs to ``billing``), which is how
    the builder names them."""
    if access.trusted(user):
        return []
    errors = []
    for step, where in every_step(document):
        name = step.get("handler")
        # Kinds whose ``handler`` names Python code a worker runs.
        if step.get("kind") not in kinds.handler_kinds() or not isinstance(name, str):
            continue
        if "." not in name:
            # A name without a workflow part (``@handler("refund")``) is no workflow's: only
            # a global author may name it. Read as its own prefix, anyone who may create
            # the workflow id "refund" would own it.
            if access.AUTHOR not in access.global_roles(user):
                errors.append(
                    FieldError(
                        f"{where}.handler",
                        f"handler '{name}' belongs to no workflow (no '<workflow>.' prefix); "
                        "only an author of every workflow may name it",
                    )
                )
            continue
        owner = name.split(".", 1)[0]
        if owner != document["id"] and access.AUTHOR not in access.roles(user, owner):
            errors.append(
                FieldError(
                    f"{where}.handler",
                    f"handler '{name}' belongs to workflow '{owner}', which you do not author",
                )
            )
    return errors


def subworkflow_errors(document: dict[str, Any], user: AbstractBaseUser | None) -> list[FieldError]:
    """A ``subworkflow`` step starts runs of its ``workflow`` whenever this one runs, with the
    input this document gives: the saving user must be a starter of it (CONTRACT section 8),
    as a Step Functions state machine's role needs ``states:StartExecution`` on the machine
    it calls. One the user may not see was already reported unknown by validation
    (:func:`definition_save`), as one that does not exist is, so ids do not leak."""
    if access.trusted(user):
        return []
    errors = []
    for step, where in every_step(document):
        target = step.get("workflow")
        if step.get("kind") != "subworkflow" or not isinstance(target, str):
            continue
        if target == document["id"]:
            continue  # recursion: the workflow being saved, which the author may start
        # Only visible targets get here (validation called the others unknown).
        if access.STARTER not in access.roles(user, target):
            errors.append(
                FieldError(
                    f"{where}.workflow",
                    f"you may not start runs of workflow '{target}', so no step of yours may",
                )
            )
    return errors


def named_people(step: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(field, kind, name)`` for each site user (kind ``user``) and group (``group``) an
    ``approval`` or ``handoff`` step names, which people the engine will mail; ``field``
    within the step (``approvers.users[0]``, ``group``)."""
    found: list[tuple[str, str, str]] = []
    kind = step.get("kind")
    if kind == "handoff" and isinstance(step.get("group"), str):
        found.append(("group", "group", step["group"]))
    if kind != "approval":
        return found
    for part in ("approvers", "escalate_to"):
        named = step.get(part)
        if not isinstance(named, Mapping):
            continue
        for plural, single in (("users", "user"), ("groups", "group")):
            for index, name in enumerate(named.get(plural) or []):
                if isinstance(name, str):
                    found.append((f"{part}.{plural}[{index}]", single, name))
    return found


def may_name_people(user: Any, step: Mapping[str, Any]) -> str | None:
    """The first field of ``step`` naming a site user or group that ``user`` may not name,
    or None. Anyone may name themselves; anyone else, and every group, needs
    :data:`MAIL_USERS`. Whether the name exists is never asked, so the answer is the same
    for a stranger's name and a made-up one. ``None`` (trusted code) may name anyone."""
    if user is None or user.has_perm(MAIL_USERS):
        return None
    own = user.get_username() if getattr(user, "is_authenticated", False) else None
    for field, kind, name in named_people(step):
        if kind == "group" or name != own:
            return field
    return None


def people_errors(document: dict[str, Any], user: AbstractBaseUser | None) -> list[FieldError]:
    """Approval and hand-off steps mail the site users and groups they name, with the
    author's text and, for approvers, a link: naming anyone but oneself needs
    :data:`MAIL_USERS` (:func:`may_name_people`), as an address outside the approver domains
    needs ``approvals.mail_external``. One error per step, at its first such field."""
    if access.trusted(user):
        return []
    errors = []
    for step, where in every_step(document):
        field = may_name_people(user, step)
        if field is not None:
            errors.append(FieldError(f"{where}.{field}", NAMING_PEOPLE))
    return errors


# Said for every named recipe alike, whether it exists or not: the answer must not tell names.
NAMING_A_RECIPE = f"naming a recipe needs the permission to read recipes ({access.RECIPE_READ[0]})"


def recipe_name_errors(document: dict[str, Any], user: AbstractBaseUser | None) -> list[FieldError]:
    """A ``recipe`` step that names a stored recipe (``recipe``) runs that recipe's prompts,
    and a run's start and its model calls would show the saving user whether the name exists
    and what the recipe says: naming one needs the right to read recipes
    (``access.may_read_recipes``), as a ``task`` step's handler needs the right to author its
    workflow (:func:`handler_errors`). The message is the same for every name, existing or
    not. Inline recipe steps (``prompt``) read nothing stored and need no right."""
    if access.may_read_recipes(user):
        return []
    return [
        FieldError(f"{where}.recipe", NAMING_A_RECIPE)
        for step, where in every_step(document)
        if step.get("kind") == "recipe" and "recipe" in step
    ]


def kb_name_errors(document: dict[str, Any], user: AbstractBaseUser | None) -> list[FieldError]:
    """The knowledge bases a document's steps read and write, held to the saving user's rights
    (``workflows.access``, "knowledge bases"): a run is trusted with them later, so the save is
    where they are asked. A recipe's ``context.kb`` needs read on it (a name that does not
    exist yet only one a ``write_kb`` of this document names: the save makes that one the
    saver's, :func:`reserve_kbs`; any other would be read from whoever creates it later); a
    ``write_kb`` step's literal ``kb`` write on it (or, for a new name, the right to create
    one); a ``write_kb`` whose ``kb`` is a template the right to write every knowledge base.
    Each message is the same whether the name exists or not, so trying names tells nothing
    to one who may not create knowledge bases."""
    if access.trusted(user):
        return []
    written = {name for step, _ in every_step(document) if (name := _literal_write_kb(step))}
    errors = []
    for step, where in every_step(document):
        kind = step.get("kind")
        context = step.get("context")
        if kind == "recipe" and isinstance(context, dict) and isinstance(context.get("kb"), str):
            name = context["kb"]
            own = name in written and access.may_name_kb_to_write(user, name)
            if not own and not access.may_name_kb_to_read(user, name):
                errors.append(
                    FieldError(
                        f"{where}.context.kb",
                        f"reading knowledge base '{echo(name)}' needs the permission to read it "
                        f"(read_knowledgebase on it, or {access.KB_READ_ALL[0]})",
                    )
                )
        if kind != "write_kb" or not isinstance(step.get("kb"), str):
            continue
        name = step["kb"]
        if is_template(name):
            if not access.writes_all_kbs(user):
                errors.append(
                    FieldError(
                        f"{where}.kb",
                        "a knowledge base named by a template may be any of them: writing it "
                        f"needs the permission {access.KB_WRITE_ALL}",
                    )
                )
        elif not access.may_name_kb_to_write(user, name):
            errors.append(_may_not_write(f"{where}.kb", name))
    return errors


def _may_not_write(field: str, name: str) -> FieldError:
    return FieldError(
        field,
        f"writing knowledge base '{echo(name)}' needs the permission to write it "
        f"(write_knowledgebase on it, or {access.KB_WRITE_ALL}; for a new name, "
        f"{access.KB_ADD})",
    )


def raise_invalid(errors: list[FieldError]) -> None:
    if errors:
        raise InvalidDocument(errors=errors)


# --- recipes ---------------------------------------------------------------------------------


def recipe_save(*, document: Any, user: AbstractBaseUser | None = None) -> tuple[Recipe, bool]:
    """Save a recipe document (CONTRACT section 10) as an immutable version; ``(recipe,
    created)``.

    The rules of workflow versions: the same body again returns the version that holds it
    (``created`` false); a different body for an existing version number raises
    :class:`Conflict`; with no ``version`` the document gets the next number. There is no
    parent row to lock, so saves of one name queue on a transaction-scoped advisory lock of
    the name (Postgres; SQLite has one writer at a time anyway), with the unique constraint on
    (name, version) as the backstop: a save whose insert still conflicts looks again in a
    fresh transaction, where the winner's row answers it (the same body: 200; an explicit
    version with another body: 409; an omitted version: the number after it). Permissions:
    ``workflows.access`` (``require_save_recipes`` before the body is read,
    ``require_save_recipe`` for the name); ``None`` is trusted code.
    """
    access.require_save_recipes(user)
    prepared = prepare_recipe(document)
    digest = content_hash(prepared)
    for _ in range(RECIPE_SAVE_TRIES - 1):
        try:
            with transaction.atomic():
                return _recipe_save_once(prepared, digest, user)
        except IntegrityError:
            continue
    with transaction.atomic():
        return _recipe_save_once(prepared, digest, user)


def _recipe_save_once(
    document: dict[str, Any], digest: str, user: AbstractBaseUser | None
) -> tuple[Recipe, bool]:
    name, requested = document["name"], document.get("version")
    _lock_recipe_name(name)
    versions = Recipe.objects.filter(name=name)
    if requested is not None:
        existing = versions.filter(version=requested).first()
    else:
        existing = versions.filter(content_hash=digest).order_by("-version").first()
    if existing is not None and existing.content_hash == digest:
        # Nothing is written: anyone who may save recipes at all is told which version it is.
        return existing, False
    latest = versions.order_by("-version").values_list("version", flat=True).first()
    access.require_save_recipe(user, name, exists=latest is not None)
    if existing is not None:
        raise Conflict(
            errors=[
                FieldError(
                    "version",
                    f"version {requested} of recipe '{name}' already exists with a different "
                    "body; versions are immutable: omit 'version' to save the next one",
                )
            ]
        )
    number = requested if requested is not None else _next_version(latest, f"recipe '{name}'")
    stored = {"name": name, "version": number, **document}
    recipe = Recipe.objects.create(
        name=name,
        version=number,
        document=stored,
        content_hash=digest,
        description=document.get("description", ""),
        created_by=user if user is not None and user.is_authenticated else None,
    )
    return recipe, True


def _next_version(latest: int | None, what: str) -> int:
    """The number after ``latest``; past the largest a version column holds (a client saved
    version 2147483647 itself) a 409 naming ``version``, not the database's 500."""
    if latest is not None and latest >= MAX_VERSION_NUMBER:
        raise Conflict(
            errors=[
                FieldError(
                    "version",
                    f"{what} has version {latest}, the largest there is: no next version can be "
                    "numbered; save under another name",
                )
            ]
        )
    return (latest or 0) + 1


def _lock_recipe_name(name: str) -> None:
    """Hold, until the transaction ends, a lock that every save of ``name`` takes first."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        # Two int4 keys: one for "recipes", one for the name (a hash collision only makes
        # two names queue behind each other).
        cursor.execute(
            "SELECT pg_advisory_xact_lock(hashtext('djflow.recipe'), hashtext(%s))", [name]
        )
