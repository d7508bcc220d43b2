"""Who may do what (CONTRACT section 8): the one permission model the API, the pages, the admin
and the commands ask.

A role on a workflow is a django-guardian object permission on its ``Workflow`` row, held by a
user directly or through a group:

============  ==========================  ===================================================
role          object permission           may
============  ==========================  ===================================================
author        ``author_workflow``         save new versions; grant roles; and all below
operator      ``operate_workflow``        read, cancel, pause, resume, retry every run; send
                                          events to its runs; see tracebacks; and read
starter       ``start_workflow``          start runs; read and operate the runs they started
viewer        ``read_workflow``           read every run
============  ==========================  ===================================================

Global (Django model) permissions give a role on every workflow: ``runs.add_run`` starter,
``runs.change_run`` operator, ``runs.view_run`` viewer, ``workflows.change_workflow`` author;
``workflows.add_workflow`` lets a user save version 1 of a new workflow id (and so become its
first author). Superusers hold every role. An author holds every other role too: they may grant
themselves any of them, so implying them saves a step and changes no power.

Callers that are not people (``user=None``: the Python builder's sync, management commands,
the engine itself) are trusted and pass every check; the API and the pages always have a user.

Everything here reads only the permission tables: it belongs at the edges (a request, an admin
page), never in a step's path.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Group
from django.db.models import Q, QuerySet
from guardian.core import ObjectPermissionChecker
from guardian.shortcuts import assign_perm, get_objects_for_user, remove_perm

from .errors import FieldError, Forbidden, NotFound, echo
from .models import KnowledgeBase, Workflow

AUTHOR = "author"
STARTER = "starter"
OPERATOR = "operator"
VIEWER = "viewer"
ROLES = (AUTHOR, STARTER, OPERATOR, VIEWER)

CODENAMES = {
    AUTHOR: "author_workflow",
    STARTER: "start_workflow",
    OPERATOR: "operate_workflow",
    VIEWER: "read_workflow",
}
IMPLIES = {
    AUTHOR: frozenset(ROLES),
    OPERATOR: frozenset({OPERATOR, VIEWER}),
    STARTER: frozenset({STARTER}),
    VIEWER: frozenset({VIEWER}),
}
GLOBAL = {
    AUTHOR: "workflows.change_workflow",
    OPERATOR: "runs.change_run",
    STARTER: "runs.add_run",
    VIEWER: "runs.view_run",
}
# Those who see every definition: any global role, or the admin's own view permission.
SEES_ALL_DEFINITIONS = (*GLOBAL.values(), "workflows.view_workflow")
ALL = frozenset(ROLES)
NONE: frozenset[str] = frozenset()


def _person(user: Any) -> bool:
    return user is not None and getattr(user, "is_authenticated", False) and user.is_active


def trusted(user: Any) -> bool:
    """Code acting for no one (``None``) and superusers pass every check."""
    return user is None or (_person(user) and user.is_superuser)


def _checker(user: Any) -> ObjectPermissionChecker:
    # One checker per user object: it caches the user's and their groups' object
    # permissions, so a page that asks about many workflows reads them once.
    checker = getattr(user, "_djflow_checker", None)
    if checker is None:
        checker = ObjectPermissionChecker(user)
        user._djflow_checker = checker
    return checker


def global_roles(user: Any) -> frozenset[str]:
    """The roles ``user`` holds on every workflow."""
    if trusted(user):
        return ALL
    if not _person(user):
        return NONE
    found: set[str] = set()
    for role, perm in GLOBAL.items():
        if user.has_perm(perm):
            found |= IMPLIES[role]
    return frozenset(found)


def _object_roles(user: Any, workflow_id: str) -> frozenset[str]:
    """The roles a person holds on ``workflow_id`` itself (guardian's two queries, for the
    user and for their groups; none of the global ones)."""
    held = _checker(user).get_perms(Workflow(pk=workflow_id))
    found: set[str] = set()
    for role, codename in CODENAMES.items():
        if codename in held:
            found |= IMPLIES[role]
    return frozenset(found)


def roles(user: Any, workflow_id: str) -> frozenset[str]:
    """The roles ``user`` holds on ``workflow_id`` (global ones included)."""
    found = set(global_roles(user))
    if found == ALL or not _person(user):
        return frozenset(found)
    return frozenset(found | _object_roles(user, workflow_id))


def _workflows_with(user: Any, wanted: set[str]) -> QuerySet[Workflow]:
    """Workflows on which ``user`` holds, as object permission, a role implying one of
    ``wanted``."""
    codenames = [CODENAMES[role] for role in ROLES if IMPLIES[role] & wanted]
    return get_objects_for_user(
        user,
        [f"workflows.{codename}" for codename in codenames],
        klass=Workflow,
        any_perm=True,
        with_superuser=False,
        accept_global_perms=False,
    )


# -- definitions ---------------------------------------------------------------------------


def sees_all_definitions(user: Any) -> bool:
    return trusted(user) or (_person(user) and any(user.has_perm(p) for p in SEES_ALL_DEFINITIONS))


def visible_workflows(user: Any, workflows: QuerySet[Workflow]) -> QuerySet[Workflow]:
    """``workflows`` narrowed to those whose definition ``user`` may read (any role)."""
    if sees_all_definitions(user):
        return workflows
    if not _person(user):
        return workflows.none()
    return workflows.filter(pk__in=_workflows_with(user, set(ROLES)).values("pk"))


def may_see_definition(user: Any, workflow_id: str) -> bool:
    return sees_all_definitions(user) or bool(roles(user, workflow_id))


def require_definition(user: Any, workflow_id: str, *, field: str = "workflow") -> None:
    """404 (naming ``field``) when ``user`` may not see the workflow: ids do not leak."""
    if not may_see_definition(user, workflow_id):
        raise NotFound(errors=[FieldError(field, f"unknown workflow '{workflow_id}'")])


def may_author(user: Any, workflow_id: str, *, exists: bool) -> bool:
    """May ``user`` save a version of ``workflow_id``? Of an existing workflow: its authors. Of a
    new id: holders of ``workflows.add_workflow`` (they become its first author)."""
    if trusted(user):
        return True
    if not _person(user):
        return False
    if exists:
        return AUTHOR in roles(user, workflow_id)
    return may_create(user)


def may_create(user: Any) -> bool:
    """May ``user`` save version 1 of a new workflow id (and so become its first author)?"""
    if trusted(user):
        return True
    if not _person(user):
        return False
    return user.has_perm("workflows.add_workflow") or AUTHOR in global_roles(user)


def require_author(user: Any, workflow_id: str, *, exists: bool) -> None:
    if not may_author(user, workflow_id, exists=exists):
        # The same answer whether or not the id exists: one without the right to see a
        # workflow learns nothing from trying to save it.
        raise Forbidden(
            errors=[FieldError("id", f"you may not save versions of workflow '{workflow_id}'")]
        )


def require_start(user: Any, workflow_id: str) -> None:
    """404 when the workflow is not the caller's to see, 403 when it is but not to start."""
    if trusted(user) or (_person(user) and STARTER in _object_roles(user, workflow_id)):
        # A starter by the workflow's own permission is answered by guardian's two queries:
        # Django's two for the global permissions, which could only add roles, are not
        # asked (bench.starts: four of a POST /runs's thirteen statements were these).
        return
    require_definition(user, workflow_id)
    if STARTER not in roles(user, workflow_id):
        raise Forbidden(
            errors=[FieldError("workflow", f"you may not start runs of workflow '{workflow_id}'")]
        )


