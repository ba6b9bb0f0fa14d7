"""The counting service (bench/conformance/README.md) as a Starlette app, wrapped by
asgi-idempotency-header's IdempotencyHeaderMiddleware with its in-memory backend and its defaults
(POST and PATCH, header Idempotency-Key). Served by uvicorn: `uvicorn app:app`."""

import asyncio
import json

from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends import MemoryBackend
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

counts: dict[str, int] = {}


def int_param(request: Request, name: str, default):
    value = request.query_params.get(name)
    if value is None or not value.isdigit():
        return default
    return int(value)


async def execute(request: Request) -> Response:
    path = request.url.path
    # Counted when it arrives, before the body is read.
    n = counts.get(path, 0) + 1
    counts[path] = n
    received = (await request.body()).decode("utf-8", errors="replace")
    fail_first = int_param(request, "fail_first", 0)
    if n <= fail_first:
        status = int_param(request, "fail_status", 503)
    else:
        status = int_param(request, "status", 201)
    delay = int_param(request, "delay_ms", 0)
    if delay:
        await asyncio.sleep(delay / 1000)
    doc = {"execution": n, "method": request.method, "path": path, "received": received}
    size = int_param(request, "size", None)
    if size is not None:
        doc["pad"] = ""
        short = size - len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
        if short > 0:
            doc["pad"] = "x" * short
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    headers = {"X-Execution": str(n)}
    chunks = int_param(request, "chunks", 0)
    if not chunks:
        return Response(body, status_code=status, headers=headers, media_type="application/json")
    pieces = max(1, min(chunks, len(body)))
    gap = int_param(request, "chunk_ms", 0) / 1000

    async def stream():
        for i in range(pieces):
            if i and gap:
                await asyncio.sleep(gap)
            yield body[i * len(body) // pieces : (i + 1) * len(body) // pieces]

    return StreamingResponse(stream(), status_code=status, headers=headers, media_type="application/json")


async def count(request: Request) -> Response:
    rest = request.path_params["rest"]
    return JSONResponse({"count": counts.get("/c/" + rest, 0)})


async def not_found(request: Request) -> Response:
    return JSONResponse({"error": "not found"}, status_code=404)


METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

app = Starlette(
    routes=[
        Route("/c/{rest:path}", execute, methods=METHODS),
        Route("/count/{rest:path}", count, methods=["GET"]),
        Route("/{rest:path}", not_found, methods=METHODS),
    ],
    middleware=[Middleware(IdempotencyHeaderMiddleware, backend=MemoryBackend())],
)
