//! The corpus: one line per request spelling, sent through the proxy to every framework on every upstream
//! protocol it speaks. A case is its name, the client's protocol, its head (`METHOD target`; over HTTP/2
//! that gives `:method` and `:path`), its own header lines (written as they are, name case included;
//! over HTTP/2 a `:pseudo: value` line replaces that pseudo-header), its body and, where one is certain,
//! what must happen. The sender adds `host` (`:scheme`, `:authority`), the test credential, the case id
//! (`x-diff-case`) and, for a body, `content-type` and its framing (see `send.rs`).
//!
//! Placeholders in header and trailer lines and in raw bodies: `{key}` is a key no other case uses,
//! `{sig}` the Stripe signature of the case's body (a case is "signed" when it sends one), `{badsig}` a
//! signature under another secret, `{case}` the case id, `{host}` the proxy's address. A body with trailers
//! is sent with a `Trailer` header naming them.

use Body::{Chunked, Empty, Event, Json, Raw};
use Client::{H1, H2};
use Expect::{Any, Refused, Runs};

/// The client's protocol towards the proxy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Client {
    /// HTTP/1.1, written byte for byte.
    H1,
    /// HTTP/2 with prior knowledge, written frame by frame.
    H2,
}

/// What follows the head.
#[derive(Clone, Copy, Debug)]
pub enum Body {
    /// No body at all.
    Empty,
    /// `{"amount":1}`, with `content-length` over HTTP/1.1.
    Json,
    /// A Stripe event whose id is the case's, with `content-length` over HTTP/1.1.
    Event,
    /// `{"amount":1}` chunked over HTTP/1.1 (DATA frames over HTTP/2), then these trailer lines.
    Chunked(&'static [&'static str]),
    /// HTTP/1.1 only: these bytes after the head; the case's own header lines frame them.
    Raw(&'static str),
}

/// What must happen, beyond the invariants every case is held to. `Refused` where a standard says so:
/// the asterisk-form is for `OPTIONS` alone (RFC 9112 §3.2.4, RFC 9113 §8.3.1); HTTP/2 forbids
/// upper-case names and connection-specific fields (RFC 9113 §8.2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expect {
    /// Only the invariants.
    Any,
    /// The framework's handler of this name runs, once (a control: the harness sees executions at all).
    Runs(&'static str),
    /// The proxy refuses: the client gets no answer of the framework's.
    Refused,
}

/// One request spelling.
#[derive(Debug)]
pub struct Case {
    pub name: &'static str,
    pub client: Client,
    pub head: &'static str,
    pub headers: &'static [&'static str],
    pub body: Body,
    pub expect: Expect,
}

impl Case {
    /// Whether the case carries a valid signature of its body.
    pub fn signed(&self) -> bool {
        self.headers.iter().any(|line| line.contains("{sig}"))
    }
}

const fn case(
    name: &'static str,
    client: Client,
    head: &'static str,
    headers: &'static [&'static str],
    body: Body,
    expect: Expect,
) -> Case {
    Case {
        name,
        client,
        head,
        headers,
        body,
        expect,
    }
}

const KEY: &str = "Idempotency-Key: {key}";
const SIGNED: &str = "stripe-signature: {sig}";
const FORGED: &str = "stripe-signature: {badsig}";

/// A chunked body that `Content-Length` says is shorter, smuggling a keyless `POST /payments` after it.
const SMUGGLED: &str =
    "0\r\n\r\nPOST /payments HTTP/1.1\r\nhost: {host}\r\nx-diff-case: {case}\r\ncontent-length: 2\r\n\r\n{}";

/// A form of one file, its boundary `X7q` (117 bytes): what an upload client sends.
const FORM: &str = "--X7q\r\nContent-Disposition: form-data; name=\"receipt\"; filename=\"r.txt\"\r\n\
                    Content-Type: text/plain\r\n\r\nhello\r\n--X7q--\r\n";