def may_start(user: Any, workflow_id: str) -> bool:
    return STARTER in roles(user, workflow_id)


def startable_workflows(user: Any, workflows: QuerySet[Workflow]) -> QuerySet[Workflow]:
    """``workflows`` narrowed to those ``user`` may start runs of."""
    if STARTER in global_roles(user):
        return workflows
    if not _person(user):
        return workflows.none()
    return workflows.filter(pk__in=_workflows_with(user, {STARTER}).values("pk"))


def require_account(user: Any, account: str | None) -> None:
    """Naming a run's ``account`` other than one's own username (CONTRACT section 10: the
    per-account model concurrency) takes the global ``runs.choose_account``: otherwise a
    starter could take another team's model slots, or escape their own limit with a fresh
    name per run. Code acting for no user (the engine, commands) passes."""
    if account is None or not _person(user) or user.is_superuser:
        return
    if account == user.get_username() or user.has_perm("runs.choose_account"):
        return
    raise Forbidden(
        errors=[
            FieldError(
                "account",
                "naming an account other than your username takes the permission "
                "runs.choose_account",
            )
        ]
    )


# -- runs ----------------------------------------------------------------------------------


def run_roles(user: Any, workflow_id: str, created_by_id: Any) -> frozenset[str]:
    """What ``user`` may do to one run: its workflow's roles, and a starter's on a run they
    started (read and operate it, no tracebacks)."""
    held = roles(user, workflow_id)
    if STARTER in held and _person(user) and created_by_id == user.pk:
        held = held | {VIEWER, "operate_own"}
    return held


