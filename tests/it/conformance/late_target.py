"""A target that keeps the promise on the wire but not in fact: it answers a key reused with another
payload 422, then forwards it to the service anyway, 300 ms later. Everything else it forwards once per
key and replays. Serves on a free loopback port, printed as its first line: PORT <n>."""
import http.server
import sys
import threading
import urllib.error
import urllib.request

UPSTREAM = sys.argv[1]
SEEN = {}
LOCK = threading.Lock()


def forward(method, path, body, content_type):
    request = urllib.request.Request(UPSTREAM + path, data=body or None, method=method)
    if content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, answer.read(), answer.headers.get("Content-Type", "")
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read(), refused.headers.get("Content-Type", "")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def any(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key = self.headers.get("Idempotency-Key")
        sent = (self.command, self.path, body, self.headers.get("Content-Type"))
        if key is None:
            return self.reply(*forward(*sent))
        with LOCK:
            prior = SEEN.get(key)
        if prior is None:
            answer = forward(*sent)
            with LOCK:
                SEEN[key] = (body, answer)
            return self.reply(*answer)
        if prior[0] == body:
            return self.reply(*prior[1])
        threading.Timer(0.3, forward, args=sent).start()
        return self.reply(422, b'{"title":"key reused"}', "application/problem+json")

    do_GET = do_POST = do_PATCH = any


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"PORT {server.server_address[1]}", flush=True)
server.serve_forever()
