# Calls the tool of server.py through the proxy with the official MCP Python SDK's client: twice under
# one idempotency key (in the call's `_meta`, with a progress callback, so each call has a progress token
# of its own), then under another. argv: the MCP endpoint's URL, and the SDK's connection mode ("auto":
# the 2026 protocol; "legacy": the 2025 initialize handshake). Prints one JSON line: each call's result
# text, and the content type and Idempotent-Replayed header of each tools/call answer.
import asyncio
import json
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

url, mode = sys.argv[1], sys.argv[2]
answers = []


async def seen(response):
    if b'"tools/call"' in response.request.content:
        headers = response.headers
        answers.append([headers.get("content-type", ""), headers.get("idempotent-replayed")])


async def progress(done, total, message):
    pass


async def main():
    http = httpx2.AsyncClient(
        headers={"Authorization": "Bearer agent-1"}, event_hooks={"response": [seen]}, timeout=30
    )
    results = []
    async with Client(streamable_http_client(url, http_client=http), mode=mode, read_timeout_seconds=20) as client:
        for key in ["order-1", "order-1", "order-2"]:
            result = await client.call_tool(
                "charge", {"amount": 5}, progress_callback=progress, meta={"idempotencyKey": key}
            )
            results.append(result.content[0].text)
    print(json.dumps({"results": results, "answers": answers}), flush=True)


asyncio.run(main())
