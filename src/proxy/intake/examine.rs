//! Runs once a keyed request's body has been read whole (`intake.rs`), before its claim is built: reads
//! the key from the body when the route's source needs it (`key/source.rs`), and the request's
//! fingerprint (`key.rs`). The working memory a JSON body needs is charged to the body's reservation
//! (`intake/budget.rs`); what the budget cannot supply is 503 `busy`. A body larger than [`ON_WORKER`] is
//! examined on the runtime's blocking pool, so parsing or hashing it never holds up the other
//! connections of its worker (each worker is a single-threaded runtime), by at most one examiner per
//! CPU in the whole process ([`Examiners`]): more would only share the same cores, each with a thread of
//! its own. Touches the body budget and the examiners only.

use std::sync::Arc;

use http::request;
use tokio::sync::Semaphore;

use bytes::Bytes;

use crate::config::{KeySource, Policy, Route};
use crate::error::{Busy, ProxyError};
use crate::proxy::budget::ReservedBody;
use crate::proxy::dialect::graphql::{self, NotPlanned, Plan};
use crate::proxy::dialect::jsonrpc::{self, CallId, batch};
use crate::proxy::intake::many::{Call, Field, Items};
use crate::proxy::key::{self, json::Scratch};

/// Bodies up to this many bytes are examined on the worker: reading them takes tens of microseconds,
/// less than handing them to another thread.
pub const ON_WORKER: usize = 64 * 1024;

/// A request read whole and examined.
pub(crate) struct Examined {
    /// The request line and headers.
    pub(crate) parts: request::Parts,
    /// The body, holding its share of the budget.
    pub(crate) body: ReservedBody,
    /// Its key and fingerprint; `None` when its key comes from the body and the body holds none.
    pub(crate) keyed: Option<(String, [u8; 32])>,
    /// On a route keyed by `jsonrpc`, the call's `id`, which a replay answers with.
    pub(crate) call: Option<CallId>,
    /// A request that carries many keys: a JSON-RPC batch with a keyed call, a GraphQL mutation with an
    /// `@idempotent` field; its items in the client's order (`keyed` is then `None`).
    pub(crate) many: Option<Items>,
    /// A request its route forwards unkeyed whatever `required` says: a GraphQL query or subscription,
    /// which runs nothing a retry could repeat.
    pub(crate) passes: bool,
}

/// Examinations of large bodies running at once, in the whole process: one per CPU. A body waits for
/// its turn on its worker without blocking it.
#[derive(Clone)]
pub struct Examiners(Arc<Semaphore>);

impl Examiners {
    /// One examiner per CPU the process may use.
    pub fn per_cpu() -> Examiners {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        Examiners(Arc::new(Semaphore::new(cpus)))
    }
}

/// Examines a request: `key` is its key when the key's source is in the head.
pub(crate) async fn examine(
    examiners: &Examiners,
    route: Arc<Route>,
    parts: request::Parts,
    body: ReservedBody,
    key: Option<String>,
) -> Result<Examined, ProxyError> {
    let mut examined = Examined {
        parts,
        body,
        keyed: None,
        call: None,
        many: None,
        passes: false,
    };
    if examined.body.bytes.len() <= ON_WORKER {
        examined.run(&route, key)?;
        return Ok(examined);
    }
    // The permit goes with the work: a client that hangs up meanwhile does not free its examiner early.
    let Ok(turn) = examiners.0.clone().acquire_owned().await else {
        return Err(ProxyError::Busy(Busy::Parsing));
    };
    let off_worker = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        examined.run(&route, key).map(|()| examined)
    });
    off_worker.await.unwrap_or_else(|e| {
        tracing::error!(error = %e, "examining a request body ended without an answer");
        Err(ProxyError::Busy(Busy::Parsing))
    })
}

