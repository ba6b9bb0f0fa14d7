"""A JSON-RPC client for tests/it/protocols/batches.rs: `jsonrpcclient` builds each message of the JSON list
on standard input and reads its answer; `requests` posts it to the URL given as the argument, with the
credential `Authorization: Bearer agent-1`.

A message is `{"call": [method, params, id]}` or `{"batch": [[method, params, id], ...]}`, where an `id` of
`null` makes a notification. Prints one JSON line: for each message `{"status", "replayed", "answers"}`,
its answers as the library parsed them, `{"id", "ok": result}` or `{"id", "error": [code, message,
data]}`, in the order they came (and `"body"`, the text of an answer that is not JSON-RPC's).
"""

import json
import sys

import requests
from jsonrpcclient import Error, Ok, notification, parse, request


def build(method, params, id):
    if id is None:
        return notification(method, params=params)
    return request(method, params=params, id=id)


def read(parsed):
    if isinstance(parsed, Ok):
        return {"id": parsed.id, "ok": parsed.result}
    if isinstance(parsed, Error):
        return {"id": parsed.id, "error": [parsed.code, parsed.message, parsed.data]}
    return {"unparsed": repr(parsed)}


def send(url, message):
    if "call" in message:
        body = build(*message["call"])
    else:
        body = [build(*call) for call in message["batch"]]
    response = requests.post(
        url, json=body, headers={"Authorization": "Bearer agent-1"}, timeout=60
    )
    report = {
        "status": response.status_code,
        "replayed": response.headers.get("idempotent-replayed"),
        "answers": [],
    }
    if response.headers.get("content-type", "").startswith("application/json") and response.content:
        parsed = parse(response.json())
        report["answers"] = [read(p) for p in ([parsed] if isinstance(parsed, (Ok, Error)) else parsed)]
    elif response.content:
        report["body"] = response.text
    return report


def main():
    url = sys.argv[1]
    print(json.dumps([send(url, message) for message in json.load(sys.stdin)]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
