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

from jsonrpcserver import Success, dispatch, method

from service import LOCK, Service, gate, serve

STATE = {"executions": 0, "keys": {}, "batches": [], "requests": 0, "calls": []}
FAILURES = {"next": 0}


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
    gate(key)
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


class Handler(Service):
    NAME = "key"
    STATE = STATE

    def post(self, url, query, body):
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


if __name__ == "__main__":
    sys.exit(serve(Handler))
