"""The differential suite's Flask app (tests/it/attacks/differential.rs): POST /payments, POST
/webhooks/stripe and a catch-all, routed by Flask on Werkzeug's threaded server on 127.0.0.1:0. It prints
its port as a first JSON line, then one JSON line per handler execution: the handler, the method and
request target as Werkzeug read them, the headers it saw (WSGI keeps no request trailers, so none are
reported)."""

import json
import threading

from flask import Flask, request
from werkzeug.serving import make_server

app = Flask(__name__)
lock = threading.Lock()
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "PURGE"]


def executed(handler):
    try:
        request.get_data()
        body_error = None
    except Exception as error:
        body_error = repr(error)
    record = {
        "handler": handler,
        "method": request.method,
        "target": request.environ.get("REQUEST_URI") or request.environ.get("RAW_URI") or request.full_path,
        "headers": [[name.lower(), value] for name, value in request.headers.items()],
        "trailers": [],
        "body_error": body_error,
    }
    with lock:
        print(json.dumps(record), flush=True)
    return json.dumps({"app": "flask", "handler": handler}), 200, {"content-type": "application/json"}


@app.route("/payments", methods=["POST"])
def payments():
    return executed("payments")


@app.route("/webhooks/stripe", methods=["POST"])
def stripe_webhook():
    return executed("webhook")


@app.route("/", defaults={"rest": ""}, methods=METHODS)
@app.route("/<path:rest>", methods=METHODS)
def other(rest):
    return executed("other")


if __name__ == "__main__":
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(json.dumps({"listen": {"http1": server.server_port}}), flush=True)
    server.serve_forever()
