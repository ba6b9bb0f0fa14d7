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

use crate::config::Route;
use crate::error::{Busy, ProxyError};
use crate::proxy::budget::ReservedBody;
use crate::proxy::dialect::jsonrpc::CallId;
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
        self.keyed = self.body.working(|bytes, grow| {
            let mut scratch = Scratch::within(grow);
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
        Ok(())
    }
}
