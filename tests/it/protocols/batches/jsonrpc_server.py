"""A JSON-RPC 2.0 service for tests/it/protocols/batches.rs: `jsonrpcserver` answering calls and batches
on a plain `http.server` at 127.0.0.1 (on the port given as its argument, else any), whose first line
out is `PORT <port>`.

Methods (each counts its executions, per idempotency key and in total):
- `charge(amount)`: answers `{"charged", "execution", "keyExecution"}`.
- `note()`: for notifications; answers nothing.
- `slow()`: says it has arrived (`GET /arrived?key=K` returns once it has); the first call under a key
  then waits until `POST /release?key=K`, a later one answers at once.
- `vanish()`: runs, but its answer is left out of the batch's answer (or, alone, the connection is
  closed without an answer).

Test endpoints: `GET /counts` (executions in total and per key, the sizes of the batches received, the
number of JSON-RPC requests, every executed call as `[method, key]` in order); `POST /fail-next`
(the next JSON-RPC request is answered `503` without running anything).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from jsonrpcserver import Success, dispatch, method

LOCK = threading.Lock()
STATE = {"executions": 0, "keys": {}, "batches": [], "requests": 0, "calls": []}
ARRIVED = {}
RELEASED = {}
FAILURES = {"next": 0}


def event(table, key):
    with LOCK:
        return table.setdefault(str(key), threading.Event())


def key_of(meta):
    key = (meta or {}).get("idempotencyKey")
    return None if key is None else str(key)


def count(name, meta):
    """Counts one execution of `name`; its number in total and under its key."""
    key = key_of(meta)
    with LOCK:
        STATE["executions"] += 1
        STATE["calls"].append([name, key])
        if key is None:
            return STATE["executions"], 0
        STATE["keys"][key] = STATE["keys"].get(key, 0) + 1
        return STATE["executions"], STATE["keys"][key]


@method
def charge(amount, _meta=None):
    total, under_key = count("charge", _meta)
    return Success({"charged": amount, "execution": total, "keyExecution": under_key})


@method
def note(_meta=None):
    count("note", _meta)
    return Success(None)


@method
def slow(_meta=None):
    key = key_of(_meta)
    total, _ = count("slow", _meta)
    arrived = event(ARRIVED, key)
    with LOCK:
        first = not arrived.is_set()
        arrived.set()
    if first:
        event(RELEASED, key).wait(300)
    return Success({"slow": True, "execution": total})


@method
def vanish(_meta=None):
    total, _ = count("vanish", _meta)
    return Success({"vanished": True, "execution": total})


def vanishing_ids(message):
    calls = message if isinstance(message, list) else [message]
    return [
        json.dumps(call["id"])
        for call in calls
        if isinstance(call, dict) and call.get("method") == "vanish" and "id" in call
    ]


def without(answer, ids):
    """The batch answer `answer` (text) without the answers to the calls whose ids are `ids`."""
    if not ids:
        return answer
    kept = [a for a in json.loads(answer) if json.dumps(a.get("id")) not in ids]
    return json.dumps(kept) if kept else ""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status, body=b"", content_type="application/json"):
        self.send_response(status)
        if body:
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/counts":
            with LOCK:
                return self.send(200, json.dumps(STATE).encode())
        if url.path == "/arrived":
            key = parse_qs(url.query)["key"][0]
            arrived = event(ARRIVED, key).wait(50)
            return self.send(200 if arrived else 504, b"{}")
        return self.send(404, b"{}")

    def do_POST(self):
        url = urlparse(self.path)
        body = self.body()
        if url.path == "/release":
            event(RELEASED, parse_qs(url.query)["key"][0]).set()
            return self.send(200, b"{}")
        if url.path == "/fail-next":
            with LOCK:
                FAILURES["next"] += 1
            return self.send(200, b"{}")
        with LOCK:
            STATE["requests"] += 1
            failing = FAILURES["next"] > 0
            FAILURES["next"] -= 1 if failing else 0
        if failing:
            return self.send(503, b"unavailable", "text/plain")
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if isinstance(message, list):
            with LOCK:
                STATE["batches"].append(len(message))
        answer = dispatch(body.decode("utf-8"))
        vanishing = vanishing_ids(message)
        if isinstance(message, dict) and vanishing:
            self.close_connection = True
            return
        answer = without(answer, vanishing)
        if not answer:
            return self.send(202)
        return self.send(200, answer.encode())


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
