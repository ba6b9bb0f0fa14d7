"""A GraphQL service for tests/it/protocols/batches.rs: `graphql-core` executing GraphQL-over-HTTP JSON
bodies on a plain `http.server` at 127.0.0.1 (on the port given as its argument, else any), whose
first line out is `PORT <port>`.

Its schema does not declare `@idempotent`: a document that still carries it fails validation here, as it
would on a real service that knows nothing of the proxy.

Mutations (each counts its executions per `ref`):
- `charge(amount, ref)`: answers `{ref, amount, execution}`; while `POST /fail?ref=R&times=N` has
  failures left for its ref, the whole request is answered `503` instead, and nothing is counted.
- `refuse(amount, ref)`: runs, and answers with a field error (`data.<field>: null`).
- `slow(ref)`: says it has arrived (`GET /arrived?ref=R` returns once it has); the first call for a ref
  then waits until `POST /release?ref=R`, a later one answers at once.
- `vanish(ref)`: runs, then the connection is closed without an answer (an outcome nobody can know).
Query: `hello(name)`, counted under the ref `query`. A JSON array of requests (Apollo's batching) is
answered with an array of their answers.

`GET /counts`: `{"executions": {ref: n}, "posts": [every GraphQL request body received, in order]}`.
"""

import json
import sys

from graphql import GraphQLError, build_schema, graphql_sync

from service import LOCK, Service, gate, serve

SCHEMA = build_schema(
    """
    type Query {
      hello(name: String): String!
    }

    type Charge {
      ref: String
      amount: Int!
      execution: Int!
    }

    type Mutation {
      charge(amount: Int!, ref: String): Charge
      refuse(amount: Int!, ref: String): Charge
      slow(ref: String!): Charge
      vanish(ref: String!): Charge
    }
    """
)

STATE = {"executions": {}, "posts": []}
FAILS = {}


class Unavailable(Exception):
    """The service cannot run the request now: its answer is `503`."""


def count(ref):
    with LOCK:
        STATE["executions"][ref] = STATE["executions"].get(ref, 0) + 1
        return STATE["executions"][ref]


def charge(info, amount, ref=None):
    ref = ref or f"amount-{amount}"
    with LOCK:
        failing = FAILS.get(ref, 0) > 0
        if failing:
            FAILS[ref] -= 1
    if failing:
        raise Unavailable(ref)
    return {"ref": ref, "amount": amount, "execution": count(ref)}


def refuse(info, amount, ref=None):
    count(ref or f"refused-{amount}")
    raise GraphQLError("card declined")


def slow(info, ref):
    execution = count(ref)
    gate(ref)
    return {"ref": ref, "amount": 0, "execution": execution}


def vanish(info, ref):
    info.context["vanish"] = True
    return {"ref": ref, "amount": 0, "execution": count(ref)}


def hello(info, name=None):
    count("query")
    return f"hello {name or 'world'}"


class Root:
    charge = staticmethod(charge)
    refuse = staticmethod(refuse)
    slow = staticmethod(slow)
    vanish = staticmethod(vanish)
    hello = staticmethod(hello)


class Handler(Service):
    NAME = "ref"
    STATE = STATE

    def post(self, url, query, body):
        if url.path == "/fail":
            with LOCK:
                FAILS[query["ref"][0]] = int(query.get("times", ["1"])[0])
            return self.send(200, b"{}")
        try:
            request = json.loads(body)
        except ValueError:
            return self.send(400, b'{"errors":[{"message":"the body is not JSON"}]}')
        with LOCK:
            STATE["posts"].append(request)
        if isinstance(request, list):
            answers = [execute(r if isinstance(r, dict) else {}, {}) for r in request]
            return self.send(200, json.dumps([answer for _, answer in answers]).encode())
        context = {}
        result, answer = execute(request, context)
        if any(isinstance(e.original_error, Unavailable) for e in result.errors or []):
            return self.send(503, b'{"errors":[{"message":"service unavailable"}]}')
        if context.get("vanish"):
            self.close_connection = True
            return
        return self.send(200, json.dumps(answer).encode())


def execute(request, context):
    """Runs one GraphQL request; its result, and the answer GraphQL-over-HTTP gives for it."""
    result = graphql_sync(
        SCHEMA,
        request.get("query") or "",
        root_value=Root,
        context_value=context,
        variable_values=request.get("variables"),
        operation_name=request.get("operationName"),
    )
    answer = {}
    if result.errors is not None:
        answer["errors"] = [e.formatted for e in result.errors]
    if result.data is not None or result.errors is None or any(e.path for e in result.errors):
        answer["data"] = result.data
    return result, answer


if __name__ == "__main__":
    sys.exit(serve(Handler))