#[rustfmt::skip]
pub const CASES: &[Case] = &[
    // Controls: the canonical spellings, so a harness that sees nothing fails.
    case("keyed POST /payments", H1, "POST /payments", &[KEY], Json, Runs("payments")),
    case("keyless POST /payments", H1, "POST /payments", &[], Json, Refused),
    case("signed webhook", H1, "POST /webhooks/stripe", &[SIGNED], Event, Runs("webhook")),
    case("forged webhook", H1, "POST /webhooks/stripe", &[FORGED], Event, Refused),
    case("GET /other", H1, "GET /other", &[], Empty, Runs("other")),
    case("h2 keyed POST /payments", H2, "POST /payments", &["idempotency-key: {key}"], Json, Runs("payments")),
    case("h2 keyless POST /payments", H2, "POST /payments", &[], Json, Refused),
    case("h2 signed webhook", H2, "POST /webhooks/stripe", &[SIGNED], Event, Runs("webhook")),
    // Method case and unknown methods.
    case("post", H1, "post /payments", &[], Json, Any),
    case("Post", H1, "Post /payments", &[], Json, Any),
    case("pOST", H1, "pOST /payments", &[], Json, Any),
    case("post with a key", H1, "post /payments", &[KEY], Json, Any),
    case("PURGE", H1, "PURGE /payments", &[], Json, Any),
    case("trace", H1, "trace /payments", &[], Empty, Any),
    case("connect origin-form", H1, "connect /payments", &[], Empty, Any),
    case("CONNECT authority-form", H1, "CONNECT other.example:443", &[], Empty, Any),
    case("post webhook forged", H1, "post /webhooks/stripe", &[FORGED], Event, Any),
    case("Post webhook forged", H1, "Post /webhooks/stripe", &[FORGED], Event, Any),
    // Asterisk-form and absolute-form targets.
    case("OPTIONS *", H1, "OPTIONS *", &[], Empty, Any),
    case("POST *", H1, "POST *", &[], Json, Refused),
    case("absolute-form payments", H1, "POST http://other.example/payments", &[], Json, Any),
    case("absolute-form webhook forged", H1, "POST http://other.example/webhooks/stripe", &[FORGED], Event, Any),
    // Path spellings.
    case("//payments", H1, "POST //payments", &[], Json, Any),
    case("/%70ayments", H1, "POST /%70ayments", &[], Json, Any),
    case("/./payments", H1, "POST /./payments", &[], Json, Any),
    case("/x/../payments", H1, "POST /x/../payments", &[], Json, Any),
    case("/PAYMENTS", H1, "POST /PAYMENTS", &[], Json, Any),
    case("/payments/", H1, "POST /payments/", &[], Json, Any),
    case("/payments;x", H1, "POST /payments;x", &[], Json, Any),
    case("/payments%2F", H1, "POST /payments%2F", &[], Json, Any),
    case("/payments?x=1", H1, "POST /payments?x=1", &[], Json, Refused),
    case("/WEBHOOKS/stripe forged", H1, "POST /WEBHOOKS/stripe", &[FORGED], Event, Any),
    case("/webhooks/stripe/ forged", H1, "POST /webhooks/stripe/", &[FORGED], Event, Any),
    case("//webhooks/stripe forged", H1, "POST //webhooks/stripe", &[FORGED], Event, Any),
    case("/webhooks/%73tripe forged", H1, "POST /webhooks/%73tripe", &[FORGED], Event, Any),
    case("/webhooks/Stripe forged", H1, "POST /webhooks/Stripe", &[FORGED], Event, Any),
    // Header names, duplicates and values.
    case("idempotency-KEY", H1, "POST /payments", &["idempotency-KEY: {key}"], Json, Runs("payments")),
    case("two Idempotency-Key", H1, "POST /payments", &[KEY, "Idempotency-Key: other-key"], Json, Refused),
    case("Idempotency-Key listed twice", H1, "POST /payments", &["Idempotency-Key: {key}, other-key"], Json, Refused),
    case("space before the colon", H1, "POST /payments", &["Idempotency-Key : {key}"], Json, Any),
    case("client Idempotency-Attempt keyed", H1, "POST /payments", &[KEY, "Idempotency-Attempt: 99"], Json, Any),
    case("client Idempotency-Attempt passthrough", H1, "GET /other", &["Idempotency-Attempt: 99"], Empty, Any),
    case("hop-by-hop passthrough", H1, "POST /other", &["Connection: x-hop-canary", "X-Hop-Canary: 1", "Keep-Alive: timeout=5", "Proxy-Connection: keep-alive", "Proxy-Authorization: Basic eDp5", "TE: gzip", "Trailer: x-checksum"], Json, Any),
    case("hop-by-hop keyed", H1, "POST /payments", &[KEY, "Connection: x-hop-canary", "X-Hop-Canary: 1", "Keep-Alive: timeout=5", "Proxy-Connection: keep-alive", "TE: gzip"], Json, Any),
    case("Connection names Idempotency-Key", H1, "POST /payments", &[KEY, "Connection: Idempotency-Key"], Json, Any),
    case("obs-fold key", H1, "POST /payments", &["Idempotency-Key: a", " {key}"], Json, Any),
    case("obs-fold other header", H1, "POST /payments", &["X-Folded: a", " b"], Json, Any),
    // Framing.
    case("Content-Length and Transfer-Encoding", H1, "POST /other", &["Content-Length: 5", "Transfer-Encoding: chunked"], Raw(SMUGGLED), Any),
    case("two Content-Length", H1, "POST /other", &["Content-Length: 2", "Content-Length: 90"], Raw("{}"), Any),
    case("Transfer-Encoding identity, chunked", H1, "POST /other", &["Transfer-Encoding: identity, chunked"], Raw(SMUGGLED), Any),
    case("Expect: 100-continue keyed", H1, "POST /payments", &[KEY, "Expect: 100-continue"], Json, Runs("payments")),
    case("Expect: 100-continue keyless", H1, "POST /payments", &["Expect: 100-continue"], Json, Refused),
    // Forms: fingerprinted by their parts (not their boundary), forwarded byte for byte.
    case("multipart upload keyed", H1, "POST /payments", &[KEY, "Content-Type: multipart/form-data; boundary=X7q", "Content-Length: 117"], Raw(FORM), Runs("payments")),
    case("multipart two boundary parameters", H1, "POST /payments", &[KEY, "Content-Type: multipart/form-data; boundary=X7q; boundary=Zz", "Content-Length: 117"], Raw(FORM), Any),
    case("multipart boundary not in the body", H1, "POST /payments", &[KEY, "Content-Type: multipart/form-data; boundary=Nope", "Content-Length: 117"], Raw(FORM), Any),
    case("multipart boundary* beside boundary", H1, "POST /payments", &[KEY, "Content-Type: multipart/form-data; boundary=X7q; boundary*=utf-8''Zz", "Content-Length: 117"], Raw(FORM), Any),
    case("multipart and a second Content-Type", H1, "POST /payments", &[KEY, "Content-Type: multipart/form-data; boundary=X7q", "Content-Type: application/json", "Content-Length: 117"], Raw(FORM), Any),
    // Upgrades.
    case("Upgrade: h2c keyless", H1, "POST /payments", &["Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"], Json, Any),
    case("Upgrade: h2c passthrough", H1, "GET /other", &["Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"], Empty, Any),
    case("Upgrade: websocket keyless", H1, "POST /payments", &["Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"], Json, Any),
    case("Upgrade: websocket passthrough", H1, "GET /other", &["Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"], Empty, Any),
    // Request trailers over HTTP/1.1, keyed (the body read whole) and passed through (streamed).
    case("trailer x-checksum keyed", H1, "POST /payments", &[KEY], Chunked(&["X-Checksum: 1234"]), Runs("payments")),
    case("trailer TE keyed", H1, "POST /payments", &[KEY], Chunked(&["TE: gzip"]), Any),
    case("trailer Connection keyed", H1, "POST /payments", &[KEY], Chunked(&["Connection: close"]), Any),
    case("trailer Idempotency-Key keyed", H1, "POST /payments", &[KEY], Chunked(&["Idempotency-Key: other-key"]), Any),
    case("trailer Idempotency-Attempt keyed", H1, "POST /payments", &[KEY], Chunked(&["Idempotency-Attempt: 99"]), Any),
    case("trailer X-Forwarded-For keyed", H1, "POST /payments", &[KEY], Chunked(&["X-Forwarded-For: 203.0.113.9"]), Any),
    case("trailer Host keyed", H1, "POST /payments", &[KEY], Chunked(&["Host: evil.example"]), Any),
    case("trailer Authorization keyed", H1, "POST /payments", &[KEY], Chunked(&["Authorization: Bearer someone-else"]), Any),
    case("trailer Content-Length keyed", H1, "POST /payments", &[KEY], Chunked(&["Content-Length: 5"]), Any),
    case("trailer Transfer-Encoding keyed", H1, "POST /payments", &[KEY], Chunked(&["Transfer-Encoding: chunked"]), Any),
    case("trailer Connection-named keyed", H1, "POST /payments", &[KEY], Chunked(&["Connection: x-hop-canary", "X-Hop-Canary: 1"]), Any),
    case("trailer TE passthrough", H1, "POST /other", &[], Chunked(&["TE: gzip"]), Any),
    case("trailer Connection passthrough", H1, "POST /other", &[], Chunked(&["Connection: close"]), Any),
    case("trailer Idempotency-Key passthrough", H1, "POST /other", &[], Chunked(&["Idempotency-Key: other-key"]), Any),
    case("trailer Idempotency-Attempt passthrough", H1, "POST /other", &[], Chunked(&["Idempotency-Attempt: 99"]), Any),
    case("trailer X-Forwarded-For passthrough", H1, "POST /other", &[], Chunked(&["X-Forwarded-For: 203.0.113.9"]), Any),
    case("trailer Host passthrough", H1, "POST /other", &[], Chunked(&["Host: evil.example"]), Any),
    case("trailer Authorization passthrough", H1, "POST /other", &[], Chunked(&["Authorization: Bearer someone-else"]), Any),
    case("trailer Content-Length passthrough", H1, "POST /other", &[], Chunked(&["Content-Length: 5"]), Any),
    case("trailer Transfer-Encoding passthrough", H1, "POST /other", &[], Chunked(&["Transfer-Encoding: chunked"]), Any),
    // HTTP/2 client oddities.
    case("h2 upper-case header name", H2, "POST /payments", &[KEY], Json, Refused),
    case("h2 upper-case other header", H2, "POST /other", &["X-Other: 1"], Json, Refused),
    case("h2 :method post", H2, "post /payments", &[], Json, Any),
    case("h2 :method post webhook forged", H2, "post /webhooks/stripe", &[FORGED], Event, Any),
    case("h2 :path without a slash", H2, "POST payments", &[], Json, Any),
    case("h2 :path //payments", H2, "POST //payments", &[], Json, Any),
    case("h2 :path /PAYMENTS", H2, "POST /PAYMENTS", &[], Json, Any),
    case("h2 :path /WEBHOOKS/stripe forged", H2, "POST /WEBHOOKS/stripe", &[FORGED], Event, Any),
    case("h2 :path /webhooks/stripe/ forged", H2, "POST /webhooks/stripe/", &[FORGED], Event, Any),
    case("h2 :path *", H2, "POST *", &[], Json, Refused),
    case("h2 :authority and host disagree", H2, "POST /payments", &[":authority: a.example", "host: b.example", "idempotency-key: {key}"], Json, Any),
    case("h2 connection header", H2, "POST /other", &["connection: keep-alive"], Json, Refused),
    case("h2 te: gzip", H2, "POST /other", &["te: gzip"], Json, Refused),
    case("h2 te: trailers", H2, "POST /payments", &["te: trailers", "idempotency-key: {key}"], Json, Runs("payments")),
    case("h2 two idempotency-key", H2, "POST /payments", &["idempotency-key: {key}", "idempotency-key: other-key"], Json, Refused),
    case("h2 client idempotency-attempt", H2, "POST /payments", &["idempotency-key: {key}", "idempotency-attempt: 99"], Json, Any),
    // Request trailers over HTTP/2.
    case("h2 trailer te", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["te: gzip"]), Any),
    case("h2 trailer connection", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["connection: close"]), Any),
    case("h2 trailer idempotency-key", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["idempotency-key: other-key"]), Any),
    case("h2 trailer idempotency-attempt", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["idempotency-attempt: 99"]), Any),
    case("h2 trailer x-forwarded-for", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["x-forwarded-for: 203.0.113.9"]), Any),
    case("h2 trailer host", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["host: evil.example"]), Any),
    case("h2 trailer authorization", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["authorization: Bearer someone-else"]), Any),
    case("h2 trailer content-length", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["content-length: 5"]), Any),
    case("h2 trailer transfer-encoding", H2, "POST /payments", &["idempotency-key: {key}"], Chunked(&["transfer-encoding: chunked"]), Any),
    case("h2 trailer idempotency-key passthrough", H2, "POST /other", &[], Chunked(&["idempotency-key: other-key"]), Any),
    case("h2 trailer te passthrough", H2, "POST /other", &[], Chunked(&["te: gzip"]), Any),
];