def may_view_run(user: Any, workflow_id: str, created_by_id: Any) -> bool:
    return VIEWER in run_roles(user, workflow_id, created_by_id)


def may_operate_run(user: Any, workflow_id: str, created_by_id: Any) -> bool:
    held = run_roles(user, workflow_id, created_by_id)
    return OPERATOR in held or "operate_own" in held


def may_see_tracebacks(user: Any, workflow_id: str) -> bool:
    return OPERATOR in roles(user, workflow_id)


def require_view_run(user: Any, run: Any) -> None:
    """404 naming ``id`` unless ``user`` may read ``run`` (any object with ``id``,
    ``workflow_id`` and ``created_by_id``)."""
    if not may_view_run(user, run.workflow_id, run.created_by_id):
        raise NotFound(errors=[FieldError("id", f"unknown run '{run.id}'")])


def require_operate_run(user: Any, run: Any) -> None:
    """404 when ``user`` may not see the run, 403 when they may see it but not operate it."""
    require_view_run(user, run)
    if not may_operate_run(user, run.workflow_id, run.created_by_id):
        raise Forbidden(
            errors=[FieldError("id", f"you may read run '{run.id}' but not operate it")]
        )


def run_filter(user: Any, prefix: str = "") -> Q | None:
    """A filter on runs (fields ``workflow_id``, ``created_by_id``, after ``prefix``: ``run__``
    for a step run) to those ``user`` may read; ``None`` when they may read every run."""
    held = global_roles(user)
    if VIEWER in held:
        return None
    if not _person(user):
        return Q(**{f"{prefix}pk__in": []})
    workflow, owner = f"{prefix}workflow_id__in", f"{prefix}created_by_id"
    readable = Q(**{workflow: _workflows_with(user, {VIEWER}).values("pk")})
    if STARTER in held:
        return readable | Q(**{owner: user.pk})
    started = _workflows_with(user, {STARTER}).values("pk")
    return readable | Q(**{workflow: started, owner: user.pk})


def run_operate_filter(user: Any) -> Q | None:
    """A filter on runs to those ``user`` may operate (cancel, retry, ...: ``may_operate_run``
    as a query, for actions on many runs at once); ``None`` when they may operate every run."""
    held = global_roles(user)
    if OPERATOR in held:
        return None
    if not _person(user):
        return Q(pk__in=[])
    operated = Q(workflow_id__in=_workflows_with(user, {OPERATOR}).values("pk"))
    if STARTER in held:
        return operated | Q(created_by_id=user.pk)
    started = _workflows_with(user, {STARTER}).values("pk")
    return operated | Q(workflow_id__in=started, created_by_id=user.pk)


def viewed_workflows(user: Any) -> QuerySet[Workflow] | None:
    """The workflows every run of which ``user`` may read (the viewer role, or one implying
    it); ``None`` for all of them."""
    if VIEWER in global_roles(user):
        return None
    if not _person(user):
        return Workflow.objects.none()
    return _workflows_with(user, {VIEWER})


def operates_some(user: Any) -> bool:
    """May ``user`` operate any run at all (what the admin asks before offering actions)?"""
    if {OPERATOR, STARTER} & global_roles(user):
        return True
    return _person(user) and _workflows_with(user, {OPERATOR, STARTER}).exists()


def has_any_role(user: Any) -> bool:
    """Does ``user`` hold any role anywhere (what the admin asks before showing runs)?"""
    if global_roles(user):
        return True
    return _person(user) and _workflows_with(user, set(ROLES)).exists()


def operated_workflow_ids(user: Any) -> list[str] | None:
    """The workflows whose runs ``user`` operates (events resume waits only in these);
    ``None`` for all."""
    if OPERATOR in global_roles(user):
        return None
    if not _person(user):
        return []
    return list(_workflows_with(user, {OPERATOR}).values_list("pk", flat=True))


