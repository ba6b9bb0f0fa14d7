"""One file upload with a form field, as an application sends it with httpx (which draws a new
multipart boundary for every request): `upload.py URL KEY CREDENTIAL FILE_TEXT`. Prints one JSON line:
the status, whether the answer was a replay, the body, and the Content-Type the request went with."""

import json
import sys

import httpx

url, key, credential, file_text = sys.argv[1:5]
response = httpx.post(
    url,
    headers={"Idempotency-Key": key, "Authorization": credential},
    data={"note": "quarterly report"},
    files={"file": ("report.csv", file_text.encode(), "text/csv")},
    timeout=30,
)
print(
    json.dumps(
        {
            "status": response.status_code,
            "replayed": response.headers.get("idempotent-replayed"),
            "body": response.text,
            "content_type": response.request.headers["content-type"],
        }
    )
)
