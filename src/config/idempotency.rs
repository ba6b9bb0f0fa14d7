//! `[idempotency]`: which requests are protected and how — the key header, the protected methods, the
//! lease and lifetime of a key, the scope and fingerprint headers, which statuses release a claim, what a
//! retry gets while the key is in flight or its outcome unknown. Validated once at load into
//! [`Policy`], the policy `proxy.rs` and `proxy/*` read on every keyed request. Two forms,
//! because names become `HeaderName`s and `Method`s, sizes become `u64` and status lists a
//! [`ReleasePolicy`].
//!
//! The policy is built to be reused by routes: [`RawIdempotency::validate_at`] takes the dotted prefix
//! its errors name. A later `[[routes]]` entry will hold its overrides as `Option`s of these raw fields,
//! lay them over a clone of the section's [`RawIdempotency`], and validate the result with
//! `validate_at("routes[2]")`: its errors then read `routes[2].ttl`, and it gets an [`Policy`]
//! the proxy reads exactly as it reads the section's. (The route would also repeat the check `config.rs`
//! makes across sections, that `server.max_buffered_bodies` and `server.max_buffered_responses` hold its
//! largest body and response.)

use std::sync::Arc;
use std::time::Duration;

use bytesize::ByteSize;
use http::{HeaderName, Method};
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::grpc::GrpcOutcomes;
use super::jwt::{JwtRules, RawScopeJwt};
use super::key_source::{KeySource, parse_pointer};
use super::parse::{exact_size, parse_header, parse_headers, positive};
use super::signature::{ProcessSecrets, RawSignature, SecretReader, SignatureConfig};

/// The prefix of the section's own errors.
pub(super) const SECTION: &str = "idempotency";

/// The single statuses released by default, beside every 5xx: "not processed, try later".
const DEFAULT_RELEASED: [u16; 3] = [408, 425, 429];

/// Released by default on a shared scope too: refusals of who the sender is, which on a scope anyone can
/// reach could answer a forged request first and then, stored, the genuine one. And on a `scope_jwt`
/// scope, where every token of a subject is one client: stored, the app's refusal of one token would
/// answer the retry with its refreshed one.
const SHARED_SCOPE_RELEASED: [u16; 2] = [401, 403];

/// Headers `fingerprint_headers` may not name: each is new on every attempt of the same request.
const NEVER_FINGERPRINTED: [&str; 3] = ["traceparent", "tracestate", "date"];

