"""What the two test services of tests/it/protocols/batches.rs share (`jsonrpc_server.py`,
`graphql_server.py`): a plain `http.server` at 127.0.0.1 (on the port given as the first argument, else
any) whose first line out is `PORT <port>`; `GET /counts` (the service's `STATE`); the gate a slow call
waits at (`GET /arrived?<name>=N` returns once it has arrived, `POST /release?<name>=N` lets it
answer); bodies read whole, chunked ones too.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

LOCK = threading.Lock()
ARRIVED = {}
RELEASED = {}


def event(table, name):
    with LOCK:
        return table.setdefault(str(name), threading.Event())


def gate(name):
    """A slow call's gate: the first call under `name` says it has arrived and waits until released;
    a later one passes at once."""
    arrived = event(ARRIVED, name)
    with LOCK:
        first = not arrived.is_set()
        arrived.set()
    if first:
        event(RELEASED, name).wait(300)


class Service(BaseHTTPRequestHandler):
    """The shared requests; a service says what its gate's query parameter is called (`NAME`), what
    `/counts` shows (`STATE`), and answers its own requests in `post(url, query, body)`."""

    protocol_version = "HTTP/1.1"
    NAME = "key"
    STATE = {}

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
                return self.send(200, json.dumps(self.STATE).encode())
        if url.path == "/arrived":
            arrived = event(ARRIVED, parse_qs(url.query)[self.NAME][0]).wait(50)
            return self.send(200 if arrived else 504, b"{}")
        return self.send(404, b"{}")

    def do_POST(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        body = self.body()
        if url.path == "/release":
            event(RELEASED, query[self.NAME][0]).set()
            return self.send(200, b"{}")
        return self.post(url, query, body)


def serve(handler):
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()
