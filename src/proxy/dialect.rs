//! The protocols a request may speak, as far as its key is concerned: plain HTTP, gRPC and JSON-RPC
//! (one file each beside this one), and event streams as a way a response may be resumed (`sse.rs`).
//! Every question the stages ask of a protocol is a method of [`Dialect`] here, and every answer is one
//! exhaustive match: what the head and the end of the upstream's answer mean for the record (store,
//! release, unknown), how a replay answers the retry, what shape a refusal takes, whether a duplicate
//! may follow the running response, and what the request carries upstream. So the stages name no
//! protocol, and a new one is a variant, a file, and the compiler's list of matches to fill in.
//! Pure functions of the request, the response and the route's rules.

pub mod graphql;
pub mod grpc;
pub mod http;
pub mod jsonrpc;
pub mod sse;
pub mod verdict;

use std::sync::Arc;
use std::time::Duration;

use ::http::{HeaderMap, Request, Response, StatusCode};
use bytes::Bytes;

use self::jsonrpc::CallId;
pub(crate) use self::verdict::{OnHead, Verdict};
use crate::body::ProxyBody;
use crate::config::{ProblemStatuses, StoreRules};
use crate::error::ProxyError;
use crate::metrics::RouteSeries;

/// The protocol a request speaks. Told from its head (gRPC by its content type), then, once its body is
/// read on a route keyed by `jsonrpc`, from its call ([`Dialect::called`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// Plain HTTP: every request that is neither of the others.
    Http,
    /// A gRPC call (`application/grpc…` over HTTP/2): its outcome is its `grpc-status`, its refusals are
    /// gRPC statuses, and it has a deadline of its own.
    Grpc,
    /// A JSON-RPC call with an `id`, on a route that reads its key from the call: a replay answers the
    /// retry's own `id`.
    JsonRpc(CallId),
}

impl Dialect {
    /// The dialect a request's head speaks.
    pub(crate) fn of(headers: &HeaderMap) -> Dialect {
        if grpc::is_grpc_headers(headers) {
            return Dialect::Grpc;
        }
        Dialect::Http
    }

    /// The dialect once the body is read: a request that is a JSON-RPC call with an `id` (`id`, read by
    /// `key/source.rs` on a route keyed by `jsonrpc`) is that call, whatever its content type says (a
    /// gRPC body is never a JSON-RPC call, so one that holds a call was mislabelled).
    pub(crate) fn called(self, id: Option<CallId>) -> Dialect {
        match id {
            Some(id) => Dialect::JsonRpc(id),
            None => self,
        }
    }

    /// Whether the request passes through untouched whatever its route says: a gRPC health check or
    /// reflection call.
    pub(crate) fn passes_untouched<B>(&self, request: &Request<B>) -> bool {
        match self {
            Dialect::Grpc => grpc::is_infrastructure(request),
            Dialect::Http | Dialect::JsonRpc(_) => false,
        }
    }

    /// The proxy's own refusal as this dialect's client reads it: a gRPC status, or problem+json
    /// (a JSON-RPC client gets the HTTP status and problem too: the refusal is of the request, not an
    /// answer of the service).
    pub(crate) fn refusal(
        &self,
        error: ProxyError,
        base: &str,
        statuses: &ProblemStatuses,
    ) -> Response<ProxyBody> {
        match self {
            Dialect::Grpc => error.into_grpc(base),
            Dialect::Http | Dialect::JsonRpc(_) => error.into_problem(base, statuses),
        }
    }

    /// The answer as it leaves for the client, counted as the dialect counts (a gRPC call by the status
    /// its client gets, in `idemproxy_grpc_calls_total`).
    pub(crate) fn counted(
        &self,
        response: Response<ProxyBody>,
        series: &Arc<RouteSeries>,
    ) -> Response<ProxyBody> {
        match self {
            Dialect::Grpc => grpc::counted(response, series.clone()),
            Dialect::Http | Dialect::JsonRpc(_) => response,
        }
    }

    /// How long the client waits for its answer, when the dialect gives it a deadline of its own (a
    /// gRPC call's `grpc-timeout`); the execution runs on under `upstream.timeout` either way.
    pub(crate) fn client_deadline(&self, headers: &HeaderMap) -> Option<Duration> {
        match self {
            Dialect::Grpc => grpc::timeout(headers),
            Dialect::Http | Dialect::JsonRpc(_) => None,
        }
    }

    /// A keyed request's headers as they go upstream, where `timeout` is the execution's
    /// (`upstream.timeout`): a `grpc-timeout` it carries is replaced by it, in every dialect (a gRPC-Web
    /// call over HTTP carries one too), since a key's execution runs to its end, and is stored, however
    /// soon its client gives up.
    pub(crate) fn to_upstream(&self, headers: &mut HeaderMap, timeout: Duration) {
        grpc::set_deadline(headers, timeout);
    }

    /// What the head of the upstream's answer decides under the route's `rules`: the HTTP rules
    /// (`http.rs`: a `101`, the release statuses) for every dialect, then a gRPC call's status where its
    /// answer is trailers only.
    pub(crate) fn on_head(&self, rules: &StoreRules, status: StatusCode, headers: &HeaderMap) -> OnHead {
        let decided = http::on_head(rules, status);
        match self {
            Dialect::Grpc if matches!(decided, OnHead::Relay) => grpc::on_head(rules, status, headers),
            Dialect::Grpc | Dialect::Http | Dialect::JsonRpc(_) => decided,
        }
    }

    /// What a whole answer (`status`, and its headers and trailers as stored) means once its body has
    /// ended: an answer to store, but for a gRPC call whose status came in its trailers.
    pub(crate) fn on_end(&self, rules: &StoreRules, status: u16, stored: &[(String, Vec<u8>)]) -> Verdict {
        match self {
            Dialect::Grpc => grpc::on_end(rules, status, stored),
            Dialect::Http | Dialect::JsonRpc(_) => Verdict::Store,
        }
    }

    /// The stored body as a replay gives it to this retry (`content_type` is the stored one): a
    /// JSON-RPC response answering the retry's own `id`; else as it was stored.
    pub(crate) fn replayed(&self, body: Bytes, content_type: Option<&[u8]>) -> Bytes {
        match self {
            Dialect::JsonRpc(id) => jsonrpc::answer::answer_as(&body, content_type, id).unwrap_or(body),
            Dialect::Http | Dialect::Grpc => body,
        }
    }

    /// Whether a duplicate may follow the running execution (`on_in_flight = "attach"`): not a JSON-RPC
    /// call, whose answer must carry its own `id`, which only a replay writes; it waits instead.
    pub(crate) fn may_attach(&self) -> bool {
        match self {
            Dialect::Http | Dialect::Grpc => true,
            Dialect::JsonRpc(_) => false,
        }
    }
}
