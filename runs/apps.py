from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        from workflows.secrets import install_log_scrubber

        # Every process that runs the engine (web, worker, beat) masks secrets in its logs.
        install_log_scrubber()
