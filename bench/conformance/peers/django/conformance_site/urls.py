from django.urls import path, re_path

from . import views

urlpatterns = [
    path("c/<path:rest>", views.execute),
    path("count/<path:rest>", views.count),
    re_path(r"^.*$", views.not_found),
]
