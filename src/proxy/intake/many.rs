//! A request that carries many keys, as intake takes it in (`examine.rs` reads its items) and the keyed
//! task runs it (`many.rs`): a JSON-RPC batch with a keyed call, or a GraphQL mutation with
//! `@idempotent` fields. Data only.

use std::sync::Arc;

use bytes::Bytes;
use http::request;

use crate::config::Route;
use crate::proxy::budget::ReservedBody;
use crate::proxy::dialect::jsonrpc::CallId;
use crate::proxy::downstream::Downstream;

/// A request that carries many keys, taken in: its route, its scope, who sent it, its head and body, and
/// its items in the client's order.
pub(crate) struct Many {
    pub(crate) route: Arc<Route>,
    /// The scope every item's key is claimed in (the request's).
    pub(crate) scope: String,
    pub(crate) peer: Downstream,
    pub(crate) parts: request::Parts,
    /// The client's body, whole, holding its share of the body budget (and what the items took).
    pub(crate) body: ReservedBody,
    pub(crate) items: Items,
}

/// The items of a request that carries many keys.
pub(crate) enum Items {
    /// A JSON-RPC batch's calls.
    JsonRpc(Vec<Call>),
    /// A GraphQL mutation's root fields, each an operation of its own.
    GraphQl(Vec<Field>),
}

/// An item's key and fingerprint, where it has a key.
pub(crate) type ItemKey = Option<(String, [u8; 32])>;

impl Items {
    /// Each item's key and fingerprint, in the client's order.
    pub(crate) fn keys(&self) -> Vec<&ItemKey> {
        match self {
            Items::JsonRpc(calls) => calls.iter().map(|call| &call.keyed).collect(),
            Items::GraphQl(fields) => fields.iter().map(|field| &field.keyed).collect(),
        }
    }
}

/// One call of a batch.
pub(crate) struct Call {
    /// The call as the client wrote it.
    pub(crate) text: Bytes,
    /// Its `id`; `None` for a notification, or an element that is no call.
    pub(crate) id: Option<CallId>,
    /// Its key and fingerprint, where it carries a key.
    pub(crate) keyed: ItemKey,
}

/// One root field of a keyed mutation, as an operation of its own.
pub(crate) struct Field {
    /// The request body that runs it.
    pub(crate) body: Bytes,
    /// Its response key (alias, else name).
    pub(crate) response_key: String,
    /// Its key and fingerprint, where it is marked `@idempotent`.
    pub(crate) keyed: ItemKey,
}