/// `[idempotency]` as written (and, later, a route's settings merged over it).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIdempotency {
    /// Request header carrying the key.
    pub header: String,
    /// Methods that are protected; others pass through.
    pub methods: Vec<String>,
    /// Reject protected methods without a key (400) instead of passing them through.
    pub required: bool,
    /// How long a key lives after its first claim.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long a claim holds without a heartbeat before another request may take it over.
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// Longest accepted key, in characters.
    pub max_key_length: usize,
    /// Largest request body of a keyed request (it is read whole to fingerprint it).
    #[serde(serialize_with = "exact_size")]
    pub max_request_body: ByteSize,
    /// Largest response body kept for replay; larger responses are forwarded but not retained.
    #[serde(serialize_with = "exact_size")]
    pub max_stored_response: ByteSize,
    /// Request headers whose values separate clients (hashed, never stored raw).
    pub scope_headers: Vec<String>,
    /// Request headers that, besides method, path and body, make two requests the same.
    pub fingerprint_headers: Vec<String>,
    /// Upstream statuses that release the claim instead of being stored (`"5xx"` or a code); absent
    /// means `5xx`, 408, 425 and 429, and on a shared scope also 401 and 403.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub release_statuses: Option<Vec<String>>,
    /// gRPC status codes (names or numbers) whose keyed calls give the key back instead of being
    /// stored; absent means UNAVAILABLE, RESOURCE_EXHAUSTED and ABORTED.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_release_codes: Option<Vec<String>>,
    /// gRPC status codes whose keyed calls have an unknown outcome (`on_unknown_outcome`); absent
    /// means DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, INTERNAL and DATA_LOSS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_unknown_codes: Option<Vec<String>>,
    /// What a keyed request without any of `scope_headers` gets: refused, or one scope shared by all
    /// such requests.
    pub unscoped: Unscoped,
    /// The `Retry-After` of a 409 for a key in flight (never more than the lease left).
    #[serde(with = "humantime_serde")]
    pub in_flight_retry_after: Duration,
    /// The HTTP status of a `key-in-flight` refusal: 409 (the draft standard's), 429 or 503.
    pub in_flight_status: u16,
    /// The HTTP status of a `key-reused` refusal: 422 (the draft standard's), or 409 or 400 for an API
    /// where 422 means a validation error.
    pub mismatch_status: u16,
    /// What happens to a key whose request may have reached the upstream but got no full answer.
    pub on_unknown_outcome: OnUnknownOutcome,
    /// With `key = "graphql"`: whether a keyed field answered with an error and no value is released (a
    /// retry runs it again) rather than stored.
    pub release_graphql_errors: bool,
    /// Response headers relayed to the first client but neither stored nor replayed.
    pub never_store_headers: Vec<String>,
    /// Where the key comes from: `header:NAME`, `cloudevents`, `json:/pointer` or `template:…`; absent
    /// means `header:` + `header`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// How the body counts in the fingerprint: its bytes, or its JSON meaning (key order and whitespace
    /// ignored; a body that is not JSON counts by its bytes).
    pub fingerprint_body: FingerprintBody,
    /// JSON pointers to body fields the fingerprint leaves out (volatile fields such as timestamps);
    /// needs `fingerprint_body = "json"`.
    pub fingerprint_exclude: Vec<String>,
    /// What a request gets while another with its key is in flight: 409 at once, or the original's
    /// response once it completes.
    pub on_in_flight: OnInFlight,
    /// Longest a request waits for the original with `on_in_flight = "wait"` before it gets 409.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// With `key = "repeatability"` (OASIS Repeatable Requests): how long after a request was first
    /// sent (`Repeatability-First-Sent`) it may still come; older ones are refused 412.
    #[serde(with = "humantime_serde")]
    pub repeatability_window: Duration,
    /// A cookie whose value, hashed, also separates clients (for browser-facing apps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope_cookie: Option<String>,
    /// Whether a TLS client certificate (its public key) also separates clients; needs
    /// `server.tls.client_ca`.
    pub scope_client_cert: bool,
    /// The bearer token verified (signature, times, issuer, audience), its claims separating clients
    /// in place of the `Authorization` header's spelling.
    /// `false` on a route turns off the section's.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::jwt::table_or_off"
    )]
    pub scope_jwt: Option<RawScopeJwt>,
    /// A response header telling the client when its key expires (an HTTP date); absent means none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_header: Option<String>,
    /// The webhook signature every request of a protected method must carry; absent means none is
    /// checked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signature: Option<RawSignature>,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency {
            header: "Idempotency-Key".into(),
            methods: vec!["POST".into(), "PATCH".into()],
            required: false,
            ttl: Duration::from_secs(24 * 3600),
            lock_timeout: Duration::from_secs(30),
            max_key_length: 255,
            max_request_body: ByteSize::mib(10),
            max_stored_response: ByteSize::mib(4),
            scope_headers: vec!["authorization".into()],
            fingerprint_headers: vec!["content-type".into()],
            release_statuses: None,
            grpc_release_codes: None,
            grpc_unknown_codes: None,
            unscoped: Unscoped::Reject,
            in_flight_retry_after: Duration::from_secs(1),
            in_flight_status: 409,
            mismatch_status: 422,
            on_unknown_outcome: OnUnknownOutcome::Retry,
            release_graphql_errors: false,
            never_store_headers: vec!["set-cookie".into()],
            key: None,
            fingerprint_body: FingerprintBody::Bytes,
            fingerprint_exclude: Vec::new(),
            on_in_flight: OnInFlight::Reject,
            wait_timeout: Duration::from_secs(10),
            repeatability_window: Duration::from_secs(5 * 60),
            scope_cookie: None,
            scope_client_cert: false,
            scope_jwt: None,
            expires_header: None,
            signature: None,
        }
    }
}

/// How far ahead of the proxy's clock a `Repeatability-First-Sent` may be and still be taken.
pub const REPEATABILITY_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// What the fingerprint of a route keyed by `jsonrpc` always leaves out: the request `id` (a retry sends a
/// new one) and `params._meta` (metadata an SDK may make anew per attempt: MCP's `progressToken`, trace
/// context), never the call itself (`method`, the rest of `params`).
pub const JSONRPC_UNFINGERPRINTED: [&str; 2] = ["/id", "/params/_meta"];

/// How a keyed request's body counts in its fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FingerprintBody {
    /// Byte for byte.
    Bytes,
    /// By its JSON meaning: object key order and insignificant whitespace do not count, nor do the
    /// fields `fingerprint_exclude` names. A body that does not parse as JSON counts byte for byte.
    Json,
}

/// What a request gets while another request with its key is being executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnInFlight {
    /// 409 `key-in-flight` with `Retry-After`.
    Reject,
    /// Wait up to `wait_timeout` for the original and answer with its response (or execute, if it
    /// failed); 409 if it does not end in time.
    Wait,
    /// Follow the original's response as it is relayed, from its first byte, where this replica runs
    /// it; elsewhere (or once its beginning is no longer kept) as `Wait`.
    Attach,
}