# -- recipes -------------------------------------------------------------------------------
#
# Recipes (CONTRACT section 10) are shared prompts, not any one workflow's, so they answer to
# Django's global model permissions (the contract is silent; README "Recipes" says the same):
#
# - reading (list, items, the admin, the preview): ``workflows.view_recipe``,
#   ``workflows.add_recipe`` or ``workflows.change_recipe``; without any of them the list is
#   403 and an item 404, so names do not leak;
# - saving version 1 of a new name: ``workflows.add_recipe``;
# - saving a new version of an existing name: ``workflows.change_recipe``, whoever saved the
#   earlier ones (a recipe may be used by many workflows: changing it is its own right);
# - naming a recipe in a workflow's ``recipe`` step: reading (a run shows the recipe's
#   prompts, and its start whether the name exists); ``services.recipe_name_errors``;
# - superusers and trusted code (``None``) everything. Nothing deletes a recipe.

RECIPE_READ = ("workflows.view_recipe", "workflows.add_recipe", "workflows.change_recipe")
RECIPE_ADD = "workflows.add_recipe"
RECIPE_CHANGE = "workflows.change_recipe"


def may_read_recipes(user: Any) -> bool:
    return trusted(user) or (_person(user) and any(user.has_perm(p) for p in RECIPE_READ))


def may_add_recipe(user: Any) -> bool:
    """May ``user`` save version 1 of a recipe name that does not exist yet?"""
    return trusted(user) or (_person(user) and user.has_perm(RECIPE_ADD))


def may_change_recipe(user: Any) -> bool:
    """May ``user`` save a new version of an existing recipe name?"""
    return trusted(user) or (_person(user) and user.has_perm(RECIPE_CHANGE))


def require_read_recipes(user: Any) -> None:
    """403 for a list of recipes the caller may not read."""
    if not may_read_recipes(user):
        raise Forbidden(errors=[FieldError(None, "you may not read recipes")])


def require_recipe(user: Any, name: str) -> None:
    """404 (naming ``name``) for one recipe the caller may not read: as for an unknown one."""
    if not may_read_recipes(user):
        raise NotFound(errors=[FieldError("name", f"unknown recipe '{echo(name)}'")])


def require_save_recipes(user: Any) -> None:
    """403 unless ``user`` may save some recipe (a new name or a new version); checked before
    the body is even read, so one who may save none learns nothing from trying."""
    if not (may_add_recipe(user) or may_change_recipe(user)):
        raise Forbidden(
            errors=[
                FieldError(
                    None,
                    f"you may not save recipes: it needs {RECIPE_ADD} (a new name) or "
                    f"{RECIPE_CHANGE} (a new version)",
                )
            ]
        )


def require_save_recipe(user: Any, name: str, *, exists: bool) -> None:
    """403 naming ``name`` unless ``user`` may save a new version of it (see above)."""
    require_save_recipes(user)
    if exists and not may_change_recipe(user):
        raise Forbidden(
            errors=[
                FieldError(
                    "name",
                    f"recipe '{echo(name)}' exists; saving a new version of it needs the "
                    f"permission {RECIPE_CHANGE}",
                )
            ]
        )
    if not exists and not may_add_recipe(user):
        raise Forbidden(
            errors=[FieldError("name", f"saving a new recipe needs the permission {RECIPE_ADD}")]
        )


# -- knowledge bases -----------------------------------------------------------------------
#
# Knowledge bases (CONTRACT section 10) are shared stores that runs write and recipes read; like
# recipes they are no one workflow's. The contract is silent on who may do what; README
# "Knowledge bases" says the same as this:
#
# - reading (list, documents, search, the admin; naming one in a recipe's ``context.kb``):
#   the global ``workflows.view_knowledgebase`` (every knowledge base), or the object
#   permission ``read_knowledgebase`` on it; writing implies reading. One who may not read a
#   knowledge base is answered as for one that does not exist (404), so names do not leak;
# - writing (a new version, the admin's edit; a ``write_kb`` step naming it): the global
#   ``workflows.change_knowledgebase`` (every one), or ``write_knowledgebase`` on it;
# - creating a new name (the admin; a ``write_kb`` step naming a literal new one):
#   ``workflows.add_knowledgebase``; a person who creates one gets both object permissions
#   on it (``grant_kb_creator``); a workflow's save creates the new names its ``write_kb``
#   steps name (``services.reserve_kbs``), so they are its saver's before any run writes;
#   a recipe's ``context.kb`` may not name one that does not exist yet (but the document's
#   own new ``write_kb`` names);
# - a ``write_kb`` step whose ``kb`` is a template (known only when a run resolves it) may
#   write any knowledge base: it needs ``workflows.change_knowledgebase``;
# - the engine's own writes and reads (a run's steps) are trusted: the rights were checked when
#   the workflow was saved (``services.kb_name_errors``). Superusers everything. Nothing
#   deletes a knowledge base or a version.

