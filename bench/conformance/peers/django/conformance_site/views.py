"""The counting service (bench/conformance/README.md): executions under /c/, counts under /count/.
The execution view is protected as django-idempotency-key's README says for a view whose clients may
send a key: `@idempotency_key(optional=True)` under IdempotencyKeyMiddleware (a request without a key is
executed without protection, as with the other implementations)."""

import json
import threading
import time

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from idempotency_key.decorators import idempotency_key, idempotency_key_exempt

_lock = threading.Lock()
_counts: dict[str, int] = {}


def _int_param(request, name, default):
    value = request.GET.get(name)
    if value is None or not value.isdigit():
        return default
    return int(value)


@idempotency_key(optional=True)
def execute(request, rest):
    path = request.path
    # Counted first thing in the handler. The middleware has read the body already: it hashes it
    # into the key.
    with _lock:
        n = _counts.get(path, 0) + 1
        _counts[path] = n
    received = request.body.decode("utf-8", errors="replace")
    if n <= _int_param(request, "fail_first", 0):
        status = _int_param(request, "fail_status", 503)
    else:
        status = _int_param(request, "status", 201)
    delay = _int_param(request, "delay_ms", 0)
    if delay:
        time.sleep(delay / 1000)
    doc = {"execution": n, "method": request.method, "path": path, "received": received}
    size = _int_param(request, "size", None)
    if size is not None:
        doc["pad"] = ""
        short = size - len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
        if short > 0:
            doc["pad"] = "x" * short
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    chunks = _int_param(request, "chunks", 0)
    if not chunks:
        response = HttpResponse(body, status=status, content_type="application/json")
        response["Content-Length"] = str(len(body))
    else:
        pieces = max(1, min(chunks, len(body)))
        gap = _int_param(request, "chunk_ms", 0) / 1000

        def stream():
            for i in range(pieces):
                if i and gap:
                    time.sleep(gap)
                yield body[i * len(body) // pieces : (i + 1) * len(body) // pieces]

        response = StreamingHttpResponse(stream(), status=status, content_type="application/json")
    response["X-Execution"] = str(n)
    return response


def count(request, rest):
    with _lock:
        n = _counts.get("/c/" + rest, 0)
    return JsonResponse({"count": n})


@idempotency_key_exempt
def not_found(request):
    return JsonResponse({"error": "not found"}, status=404)