impl Examined {
    fn run(&mut self, route: &Route, key: Option<String>) -> Result<(), ProxyError> {
        let policy = &route.policy;
        let parts = &self.parts;
        let call = &mut self.call;
        let many = &mut self.many;
        let passes = &mut self.passes;
        let whole = self.body.bytes.clone();
        self.keyed = self.body.working(|bytes, grow| {
            let mut scratch = Scratch::within(grow);
            match &policy.key.source {
                KeySource::JsonRpc(_) if key.is_none() && jsonrpc::is_batch(bytes) => {
                    *many = batch_calls(policy, parts, &whole, &mut scratch)?.map(Items::JsonRpc);
                    return Ok(None);
                }
                KeySource::GraphQl => {
                    match graphql_fields(policy, parts, bytes)? {
                        Fields::Keyed(fields) => *many = Some(Items::GraphQl(fields)),
                        Fields::Passes => *passes = true,
                        Fields::Unkeyed => {}
                    }
                    return Ok(None);
                }
                _ => {}
            }
            let key = match key {
                Some(key) => key,
                None => {
                    let found = key::source::from_body(policy, parts, bytes, &mut scratch)?;
                    *call = found.call_id;
                    match found.key {
                        Some(key) => key,
                        None => return Ok(None),
                    }
                }
            };
            let fingerprint = key::fingerprint(
                &policy.key,
                &parts.method,
                &parts.uri,
                &parts.headers,
                bytes,
                &mut scratch,
            )?;
            Ok::<_, ProxyError>(Some((key, fingerprint)))
        })?;
        // A keyed mutation's fields go upstream one by one, each its own body: the request holds them in
        // its share of the budget until it ends.
        if let Some(Items::GraphQl(fields)) = &self.many {
            let taken: usize = fields.iter().map(|field| field.body.len()).sum();
            if !self.body.hold_more(taken) {
                return Err(ProxyError::Busy(Busy::Parsing));
            }
        }
        Ok(())
    }
}

