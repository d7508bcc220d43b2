"""Writes to knowledge bases (CONTRACT section 10): the ``write_kb`` step, the admin and the
tests call :func:`kb_write`; reads are ``workflows.kb_search`` and the selectors.

Invariants:

- A write of ``(kb, key)`` whose title and content equal the current version's writes
  nothing and answers that version (``created`` false): an ``at_least_once`` step retried
  after its write landed makes no second version.
- Otherwise it writes version ``current + 1`` (1 for a new key), marks it current and the
  old one not, in one transaction. Writes of one key queue on a transaction-scoped advisory
  lock (Postgres; SQLite has one writer at a time), with the unique constraints on
  ``(kb, key, version)`` and on the current row of ``(kb, key)`` as the backstop: a write
  whose insert still conflicts looks again in a fresh transaction.
- The knowledge base is created by its first write (``create=True``, the engine's writes);
  a person who creates one becomes its first reader and writer (``access.grant_kb_creator``).
- A new version, once committed, is sent to a worker to be embedded when
  ``DJFLOW_EMBEDDINGS_MODEL`` is set (``workers.embed_kb_document``, by name: this app sits
  below the workers); never embedded in the caller (a request, a step). A message lost (a
  broker outage: ``robust``, the write stands) is made up for by the workers' sweep.
- Rights are the caller's to check (``workflows.access``): the engine's writes are trusted,
  the admin and the API ask before they call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import IntegrityError, connection, transaction

from . import access
from .errors import FieldError, InvalidInput, NotFound, echo
from .kb_names import KEY_MAX_LENGTH, TITLE_MAX_LENGTH, name_problem
from .models import KnowledgeBase, KnowledgeDocument

# Tries of a write that lost a race for its version number to a concurrent write.
WRITE_TRIES = 5
# The workers' task that embeds a document version (workers.tasks), sent by name.
EMBED_TASK = "workers.embed_kb_document"


@dataclass(frozen=True)
class Written:
    document: KnowledgeDocument
    created: bool


def document_problems(*, key: Any, title: Any, content: Any) -> list[FieldError]:
    """What is wrong with a document's fields, each naming its field."""
    errors = []
    if not isinstance(key, str) or not key:
        errors.append(FieldError("key", "must be a non-empty string"))
    elif len(key) > KEY_MAX_LENGTH:
        errors.append(FieldError("key", f"must be at most {KEY_MAX_LENGTH} characters"))
    if not isinstance(title, str):
        errors.append(FieldError("title", "must be a string"))
    elif len(title) > TITLE_MAX_LENGTH:
        errors.append(FieldError("title", f"must be at most {TITLE_MAX_LENGTH} characters"))
    limit = settings.DJFLOW["KB_MAX_CONTENT_BYTES"]
    if not isinstance(content, str):
        errors.append(FieldError("content", "must be a string"))
    elif len(content.encode("utf-8", "surrogatepass")) > limit:
        size = len(content.encode("utf-8", "surrogatepass"))
        errors.append(
            FieldError(
                "content",
                f"is {size} bytes; at most {limit} are kept (DJFLOW_KB_MAX_CONTENT_BYTES)",
            )
        )
    named = {error.field for error in errors}
    for field, value in (("key", key), ("title", title), ("content", content)):
        problem = _unstorable(value) if field not in named and isinstance(value, str) else None
        if problem:
            errors.append(FieldError(field, problem))
    return errors


def _unstorable(text: str) -> str | None:
    """Why a database would refuse ``text``: Postgres text holds no NUL, and neither it nor
    SQLite a lone surrogate (not UTF-8; SQLite's JSON can carry one into a step's input)."""
    if "\x00" in text:
        return "may not hold NUL characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "may not hold lone surrogates (text that is not UTF-8)"
    return None


def kb_write(
    *,
    kb: str,
    key: str,
    content: str,
    title: str = "",
    create: bool = True,
    user: Any = None,
    run_id: uuid.UUID | str | None = None,
    step_run_id: int | None = None,
) -> Written:
    """Write ``content`` under ``key`` in knowledge base ``kb`` (see the module docstring).
    Raises :class:`InvalidInput` naming a bad field, :class:`NotFound` naming ``kb`` when it
    does not exist and ``create`` is false."""
    problem = name_problem(kb)
    errors = [FieldError("kb", problem)] if problem else []
    errors += document_problems(key=key, title=title, content=content)
    if errors:
        raise InvalidInput(errors=errors)
    person = user if user is not None and getattr(user, "is_authenticated", False) else None
    for _ in range(WRITE_TRIES - 1):
        try:
            with transaction.atomic():
                return _write_once(kb, key, title, content, create, person, run_id, step_run_id)
        except IntegrityError:
            continue
    with transaction.atomic():
        return _write_once(kb, key, title, content, create, person, run_id, step_run_id)


def _write_once(
    name: str,
    key: str,
    title: str,
    content: str,
    create: bool,
    person: Any,
    run_id: uuid.UUID | str | None,
    step_run_id: int | None,
) -> Written:
    base = kb_get_or_create(name=name, user=person) if create else _existing(name)
    _lock_key(base.pk, key)
    documents = KnowledgeDocument.objects.filter(kb=base, key=key)
    current = documents.filter(current=True).first()
    if current is not None and current.title == title and current.content == content:
        return Written(current, created=False)
    if current is not None:
        documents.filter(pk=current.pk, current=True).update(current=False)
    document = KnowledgeDocument.objects.create(
        kb=base,
        key=key,
        version=(current.version if current is not None else 0) + 1,
        title=title,
        content=content,
        current=True,
        run_id=run_id,
        step_run_id=step_run_id,
        created_by=person,
    )
    if str(settings.DJFLOW.get("EMBEDDINGS_MODEL") or "").strip():
        embed_on_commit(document.pk)
    return Written(document, created=True)


def embed_on_commit(document_id: int) -> None:
    """Send the version to a worker to embed once the write commits."""
    transaction.on_commit(lambda: send_embed(document_id), robust=True)


def send_embed(document_id: int) -> None:
    """Ask a worker to embed a document version (by the task's name: workers is above)."""
    current_app.signature(EMBED_TASK, (document_id,), ignore_result=True).apply_async()


def kb_get_or_create(*, name: str, user: Any = None) -> KnowledgeBase:
    """The knowledge base ``name``, created now if it does not exist (INSERT ... ON CONFLICT
    DO NOTHING: two first writes race safely). A person who creates it holds both object
    permissions on it."""
    problem = name_problem(name)
    if problem:
        raise InvalidInput(errors=[FieldError("kb", problem)])
    person = user if user is not None and getattr(user, "is_authenticated", False) else None
    found = KnowledgeBase.objects.filter(name=name).first()
    if found is not None:
        return found
    KnowledgeBase.objects.bulk_create(
        [KnowledgeBase(name=name, created_by=person)], ignore_conflicts=True
    )
    found = KnowledgeBase.objects.get(name=name)
    if person is not None and found.created_by_id == person.pk:
        access.grant_kb_creator(found, person)
    return found


def _existing(name: str) -> KnowledgeBase:
    found = KnowledgeBase.objects.filter(name=name).first()
    if found is None:
        raise NotFound(errors=[FieldError("kb", f"unknown knowledge base '{echo(name)}'")])
    return found


def _lock_key(kb_id: int, key: str) -> None:
    """Hold, until the transaction ends, a lock every write of ``(kb, key)`` takes first."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        # Two int4 keys: the knowledge base's id and a hash of the key (a collision only
        # makes two keys queue behind each other).
        cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [kb_id, key])
