"""Workflow definitions: a workflow is an id; its versions are immutable documents."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

ID_PATTERN = r"^[a-z][a-z0-9_]*$"


class Workflow(models.Model):
    id = models.CharField(primary_key=True, max_length=100, validators=[RegexValidator(ID_PATTERN)])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id

    @property
    def latest_version(self) -> WorkflowVersion | None:
        return self.versions.order_by("-number").first()


class WorkflowVersion(models.Model):
    """One immutable version of a workflow's document.

    ``content_hash`` is the SHA-256 of the canonical JSON of the document without its
    ``version`` field: the same body saved again finds its version by this hash.
    """

    workflow = models.ForeignKey(Workflow, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    document = models.JSONField()
    content_hash = models.CharField(max_length=64)
    description = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["workflow_id", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["workflow", "number"], name="workflow_version_unique"),
        ]
        indexes = [models.Index(fields=["workflow", "content_hash"], name="workflow_version_hash")]

    def __str__(self) -> str:
        return f"{self.workflow_id} v{self.number}"