/// The calls of a JSON-RPC batch (`whole`, the body) when one at least carries a key, each read as a lone
/// call is: its key, its `id`, and its fingerprint (so a call keyed in a batch is the same request as
/// itself sent alone). `None` for a batch without keyed calls (it passes as it came, or is refused where
/// keys are required), or a body that is no batch of calls (`[]`, not JSON). Refused where calls repeat
/// an `id` (their answers could not be told apart), where a call has no key on a route that requires
/// them, and past [`batch::MAX_CALLS`].
fn batch_calls(
    policy: &Policy,
    parts: &http::request::Parts,
    whole: &Bytes,
    scratch: &mut Scratch<'_>,
) -> Result<Option<Vec<Call>>, ProxyError> {
    let calls = match batch::calls(whole) {
        Ok(calls) => calls,
        Err(batch::NotABatch::TooMany(n)) => {
            // Too many to key one by one: refused if any carries a key (or keys are required), else
            // passed as it came, as any batch without keys is.
            let all: Vec<&serde_json::value::RawValue> = serde_json::from_slice(whole).unwrap_or_default();
            let mut keyed = policy.key.required;
            for raw in all {
                if keyed {
                    break;
                }
                let text = whole.slice_ref(raw.get().as_bytes());
                keyed = key::source::from_body(policy, parts, &text, scratch)?
                    .key
                    .is_some();
            }
            if !keyed {
                return Ok(None);
            }
            return Err(ProxyError::JsonRpcBatch(format!(
                "it holds {n} calls, over the {} one batch may hold",
                batch::MAX_CALLS
            )));
        }
        Err(batch::NotABatch::NotAnArray | batch::NotABatch::Empty) => return Ok(None),
    };
    let mut items: Vec<Call> = Vec::with_capacity(calls.len());
    for raw in calls {
        let text = whole.slice_ref(raw.get().as_bytes());
        let found = key::source::from_body(policy, parts, &text, scratch)?;
        let keyed = match found.key {
            Some(key) => {
                let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
                let fingerprint = key::fingerprint(&policy.key, method, uri, headers, &text, scratch)?;
                Some((key, fingerprint))
            }
            None => None,
        };
        let id = batch::id_of(raw);
        if keyed.is_some() && id.is_none() && batch::names_an_id(raw) {
            return Err(ProxyError::JsonRpcBatch(format!(
                "its call {} has an id JSON-RPC does not allow (not a string, a number or null, or named \
                 twice), so its answer could not be given back",
                items.len() + 1
            )));
        }
        items.push(Call { id, text, keyed });
    }
    if items.iter().all(|call| call.keyed.is_none()) {
        return Ok(None);
    }
    if policy.key.required && items.iter().any(|call| call.keyed.is_none()) {
        return Err(ProxyError::MissingKey(format!(
            "{} in every call of a batch",
            key::source::describe(&policy.key.source)
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    for call in &items {
        if let Some(id) = &call.id
            && !seen.insert(batch::id_value(id))
        {
            return Err(ProxyError::JsonRpcBatch(format!(
                "two of its calls have the id {} (or the same number spelt otherwise), so their answers \
                 could not be told apart",
                id.as_json()
            )));
        }
    }
    Ok(Some(items))
}

/// What a GraphQL request on a route keyed by `graphql` comes to.
enum Fields {
    /// A mutation with `@idempotent` fields: each, an operation of its own with its key and fingerprint.
    Keyed(Vec<Field>),
    /// A query or a subscription: forwarded as it came, on any route.
    Passes,
    /// No key (a mutation without the directive, a body the service refuses too): as `required` says.
    Unkeyed,
}

/// The fields of a GraphQL mutation marked `@idempotent`, each an operation of its own with its key and
/// fingerprint. Unkeyed for a request
/// that passes as it came: a query or a subscription; a mutation without a marked field, and a body that
/// is no GraphQL request (the service refuses it too), where keys are optional. Refused: those two where
/// keys are required, a misplaced or invalid key, a document over a limit.
fn graphql_fields(policy: &Policy, parts: &http::request::Parts, bytes: &[u8]) -> Result<Fields, ProxyError> {
    let required = policy.key.required;
    let planned = match graphql::plan(bytes) {
        Ok(Plan::PassThrough) => return Ok(Fields::Passes),
        Ok(Plan::Unkeyed) if !required => return Ok(Fields::Unkeyed),
        Ok(Plan::Unkeyed) => {
            return Err(ProxyError::MissingKey(key::source::describe(&policy.key.source)));
        }
        Ok(Plan::Keyed(planned)) => planned,
        // A body this proxy cannot split (a GraphQL batch, an `application/graphql` document) is passed
        // as it came unless it names the directive: a service that declares it would run it unprotected.
        Err(not) if not.is_unparseable() && !is_json_object(bytes) && names_idempotent(bytes) => {
            return Err(ProxyError::GraphQlRequest(format!(
                "{not}, and it names @idempotent; send one operation as a JSON body (application/json)"
            )));
        }
        Err(not) if not.is_unparseable() && !required => return Ok(Fields::Unkeyed),
        Err(NotPlanned::InvalidKey { field, why }) => {
            return Err(ProxyError::InvalidKey(format!(
                "the @idempotent key of `{field}` {why}"
            )));
        }
        Err(not) => return Err(ProxyError::GraphQlRequest(not.to_string())),
    };
    let mut fields = Vec::with_capacity(planned.len());
    for part in planned {
        let keyed = match part.key {
            Some(key) => {
                key::check_key(&key, policy.key.max_key_length)?;
                let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
                let described = (b"graphql".as_slice(), part.fingerprint.as_slice());
                let fingerprint = key::fingerprint_part(&policy.key, method, uri, headers, described);
                Some((key, fingerprint))
            }
            None => None,
        };
        fields.push(Field {
            body: Bytes::from(part.body),
            response_key: part.response_key,
            keyed,
        });
    }
    Ok(Fields::Keyed(fields))
}

/// Whether a body is one JSON object (a GraphQL-over-HTTP request, whatever its document holds).
fn is_json_object(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok()
        && bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// Whether a body names the `@idempotent` directive anywhere.
fn names_idempotent(bytes: &[u8]) -> bool {
    bytes
        .windows(b"@idempotent".len())
        .any(|window| window == b"@idempotent")
}
