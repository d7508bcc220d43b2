from django.urls import path

from . import views

urlpatterns = [
    path("runs", views.RunListView.as_view(), name="runs"),
    # Before runs/<run_id>: "cancel" and "retry" are no run ids.
    path("runs/forecast", views.RunForecastView.as_view(), name="runs-forecast"),
    path("runs/cancel", views.BulkCancelView.as_view(), name="runs-cancel"),
    path("runs/retry", views.BulkRetryView.as_view(), name="runs-retry"),
    path("runs/bulk/<str:bulk_id>", views.BulkActionDetailView.as_view(), name="runs-bulk"),
    path("runs/<str:run_id>", views.RunDetailView.as_view(), name="run"),
    path("runs/<str:run_id>/cancel", views.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<str:run_id>/pause", views.RunPauseView.as_view(), name="run-pause"),
    path("runs/<str:run_id>/resume", views.RunResumeView.as_view(), name="run-resume"),
    path("runs/<str:run_id>/retry", views.RunRetryView.as_view(), name="run-retry"),
    path("runs/<str:run_id>/fork", views.RunForkView.as_view(), name="run-fork"),
    path("runs/<str:run_id>/budget", views.RunBudgetView.as_view(), name="run-budget"),
    path(
        "runs/<str:run_id>/steps/<str:step_run_id>/resolve",
        views.StepResolveView.as_view(),
        name="run-step-resolve",
    ),
    path("runs/<str:run_id>/trace", views.RunTraceView.as_view(), name="run-trace"),
    path("runs/<str:run_id>/steps", views.RunStepsView.as_view(), name="run-steps"),
    path("runs/<str:run_id>/export", views.RunExportView.as_view(), name="run-export"),
    # The whole of a value an answer left out (runs.answers): input, output or error.
    path(
        "runs/<str:run_id>/steps/<str:step_run_id>/<str:field>",
        views.StepValueView.as_view(),
        name="run-step-value",
    ),
    path("runs/<str:run_id>/input", views.RunInputView.as_view(), name="run-input"),
    path("runs/<str:run_id>/output", views.RunOutputView.as_view(), name="run-output"),
    path("runs/<str:run_id>/calls/<int:call_id>", views.ModelCallView.as_view(), name="run-call"),
    path("events", views.EventView.as_view(), name="events"),
    path("accounts", views.AccountListView.as_view(), name="accounts"),
    path("accounts/<str:name>", views.AccountDetailView.as_view(), name="account"),
]