impl OnInFlight {
    /// Whether a duplicate waits for the original rather than getting 409 at once.
    pub fn waits(self) -> bool {
        matches!(self, OnInFlight::Wait | OnInFlight::Attach)
    }
}

/// What a keyed request that carries none of the scope headers gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unscoped {
    /// 400 `missing-scope`, not forwarded.
    Reject,
    /// Served in one scope shared by every such request.
    Shared,
}

/// What happens to a key whose request may have reached the upstream without a full answer coming back
/// (a timeout, or a connection reset mid-response).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnknownOutcome {
    /// The claim is left to its lease; a retry after it executes again (a stale takeover).
    Retry,
    /// The record is marked `unknown`: retries get 502 until `idemproxy keys release`.
    Hold,
}

/// A route's idempotency policy, validated: `[idempotency]` for the default route, and a `[[routes]]`
/// entry's own settings over it for that route. The TOML is flat; here the settings are split by the
/// stage that reads them, so each stage names only its own.
#[derive(Debug, Clone)]
pub struct Policy {
    /// What intake reads: where the key is, who the client is, what the fingerprint covers.
    pub key: KeyRules,
    /// What the claim and the wait read: the lease, the lifetime, what a duplicate in flight gets.
    pub claim: ClaimRules,
    /// What the execution reads: what is stored, released or held, and what a response carries.
    pub store: StoreRules,
    /// The webhook signature checked before the claim, if any.
    pub signature: Option<Arc<SignatureConfig>>,
    /// The statuses of the refusals a route may set its own for.
    pub statuses: ProblemStatuses,
}

/// The rules intake (and the spine, choosing what to protect) reads.
#[derive(Debug, Clone)]
pub struct KeyRules {
    /// Where the key comes from.
    pub source: KeySource,
    /// Key header name.
    pub header: HeaderName,
    /// Protected methods.
    pub methods: Vec<Method>,
    /// Whether protected methods must carry a key.
    pub required: bool,
    /// Longest key.
    pub max_key_length: usize,
    /// Largest keyed request body, bytes.
    pub max_request_body: u64,
    /// Scope headers, lower-case.
    pub scope_headers: Vec<HeaderName>,
    /// A cookie that also separates clients.
    pub scope_cookie: Option<String>,
    /// Whether a TLS client certificate's public key also separates clients.
    pub scope_client_cert: bool,
    /// The bearer token's verified claims, separating clients.
    pub scope_jwt: Option<Arc<JwtRules>>,
    /// Keyed requests without a scope header: refused or shared.
    pub unscoped: Unscoped,
    /// Fingerprint headers, lower-case.
    pub fingerprint_headers: Vec<HeaderName>,
    /// How the body counts in the fingerprint.
    pub fingerprint_body: FingerprintBody,
    /// JSON pointers left out of the fingerprint (only with [`FingerprintBody::Json`]).
    pub fingerprint_exclude: Vec<String>,
    /// With [`KeySource::Repeatability`]: how long after it was first sent a request may come.
    pub repeatability_window: Duration,
}

/// The rules the claim and the wait read.
#[derive(Debug, Clone)]
pub struct ClaimRules {
    /// Key lifetime.
    pub ttl: Duration,
    /// Claim lease.
    pub lock_timeout: Duration,
    /// 409 at once, wait for the original, or attach to it.
    pub on_in_flight: OnInFlight,
    /// Longest wait for the original.
    pub wait_timeout: Duration,
    /// `Retry-After` of a 409 for a key in flight.
    pub in_flight_retry_after: Duration,
}

/// The rules the execution reads.
#[derive(Debug, Clone)]
pub struct StoreRules {
    /// Largest stored response body, bytes.
    pub max_stored_response: u64,
    /// Statuses that release the claim.
    pub release: ReleasePolicy,
    /// What a gRPC call's status means for its key.
    pub grpc: GrpcOutcomes,
    /// Unknown outcomes: retried after the lease, or held.
    pub on_unknown_outcome: OnUnknownOutcome,
    /// Whether a GraphQL field answered with an error and no value is released rather than stored.
    pub release_graphql_errors: bool,
    /// Response headers never stored, lower-case.
    pub never_store_headers: Vec<HeaderName>,
    /// The response header advertising the key's expiry, if any.
    pub expires_header: Option<HeaderName>,
}

/// The HTTP statuses of the refusals whose status an API may need to be its own (IETF httpapi
/// idempotency draft, issue #42): the rest of the contract is fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProblemStatuses {
    /// `key-in-flight`.
    pub in_flight: http::StatusCode,
    /// `key-reused`.
    pub mismatch: http::StatusCode,
}

