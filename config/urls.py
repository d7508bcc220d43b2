from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from config.metrics import metrics
from config.views import home

api_v1 = [
    path("", include("workflows.urls")),
    path("", include("runs.urls")),
    path("", include("approvals.api_urls")),
    path("", include("schedules.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # The split view serves Swagger UI's start-up script as a file (docs/?script), not inline:
    # the page runs under the Content-Security-Policy's script-src 'self'.
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Prometheus' text format (config.metrics: DJFLOW_METRICS_TOKEN).
    path("metrics", metrics, name="metrics"),
    path("", home, name="home"),
    path("", include("approvals.urls")),
    path("", include("runs.page_urls")),
]

handler400 = "config.views.bad_request"
handler404 = "config.views.not_found"
handler500 = "config.views.server_error"
