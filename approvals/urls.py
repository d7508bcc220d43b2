"""Pages people click: the link from an e-mail, the inbox, notifications."""

from django.urls import path

from . import views

app_name = "approvals"

urlpatterns = [
    path("approvals/", views.inbox, name="inbox"),
    path("approvals/link/<str:token>/", views.link, name="link"),
    path("approvals/<uuid:approval_id>/", views.detail, name="detail"),
    path("approvals/<uuid:approval_id>/decide/", views.decide, name="decide"),
    path("notifications/", views.notifications, name="notifications"),
    path("notifications/read/", views.notifications_read, name="notifications-read"),
    path(
        "notifications/<int:notification_id>/read/",
        views.notifications_read,
        name="notification-read",
    ),
]
