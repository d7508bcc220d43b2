"""Pages people click: the link from an e-mail, the inbox, notifications."""

from django.urls import path

from . import views

app_name = "approvals"

urlpatterns = [
    path("approvals/", views.inbox, name="inbox"),
    path("approvals/link/<str:token>/", views.link, name="link"),
    path("notifications/", views.notifications, name="notifications"),
]
