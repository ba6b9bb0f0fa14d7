"""A GraphQL client for tests/it/protocols/batches.rs: the `gql` library (requests transport) sends each
request of the JSON list on standard input, `[{"query", "variables"}]`, in turn to the URL given as its
argument, with the credential `Authorization: Bearer agent-1`, and prints one JSON line: each request's
`{"data", "errors"}` as the library gave it back, or `{"exception": <class>, "message"}`.
"""

import json
import sys

from gql import Client, GraphQLRequest, gql
from gql.transport.exceptions import TransportQueryError
from gql.transport.requests import RequestsHTTPTransport


def run(client, request):
    document = GraphQLRequest(gql(request["query"]), variable_values=request.get("variables"))
    try:
        result = client.execute(document, get_execution_result=True)
        return {"data": result.data, "errors": result.errors}
    except TransportQueryError as e:
        return {"data": e.data, "errors": e.errors}
    except Exception as e:  # what the library raised, for the test to show
        return {"exception": type(e).__name__, "message": str(e)}


def main():
    url = sys.argv[1]
    requests = json.load(sys.stdin)
    transport = RequestsHTTPTransport(
        url=url, headers={"Authorization": "Bearer agent-1"}, timeout=60, retries=0
    )
    results = []
    with Client(transport=transport, fetch_schema_from_transport=False) as client:
        for request in requests:
            results.append(run(client, request))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    sys.exit(main())
