import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from config import tracing

# Before the application loads its middleware: Django's instrumentation adds its own.
tracing.setup("web", django=True)
application = get_wsgi_application()
