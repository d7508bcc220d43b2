from django.urls import path

from . import views

urlpatterns = [
    path("schedules", views.ScheduleListView.as_view(), name="schedules"),
    path("schedules/<str:schedule_id>", views.ScheduleDetailView.as_view(), name="schedule"),
]