impl Default for ProblemStatuses {
    fn default() -> Self {
        ProblemStatuses {
            in_flight: http::StatusCode::CONFLICT,
            mismatch: http::StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// `value` as a status, if it is one of `allowed`.
fn one_of(key: &str, value: u16, allowed: &[u16]) -> Result<http::StatusCode, ConfigError> {
    match http::StatusCode::from_u16(value) {
        Ok(status) if allowed.contains(&value) => Ok(status),
        _ => {
            let allowed: Vec<String> = allowed.iter().map(u16::to_string).collect();
            Err(ConfigError::new(
                key,
                format!("must be one of {}", allowed.join(", ")),
            ))
        }
    }
}

/// Which upstream statuses mean "not processed, run it again" and so release the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePolicy {
    /// Release every 5xx.
    pub server_errors: bool,
    /// Individual codes to release.
    pub codes: Vec<u16>,
}

impl ReleasePolicy {
    /// Whether a response with this status releases the claim rather than being stored.
    pub fn releases(&self, status: http::StatusCode) -> bool {
        (self.server_errors && status.is_server_error()) || self.codes.contains(&status.as_u16())
    }
}

impl RawIdempotency {
    /// Checks the `[idempotency]` section and converts it; the first problem found is returned.
    pub fn validate(&self) -> Result<Policy, ConfigError> {
        self.validate_at(SECTION)
    }

    /// [`RawIdempotency::validate`], reading signature secrets through `secrets`.
    pub fn validate_section(&self, secrets: &dyn SecretReader) -> Result<Policy, ConfigError> {
        self.validate_with(SECTION, secrets)
    }

    /// Checks these settings and converts them, naming every key (in errors and in messages that refer
    /// to a sibling key) under `prefix`: `idempotency` for the section, a route's own path for a route.
    /// Signature secrets are read from the process's environment and files.
    pub fn validate_at(&self, prefix: &str) -> Result<Policy, ConfigError> {
        self.validate_with(prefix, &ProcessSecrets)
    }

    /// [`RawIdempotency::validate_at`], reading signature secrets through `secrets`.
    pub fn validate_with(&self, prefix: &str, secrets: &dyn SecretReader) -> Result<Policy, ConfigError> {
        let key = |field: &str| format!("{prefix}.{field}");
        positive(&key("lock_timeout"), self.lock_timeout)?;
        if self.ttl <= self.lock_timeout {
            return Err(ConfigError::new(
                &key("ttl"),
                format!("must be longer than {}", key("lock_timeout")),
            ));
        }
        if self.scope_headers.is_empty()
            && self.scope_cookie.is_none()
            && !self.scope_client_cert
            && self.scope_jwt.is_none()
            && self.unscoped == Unscoped::Reject
        {
            return Err(ConfigError::new(
                &key("scope_headers"),
                format!(
                    "is empty while {prefix}.unscoped = \"reject\", so every keyed request would be refused; \
                     name the header that identifies the client (e.g. [\"authorization\"]), or set \
                     {prefix}.unscoped = \"shared\" to let all clients share one scope"
                ),
            ));
        }
        self.check_fingerprint_headers(&key("fingerprint_headers"))?;
        if !(1..=4096).contains(&self.max_key_length) {
            return Err(ConfigError::new(
                &key("max_key_length"),
                "must be between 1 and 4096",
            ));
        }
        let header = parse_header(&key("header"), &self.header)?;
        let source = self.key_source(&key("key"), &header)?;
        let (fingerprint_body, fingerprint_exclude) = self.fingerprint_body(prefix, &source)?;
        let fingerprint_headers = self.fingerprint_headers(&key("fingerprint_headers"), &source)?;
        let repeatability_window = self.repeatability_window(prefix, &source)?;
        Ok(Policy {
            key: KeyRules {
                source,
                header,
                methods: self.methods(&key("methods"))?,
                required: self.required,
                max_key_length: self.max_key_length,
                max_request_body: self.max_request_body.as_u64(),
                scope_headers: self.scope_headers(&key("scope_headers"))?,
                scope_cookie: self.scope_cookie(&key("scope_cookie"))?,
                scope_client_cert: self.scope_client_cert,
                scope_jwt: self
                    .scope_jwt
                    .as_ref()
                    .map(|raw| raw.validate(&key("scope_jwt")).map(Arc::new))
                    .transpose()?,
                unscoped: self.unscoped,
                fingerprint_headers,
                fingerprint_body,
                fingerprint_exclude,
                repeatability_window,
            },
            claim: ClaimRules {
                ttl: self.ttl,
                lock_timeout: self.lock_timeout,
                on_in_flight: self.on_in_flight,
                wait_timeout: positive(&key("wait_timeout"), self.wait_timeout)?,
                in_flight_retry_after: self.in_flight_retry_after(prefix)?,
            },
            store: StoreRules {
                max_stored_response: self.max_stored_response.as_u64(),
                release: self.release(&key("release_statuses"))?,
                grpc: GrpcOutcomes::parse(
                    self.grpc_release_codes.as_deref(),
                    self.grpc_unknown_codes.as_deref(),
                    &key("grpc_release_codes"),
                    &key("grpc_unknown_codes"),
                )?,
                on_unknown_outcome: self.on_unknown_outcome,
                release_graphql_errors: self.release_graphql_errors,
                never_store_headers: parse_headers(&key("never_store_headers"), &self.never_store_headers)?,
                expires_header: self
                    .expires_header
                    .as_deref()
                    .map(|name| parse_header(&key("expires_header"), name))
                    .transpose()?,
            },
            signature: self
                .signature
                .as_ref()
                .map(|raw| raw.validate(&key("signature"), secrets).map(Arc::new))
                .transpose()?,
            statuses: ProblemStatuses {
                in_flight: one_of(&key("in_flight_status"), self.in_flight_status, &[409, 429, 503])?,
                mismatch: one_of(&key("mismatch_status"), self.mismatch_status, &[400, 409, 422])?,
            },
        })
    }

    fn key_source(&self, key: &str, header: &HeaderName) -> Result<KeySource, ConfigError> {
        match &self.key {
            Some(text) => KeySource::parse(key, text),
            None => Ok(KeySource::Header(header.clone())),
        }
    }

    /// How the body counts in the fingerprint, and what it leaves out. A `jsonrpc` key counts the body
    /// by its JSON meaning without the request `id` and `params._meta` ([`JSONRPC_UNFINGERPRINTED`]):
    /// a client's retry of one call sends a new `id`, and its SDK may put a new progress token or trace
    /// context in `_meta`.
    fn fingerprint_body(
        &self,
        prefix: &str,
        source: &KeySource,
    ) -> Result<(FingerprintBody, Vec<String>), ConfigError> {
        let jsonrpc = matches!(source, KeySource::JsonRpc(_));
        let body = if jsonrpc {
            FingerprintBody::Json
        } else {
            self.fingerprint_body
        };
        let mut exclude = self.fingerprint_exclude(prefix, body)?;
        if jsonrpc {
            for pointer in JSONRPC_UNFINGERPRINTED {
                if !exclude.iter().any(|p| p == pointer) {
                    exclude.push(pointer.to_owned());
                }
            }
        }
        Ok((body, exclude))
    }

    fn fingerprint_exclude(&self, prefix: &str, body: FingerprintBody) -> Result<Vec<String>, ConfigError> {
        let key = format!("{prefix}.fingerprint_exclude");
        if !self.fingerprint_exclude.is_empty() && body != FingerprintBody::Json {
            return Err(ConfigError::new(
                &key,
                format!("names JSON fields, so it needs {prefix}.fingerprint_body = \"json\""),
            ));
        }
        self.fingerprint_exclude
            .iter()
            .map(|pointer| match parse_pointer(&key, pointer)? {
                p if p.is_empty() => Err(ConfigError::new(&key, "\"\" would leave out the whole body")),
                p => Ok(p),
            })
            .collect()
    }

    /// The scope headers; with `scope_jwt`, never `Authorization`, whose verified claims stand for it:
    /// hashing its spelling too would make a refreshed token another client again.
    fn scope_headers(&self, key: &str) -> Result<Vec<HeaderName>, ConfigError> {
        let mut headers = parse_headers(key, &self.scope_headers)?;
        if self.scope_jwt.is_some() {
            headers.retain(|name| name != http::header::AUTHORIZATION);
        }
        Ok(headers)
    }

    fn scope_cookie(&self, key: &str) -> Result<Option<String>, ConfigError> {
        let Some(name) = &self.scope_cookie else {
            return Ok(None);
        };
        // A cookie name is an RFC 6265 token: visible ASCII without separators.
        let token = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
        if !token {
            return Err(ConfigError::new(key, format!("{name:?} is not a cookie name")));
        }
        Ok(Some(name.clone()))
    }

    /// Refuses headers that differ between a request and its retry by design: fingerprinting one would
    /// turn every retry into a 422 mismatch.
    fn check_fingerprint_headers(&self, key: &str) -> Result<(), ConfigError> {
        let Some(name) = self
            .fingerprint_headers
            .iter()
            .find(|name| NEVER_FINGERPRINTED.iter().any(|n| n.eq_ignore_ascii_case(name)))
        else {
            return Ok(());
        };
        Err(ConfigError::new(
            key,
            format!(
                "may not name {name:?}: it changes between a request and its retry (trace context is new \
                 per attempt, Date is the send time), so every retry would be refused as a mismatch (422)"
            ),
        ))
    }

    /// The repeatability window: more than nothing, and no longer than the records are kept (`ttl`),
    /// or a retry inside it could find its record gone and run again.
    /// Checked only on a route keyed by `repeatability`: at least a second, in whole seconds (the
    /// first-sent time has no finer ones), and short enough that a record outlives every retry the
    /// window lets in, one first sent up to [`REPEATABILITY_CLOCK_SKEW`] ahead of this clock included.
    fn repeatability_window(&self, prefix: &str, source: &KeySource) -> Result<Duration, ConfigError> {
        let value = self.repeatability_window;
        if *source != KeySource::Repeatability {
            return Ok(value);
        }
        let key = format!("{prefix}.repeatability_window");
        if value < Duration::from_secs(1) || value.subsec_nanos() != 0 {
            return Err(ConfigError::new(&key, "must be whole seconds, at least 1s"));
        }
        if value.saturating_add(REPEATABILITY_CLOCK_SKEW) > self.ttl {
            return Err(ConfigError::new(
                &key,
                format!(
                    "must be at least a minute shorter than {prefix}.ttl: a request first sent up to a \
                     minute ahead of the proxy's clock is taken, and its record must outlive its retries"
                ),
            ));
        }
        Ok(value)
    }

    /// The fingerprint headers; on a route keyed by `repeatability`, `Repeatability-First-Sent` too: a
    /// retry sends the time the request was first sent, and one that moves it would otherwise slip a
    /// retry past the window.
    fn fingerprint_headers(&self, key: &str, source: &KeySource) -> Result<Vec<HeaderName>, ConfigError> {
        let mut names = parse_headers(key, &self.fingerprint_headers)?;
        let first_sent = HeaderName::from_static("repeatability-first-sent");
        if *source == KeySource::Repeatability && !names.contains(&first_sent) {
            names.push(first_sent);
        }
        Ok(names)
    }

    fn in_flight_retry_after(&self, prefix: &str) -> Result<Duration, ConfigError> {
        let value = self.in_flight_retry_after;
        if value < Duration::from_secs(1) || value > self.lock_timeout.max(Duration::from_secs(1)) {
            return Err(ConfigError::new(
                &format!("{prefix}.in_flight_retry_after"),
                format!("must be from 1s (Retry-After counts whole seconds) to {prefix}.lock_timeout"),
            ));
        }
        Ok(value)
    }

    fn methods(&self, key: &str) -> Result<Vec<Method>, ConfigError> {
        self.methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| ConfigError::new(key, format!("{m:?} is not an HTTP method")))
            })
            .collect()
    }

    /// The statuses that release a claim: as listed, or by default 5xx, 408, 425 and 429, and on a
    /// shared scope 401 and 403 too: there anyone who can reach the route shares the key's scope, and a
    /// refusal of a forged request must not be stored as the answer to the genuine one.
    fn release(&self, key: &str) -> Result<ReleasePolicy, ConfigError> {
        let Some(listed) = &self.release_statuses else {
            let mut codes = DEFAULT_RELEASED.to_vec();
            // On a scope shared by all, and on one that is the token's subject: there a refreshed
            // token is the same client, and the app's refusal of the token it replaced (expired for the
            // app, within the proxy's leeway, or revoked) must not answer it.
            if self.unscoped == Unscoped::Shared || self.scope_jwt.is_some() {
                codes.extend(SHARED_SCOPE_RELEASED);
            }
            return Ok(ReleasePolicy {
                server_errors: true,
                codes,
            });
        };
        let mut policy = ReleasePolicy {
            server_errors: false,
            codes: Vec::new(),
        };
        for entry in listed {
            if entry.eq_ignore_ascii_case("5xx") {
                policy.server_errors = true;
                continue;
            }
            match entry.parse::<u16>() {
                Ok(code) if (100..=599).contains(&code) => policy.codes.push(code),
                _ => {
                    return Err(ConfigError::new(
                        key,
                        format!("{entry:?} is neither \"5xx\" nor a status code"),
                    ));
                }
            }
        }
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Method;

    use super::{OnUnknownOutcome, RawIdempotency, Unscoped};
    use crate::config::Config;

    #[test]
    fn a_repeatability_window_is_checked_on_its_routes_only_and_leaves_a_minute_to_the_ttl() {
        let route = |toml: &str| Config::from_toml_str(toml).map(|c| c.routes.default.policy.clone());
        let short_ttl = "[idempotency]\nttl = \"2m\"\nlock_timeout = \"10s\"\n";
        assert!(
            route(short_ttl).is_ok(),
            "a short ttl is no concern of a route keyed otherwise"
        );
        let keyed = format!("{short_ttl}key = \"repeatability\"\n");
        let refused = route(&keyed).unwrap_err();
        assert_eq!(refused.key, "idempotency.repeatability_window", "{refused}");
        let fits = route(&format!("{keyed}repeatability_window = \"60s\"\n")).unwrap();
        assert_eq!(fits.key.repeatability_window, Duration::from_secs(60));
        assert!(
            fits.key
                .fingerprint_headers
                .iter()
                .any(|name| name == "repeatability-first-sent"),
            "a retry's first-sent time is part of the request"
        );
        for window in ["0s", "500ms", "1500ms"] {
            let refused = route(&format!("{keyed}repeatability_window = \"{window}\"\n")).unwrap_err();
            assert_eq!(
                refused.key, "idempotency.repeatability_window",
                "{window}: {refused}"
            );
        }
    }

    #[test]
    fn durations_and_sizes_parse() {
        let config = Config::from_toml_str(
            "[idempotency]\nttl = \"2h\"\nlock_timeout = \"5s\"\nmax_stored_response = \"1MiB\"\n",
        )
        .unwrap();
        assert_eq!(config.routes.default.policy.claim.ttl, Duration::from_secs(7200));
        assert_eq!(
            config.routes.default.policy.store.max_stored_response,
            1024 * 1024
        );
    }

    #[test]
    fn a_jsonrpc_route_counts_the_body_as_json_and_adds_its_own_exclusions() {
        let config = Config::from_toml_str(
            "[[routes]]\nname = \"mcp\"\npath = \"/mcp\"\nkey = \"jsonrpc\"\n\
             fingerprint_exclude = [\"/params/arguments/sent_at\", \"/id\"]\n",
        )
        .unwrap();
        let policy = &config.routes.routes[0].policy;
        assert_eq!(policy.key.fingerprint_body, super::FingerprintBody::Json);
        assert_eq!(
            policy.key.fingerprint_exclude,
            ["/params/arguments/sent_at", "/id", "/params/_meta"]
        );
        let plain = Config::from_toml_str("[idempotency]\nkey = \"json:/id\"\n").unwrap();
        assert_eq!(
            plain.routes.default.policy.key.fingerprint_body,
            super::FingerprintBody::Bytes,
            "only jsonrpc routes"
        );
    }

    #[test]
    fn bad_duration_names_the_key() {
        let err = Config::from_toml_str("[idempotency]\nttl = \"forever\"\n").unwrap_err();
        assert_eq!(err.key, "idempotency.ttl");
    }

    #[test]
    fn ttl_must_exceed_lease() {
        let err = Config::from_toml_str("[idempotency]\nttl = \"1s\"\nlock_timeout = \"2s\"\n").unwrap_err();
        assert_eq!(err.key, "idempotency.ttl");
    }

    #[test]
    fn release_policy_parses_classes_and_codes() {
        let config = Config::from_toml_str("[idempotency]\nrelease_statuses = [\"5xx\", \"409\"]\n").unwrap();
        let policy = &config.routes.default.policy.store.release;
        assert!(policy.releases(http::StatusCode::BAD_GATEWAY));
        assert!(policy.releases(http::StatusCode::CONFLICT));
        assert!(!policy.releases(http::StatusCode::TOO_MANY_REQUESTS));
        let err = Config::from_toml_str("[idempotency]\nrelease_statuses = [\"4xx\"]\n").unwrap_err();
        assert_eq!(err.key, "idempotency.release_statuses");
    }

    #[test]
    fn a_shared_scope_releases_401_and_403_unless_the_statuses_are_listed() {
        use http::StatusCode;
        let config = Config::from_toml_str(
            "[[routes]]\nname = \"hook\"\npath = \"/hook\"\nunscoped = \"shared\"\nscope_headers = []\n\
             [[routes]]\nname = \"listed\"\npath = \"/listed\"\nunscoped = \"shared\"\n\
             release_statuses = [\"5xx\"]\n",
        )
        .unwrap();
        let (shared, listed) = (&config.routes.routes[0].policy, &config.routes.routes[1].policy);
        let private = &config.routes.default.policy;
        for status in [StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN] {
            assert!(shared.store.release.releases(status), "{status}");
            assert!(!private.store.release.releases(status), "{status}");
            assert!(
                !listed.store.release.releases(status),
                "an explicit list wins: {status}"
            );
        }
        for status in [
            StatusCode::BAD_GATEWAY,
            StatusCode::REQUEST_TIMEOUT,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            assert!(
                shared.store.release.releases(status) && private.store.release.releases(status),
                "{status}"
            );
        }
        assert!(!shared.store.release.releases(StatusCode::UNPROCESSABLE_ENTITY));
        let section = Config::from_toml_str(
            "[idempotency]\nrelease_statuses = [\"5xx\", \"408\"]\n\
             [[routes]]\nname = \"hook\"\npath = \"/hook\"\nunscoped = \"shared\"\n",
        )
        .unwrap();
        let inherited = &section.routes.routes[0].policy.store.release;
        assert!(
            !inherited.releases(StatusCode::UNAUTHORIZED),
            "the section's list is explicit too"
        );
    }

    #[test]
    fn headers_new_on_every_retry_are_refused_as_fingerprint_headers() {
        for name in ["traceparent", "TraceState", "date"] {
            let toml = format!("[idempotency]\nfingerprint_headers = [\"content-type\", \"{name}\"]\n");
            let err = Config::from_toml_str(&toml).unwrap_err();
            assert_eq!(err.key, "idempotency.fingerprint_headers", "{name}");
            assert!(err.to_string().contains("retry"), "{err}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn methods_are_read_in_any_case_and_header_names_checked() {
        let config =
            Config::from_toml_str("[idempotency]\nheader = \"X-Key\"\nmethods = [\"post\", \"PuT\"]\n")
                .unwrap();
        assert_eq!(
            config.routes.default.policy.key.methods,
            vec![Method::POST, Method::PUT]
        );
        assert_eq!(config.routes.default.policy.key.header.as_str(), "x-key");
        for (text, key) in [
            ("methods = [\"PO ST\"]", "idempotency.methods"),
            ("header = \"a b\"", "idempotency.header"),
            ("scope_headers = [\"a b\"]", "idempotency.scope_headers"),
            (
                "fingerprint_headers = [\"a b\"]",
                "idempotency.fingerprint_headers",
            ),
            ("max_key_length = 0", "idempotency.max_key_length"),
            ("lock_timeout = \"0s\"", "idempotency.lock_timeout"),
        ] {
            let err = Config::from_toml_str(&format!("[idempotency]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn an_empty_scope_is_refused_unless_scopes_may_be_shared() {
        let err = Config::from_toml_str("[idempotency]\nscope_headers = []\n").unwrap_err();
        assert_eq!(err.key, "idempotency.scope_headers");
        assert!(err.to_string().contains("unscoped"), "{err}");
        let shared =
            Config::from_toml_str("[idempotency]\nscope_headers = []\nunscoped = \"shared\"\n").unwrap();
        assert_eq!(shared.routes.default.policy.key.unscoped, Unscoped::Shared);
        assert_eq!(
            Config::from_toml_str("")
                .unwrap()
                .routes
                .default
                .policy
                .key
                .unscoped,
            Unscoped::Reject
        );
    }

    #[test]
    fn guarantee_settings_have_safe_defaults_and_named_errors() {
        let config = Config::from_toml_str("").unwrap();
        assert_eq!(
            config.routes.default.policy.claim.in_flight_retry_after,
            Duration::from_secs(1)
        );
        assert_eq!(
            config.routes.default.policy.store.on_unknown_outcome,
            OnUnknownOutcome::Retry
        );
        assert_eq!(
            config.routes.default.policy.store.never_store_headers,
            vec![http::header::SET_COOKIE]
        );
        for (text, key) in [
            (
                "[idempotency]\nin_flight_retry_after = \"500ms\"",
                "idempotency.in_flight_retry_after",
            ),
            (
                "[idempotency]\nin_flight_retry_after = \"40s\"",
                "idempotency.in_flight_retry_after",
            ),
            (
                "[idempotency]\non_unknown_outcome = \"maybe\"",
                "idempotency.on_unknown_outcome",
            ),
            (
                "[idempotency]\nnever_store_headers = [\"a b\"]",
                "idempotency.never_store_headers",
            ),
        ] {
            let err = Config::from_toml_str(text).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn settings_validated_under_another_prefix_name_it_in_keys_and_messages() {
        let short = RawIdempotency {
            ttl: Duration::from_secs(1),
            ..RawIdempotency::default()
        };
        let err = short.validate_at("routes[2]").unwrap_err();
        assert_eq!(err.key, "routes[2].ttl");
        assert_eq!(err.message, "must be longer than routes[2].lock_timeout");
        let unscoped = RawIdempotency {
            scope_headers: Vec::new(),
            ..RawIdempotency::default()
        };
        let err = unscoped.validate_at("routes[2]").unwrap_err();
        assert_eq!(err.key, "routes[2].scope_headers");
        assert!(err.message.contains("routes[2].unscoped = \"shared\""), "{err}");
        let section = RawIdempotency::default().validate().unwrap();
        let route = RawIdempotency::default().validate_at("routes[0]").unwrap();
        assert_eq!(
            (section.claim.ttl, section.key.methods),
            (route.claim.ttl, route.key.methods)
        );
    }
}