KB_READ_ALL = ("workflows.view_knowledgebase", "workflows.change_knowledgebase")
KB_WRITE_ALL = "workflows.change_knowledgebase"
KB_ADD = "workflows.add_knowledgebase"
KB_READ = "read_knowledgebase"
KB_WRITE = "write_knowledgebase"


def reads_all_kbs(user: Any) -> bool:
    return trusted(user) or (_person(user) and any(user.has_perm(p) for p in KB_READ_ALL))


def writes_all_kbs(user: Any) -> bool:
    return trusted(user) or (_person(user) and user.has_perm(KB_WRITE_ALL))


def may_add_kb(user: Any) -> bool:
    """May ``user`` create a knowledge base of a new name?"""
    return trusted(user) or (_person(user) and user.has_perm(KB_ADD))


def _kb_perms(user: Any, kb: KnowledgeBase) -> set[str]:
    return set(_checker(user).get_perms(kb)) if _person(user) else set()


def may_read_kb(user: Any, kb: KnowledgeBase) -> bool:
    return reads_all_kbs(user) or bool({KB_READ, KB_WRITE} & _kb_perms(user, kb))


def may_write_kb(user: Any, kb: KnowledgeBase) -> bool:
    return writes_all_kbs(user) or KB_WRITE in _kb_perms(user, kb)


def readable_kbs(user: Any, kbs: QuerySet[KnowledgeBase]) -> QuerySet[KnowledgeBase]:
    """``kbs`` narrowed to those ``user`` may read."""
    if reads_all_kbs(user):
        return kbs
    if not _person(user):
        return kbs.none()
    return kbs.filter(pk__in=_kbs_with(user, [KB_READ, KB_WRITE]).values("pk"))


def writable_kbs(user: Any, kbs: QuerySet[KnowledgeBase]) -> QuerySet[KnowledgeBase]:
    """``kbs`` narrowed to those ``user`` may write."""
    if writes_all_kbs(user):
        return kbs
    if not _person(user):
        return kbs.none()
    return kbs.filter(pk__in=_kbs_with(user, [KB_WRITE]).values("pk"))


def _kbs_with(user: Any, codenames: list[str]) -> QuerySet[KnowledgeBase]:
    return get_objects_for_user(
        user,
        [f"workflows.{codename}" for codename in codenames],
        klass=KnowledgeBase,
        any_perm=True,
        with_superuser=False,
        accept_global_perms=False,
    )


def reads_some_kb(user: Any) -> bool:
    """May ``user`` read any knowledge base at all (the admin asks before showing them)?"""
    return reads_all_kbs(user) or (_person(user) and _kbs_with(user, [KB_READ, KB_WRITE]).exists())


def require_kb(user: Any, name: str, *, field: str = "kb") -> KnowledgeBase:
    """The knowledge base ``name`` if ``user`` may read it; else 404 naming ``field``, the
    same answer as for a name that does not exist."""
    found = KnowledgeBase.objects.filter(name=name).first()
    if found is None or not may_read_kb(user, found):
        raise NotFound(errors=[FieldError(field, f"unknown knowledge base '{echo(name)}'")])
    return found


def may_name_kb_to_read(user: Any, name: str) -> bool:
    """May ``user`` save a recipe step whose ``context.kb`` is ``name``? One they may read. A
    name that does not exist yet, no (unless they read every one): its runs would read
    whatever its eventual creator, with readers of their own, puts there. (One the same
    document's ``write_kb`` creates is the saver's from the save: ``services.kb_name_errors``.)
    """
    if reads_all_kbs(user):
        return True
    found = KnowledgeBase.objects.filter(name=name).first()
    return found is not None and may_read_kb(user, found)


def may_name_kb_to_write(user: Any, name: str) -> bool:
    """May ``user`` save a ``write_kb`` step naming ``name`` (literal)? Write on it, or for a
    new name the right to create one."""
    if writes_all_kbs(user):
        return True
    found = KnowledgeBase.objects.filter(name=name).first()
    return may_write_kb(user, found) if found is not None else may_add_kb(user)


