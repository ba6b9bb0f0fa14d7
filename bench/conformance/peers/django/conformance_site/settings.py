"""The counting service's Django project: one app-less URLconf, no database, and
django-idempotency-key's IdempotencyKeyMiddleware with the package's default settings (in-memory key
storage, thread lock, 409 for a key already used)."""

SECRET_KEY = "conformance-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "conformance_site.urls"
WSGI_APPLICATION = "conformance_site.wsgi.application"
INSTALLED_APPS = []
DATABASES = {}
USE_TZ = True
# Bodies of any size reach the handler (Django refuses bodies over 2.5 MB by default).
DATA_UPLOAD_MAX_MEMORY_SIZE = None

MIDDLEWARE = [
    "idempotency_key.middleware.IdempotencyKeyMiddleware",
]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
