from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers"

    def ready(self) -> None:
        from celery.signals import task_received, worker_ready

        from runs.engine import hooks

        from . import forecasting, kinds, notify, slots, task_events

        # Run-end webhooks whose message was lost: offered again on every reconciler tick.
        hooks.repair("notify_reoffered", notify.reoffer_lost)

        # The worker step kinds that call models, HTTP and MCP tools (recipe, http, mcp_tool).
        kinds.plug_in()
        # Forecasts (runs.forecasts) priced as the engine reserves calls.
        forecasting.plug_in()

        # In a worker's main process: tell each execute_step whether task events are on.
        task_received.connect(task_events.mark_carrier, dispatch_uid="djflow-step-task-events")

        # Once per worker start: whether model calls are limited per account (the embedded
        # default has no Redis to count them in).
        worker_ready.connect(slots.log_at_worker_start, dispatch_uid="djflow-model-slots-log")