def grant_kb_creator(kb: KnowledgeBase, user: Any) -> None:
    """The person who created ``kb`` reads and writes it."""
    if _person(user):
        assign_perm(f"workflows.{KB_READ}", user, kb)
        assign_perm(f"workflows.{KB_WRITE}", user, kb)
        user.__dict__.pop("_djflow_checker", None)


def grant_kb(
    codename: str, kb: KnowledgeBase, *, user: Any = None, group: Group | None = None
) -> None:
    """Give a user or a group ``read_knowledgebase`` or ``write_knowledgebase`` on ``kb``."""
    if codename not in (KB_READ, KB_WRITE):
        raise ValueError(f"unknown knowledge-base permission '{codename}'")
    assign_perm(f"workflows.{codename}", _holder(user, group), kb)


# -- granting ------------------------------------------------------------------------------


def _holder(user: Any = None, group: Group | None = None) -> Any:
    if (user is None) == (group is None):
        raise ValueError("grant to exactly one of a user or a group")
    return user if user is not None else group


def grant(role: str, workflow_id: str, *, user: Any = None, group: Group | None = None) -> None:
    """Give a user or a group ``role`` on the (existing) workflow."""
    if role not in CODENAMES:
        raise ValueError(f"unknown role '{role}': one of {', '.join(ROLES)}")
    workflow = Workflow.objects.get(pk=workflow_id)
    assign_perm(f"workflows.{CODENAMES[role]}", _holder(user, group), workflow)


def revoke(role: str, workflow_id: str, *, user: Any = None, group: Group | None = None) -> None:
    if role not in CODENAMES:
        raise ValueError(f"unknown role '{role}': one of {', '.join(ROLES)}")
    workflow = Workflow.objects.get(pk=workflow_id)
    remove_perm(f"workflows.{CODENAMES[role]}", _holder(user, group), workflow)


def may_grant(user: Any, workflow_id: str, role: str) -> bool:
    """Authors grant every role; operators grant viewer (the contract's table)."""
    held = roles(user, workflow_id)
    return AUTHOR in held or (role == VIEWER and OPERATOR in held)


def operators(workflow_id: str) -> list[Any]:
    """The active users who operate the workflow's runs, to tell them what needs them (a run
    waiting for budget): its authors and operators (object roles, held directly or through
    a group) and the holders of the global author or operator permission. A superuser is not
    one by that alone: every superuser would hear of every run."""
    from django.contrib.auth import get_user_model
    from guardian.shortcuts import get_users_with_perms

    found: dict[Any, Any] = {}
    workflow = Workflow.objects.filter(pk=workflow_id).first()
    if workflow is not None:
        for person in get_users_with_perms(
            workflow,
            only_with_perms_in=[CODENAMES[AUTHOR], CODENAMES[OPERATOR]],
            with_group_users=True,
            with_superusers=False,
        ):
            found[person.pk] = person
    people = get_user_model().objects
    for permission in (GLOBAL[AUTHOR], GLOBAL[OPERATOR]):
        # Guardian's backend answers for objects only: the model permissions are Django's.
        held = people.with_perm(  # type: ignore[attr-defined]
            permission,
            include_superusers=False,
            backend="django.contrib.auth.backends.ModelBackend",
        )
        for person in held:
            found[person.pk] = person
    return sorted((p for p in found.values() if p.is_active), key=lambda p: p.pk)


def holders(workflow_id: str) -> list[tuple[str, str, str]]:
    """Every object role on the workflow: ``(role, "user"|"group", name)``, sorted."""
    from guardian.shortcuts import get_groups_with_perms, get_users_with_perms

    workflow = Workflow.objects.get(pk=workflow_id)
    by_codename = {codename: role for role, codename in CODENAMES.items()}
    found: list[tuple[str, str, str]] = []
    users = get_users_with_perms(workflow, attach_perms=True, with_group_users=False)
    for person, perms in users.items():
        found += [
            ("user", person.get_username(), by_codename[p]) for p in perms if p in by_codename
        ]
    for group, perms in get_groups_with_perms(workflow, attach_perms=True).items():
        found += [("group", group.name, by_codename[p]) for p in perms if p in by_codename]
    return sorted((role, kind, name) for kind, name, role in found)
