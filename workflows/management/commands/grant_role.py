"""``manage.py grant_role ROLE WORKFLOW (--user NAME | --group NAME) [--revoke]``.

Grants (or revokes) a role of CONTRACT section 8 on one workflow, through the same
``workflows.access`` the admin's Roles page and the API use. ``--list`` prints who holds what.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workflows import access
from workflows.models import Workflow


class Command(BaseCommand):
    help = "Grant or revoke a role (author, starter, operator, viewer) on a workflow."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("role", nargs="?", choices=access.ROLES)
        parser.add_argument("workflow", help="the workflow's id")
        holder = parser.add_mutually_exclusive_group()
        holder.add_argument("--user", help="a username")
        holder.add_argument("--group", help="a group's name")
        parser.add_argument("--revoke", action="store_true", help="revoke instead of grant")
        parser.add_argument("--list", action="store_true", help="list who holds which role")

    def handle(self, *args: Any, **options: Any) -> None:
        workflow = options["workflow"]
        if not Workflow.objects.filter(pk=workflow).exists():
            raise CommandError(f"unknown workflow '{workflow}'")
        if options["list"]:
            for role, kind, name in access.holders(workflow):
                self.stdout.write(f"{role}\t{kind}\t{name}")
            return
        if options["role"] is None:
            raise CommandError("give a role (author, starter, operator, viewer) or --list")
        holder = self._holder(options)
        change = access.revoke if options["revoke"] else access.grant
        change(options["role"], workflow, **holder)
        verb = "revoked" if options["revoke"] else "granted"
        name = options["user"] or options["group"]
        self.stdout.write(f"{verb} {options['role']} on {workflow} for {name}")

    def _holder(self, options: dict[str, Any]) -> dict[str, Any]:
        if options["user"]:
            users = get_user_model().objects
            user = users.filter(**{get_user_model().USERNAME_FIELD: options["user"]}).first()
            if user is None:
                raise CommandError(f"no user '{options['user']}'")
            return {"user": user}
        if options["group"]:
            group = Group.objects.filter(name=options["group"]).first()
            if group is None:
                raise CommandError(f"no group '{options['group']}'")
            return {"group": group}
        raise CommandError("give --user NAME or --group NAME")
