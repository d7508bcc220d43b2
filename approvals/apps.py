from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"
    verbose_name = "Approvals"

    def ready(self) -> None:
        # The approval and handoff kinds, reminders and mail repairs: the engine finds them
        # through its registry and hooks, and never imports this app.
        from .kinds import plug_in

        plug_in()
