"""Writes for workflow definitions. Views, admin, the builder and commands call these."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from .errors import Conflict, FieldError, InvalidDocument
from .models import Workflow, WorkflowVersion
from .validation import prepare_document


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


def definition_save(*, document: Any, user: AbstractBaseUser | None = None) -> SaveResult:
    """Save a workflow document as an immutable version.

    The same body again returns the version that holds it (``created`` false); a different
    body for an existing version number raises :class:`Conflict`; with no ``version`` the
    document gets the next number. Numbers are handed out under a lock on the workflow row,
    with the unique constraint as the backstop, so two concurrent saves never share one.
    A rejected document leaves no row.
    """
    prepared = prepare_document(
        document,
        workflow_exists=_workflow_exists,
        max_steps=settings.DJFLOW["MAX_DOCUMENT_STEPS"],
    )
    digest = content_hash(prepared)
    requested = prepared.get("version")
    try:
        with transaction.atomic():
            return _save_locked(prepared, digest, requested, user)
    except IntegrityError:
        # Only a concurrent save of the same explicit version number gets here; the row it
        # wrote is now visible, so the second pass answers 200 or 409 from it.
        with transaction.atomic():
            return _save_locked(prepared, digest, requested, user)


def _save_locked(
    document: dict[str, Any],
    digest: str,
    requested: int | None,
    user: AbstractBaseUser | None,
) -> SaveResult:
    workflow_id = document["id"]
    # INSERT ... ON CONFLICT DO NOTHING, then lock: the first save of a new workflow races
    # safely, and every later save of this workflow queues on the row lock.
    Workflow.objects.bulk_create([Workflow(id=workflow_id)], ignore_conflicts=True)
    Workflow.objects.select_for_update().get(id=workflow_id)
    versions = WorkflowVersion.objects.filter(workflow_id=workflow_id)

    if requested is not None:
        existing = versions.filter(number=requested).first()
        if existing is not None:
            if existing.content_hash == digest:
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
        same = versions.filter(content_hash=digest).order_by("-number").first()
        if same is not None:
            return SaveResult(same, created=False)
        latest = versions.order_by("-number").values_list("number", flat=True).first()
        number = (latest or 0) + 1

    stored = {**document, "version": number}
    # Keep the document's own key order: id and version first reads best in the API.
    stored = {"id": stored["id"], "version": number, **stored}
    version = WorkflowVersion.objects.create(
        workflow_id=workflow_id,
        number=number,
        document=stored,
        content_hash=digest,
        description=document.get("description", ""),
        created_by=user if user is not None and user.is_authenticated else None,
    )
    return SaveResult(version, created=True)


def raise_invalid(errors: list[FieldError]) -> None:
    if errors:
        raise InvalidDocument(errors=errors)
