//! The admin listener's endpoints: `/metrics` (Prometheus text), `/healthz` (the process runs),
//! `/readyz` (the store is open, answers, and no shutdown has begun), and `POST /-/reload` (read the
//! configuration again, as SIGHUP does: `reload.rs` does it and answers what it applied). Reads metrics
//! and pings the store, at most about once a second however many probes come; never touches the
//! request path.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde::Serialize;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::body::{self, ProxyBody};
use crate::jwks::KeySets;
use crate::metrics::Metrics;
use crate::store::{StoreError, StoreHandle};

/// How long one store ping's answer stands for `/readyz`: several checkers probing, or a burst of
/// probes, cost the store about one ping a second.
const READINESS_TTL: Duration = Duration::from_secs(1);

/// What the admin endpoints read.
#[derive(Clone)]
pub struct Admin {
    metrics: Metrics,
    store: StoreHandle,
    shutdown: CancellationToken,
    readiness: Arc<Readiness>,
    key_sets: Arc<ArcSwap<KeySets>>,
    /// Where `POST /-/reload` asks for a reload; `None` when nothing reloads (a proxy run in-process).
    reloads: Option<mpsc::Sender<ReloadAsk>>,
}

/// A reload asked for by `POST /-/reload`: where its outcome goes, or why the configuration was refused
/// (one line, secrets masked).
pub type ReloadAsk = oneshot::Sender<Result<Reloaded, String>>;

/// What a reload did: the settings it applied to new requests, and those that differ from the running
/// ones but wait for a restart (dotted keys, as `check-config` prints them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Reloaded {
    /// Applied to requests that arrive from now on.
    pub applied: Vec<String>,
    /// Changed, but only a restart applies them.
    pub restart: Vec<String>,
}

/// Reloads asked for but not yet taken up: one runs at a time, and a few more may queue behind it.
const RELOADS_QUEUED: usize = 4;

/// The channel `POST /-/reload` asks on, and `reload.rs` hears.
pub fn reload_channel() -> (mpsc::Sender<ReloadAsk>, mpsc::Receiver<ReloadAsk>) {
    mpsc::channel(RELOADS_QUEUED)
}

/// The last store ping's answer, shared by every admin connection. A probe that comes while a ping runs
/// waits for that ping and shares its answer.
#[derive(Default)]
struct Readiness(Mutex<Option<Ping>>);

/// A store ping's answer.
#[derive(Clone, Copy)]
struct Ping {
    at: Instant,
    answer: Answer,
    /// Failed store operations counted when it came.
    failures: u64,
}

/// What a ping found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The store answered.
    Ready,
    /// `serve` has not opened the store yet (its server could not be had at start).
    NotOpen,
    /// The store did not answer.
    Unavailable,
}

impl Answer {
    fn of(ping: Result<(), StoreError>) -> Answer {
        match ping {
            Ok(()) => Answer::Ready,
            Err(StoreError::NotOpen) => Answer::NotOpen,
            Err(_) => Answer::Unavailable,
        }
    }

    fn response(self) -> Response<ProxyBody> {
        match self {
            Answer::Ready => text(StatusCode::OK, "ready\n"),
            Answer::NotOpen => text(StatusCode::SERVICE_UNAVAILABLE, "store not open yet\n"),
            Answer::Unavailable => text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n"),
        }
    }
}

impl Ping {
    /// Whether this answer still stands: for [`READINESS_TTL`], and a "ready" only while no store
    /// operation has failed since (the requests saw the store go before the next ping would).
    fn stands(&self, failures: u64) -> bool {
        self.at.elapsed() < READINESS_TTL && (self.answer != Answer::Ready || failures == self.failures)
    }
}

impl Readiness {
    async fn store_answers(&self, store: &StoreHandle, metrics: &Metrics) -> Answer {
        let mut last = self.0.lock().await;
        if let Some(ping) = *last
            && ping.stands(metrics.store_failures())
        {
            return ping.answer;
        }
        let answer = Answer::of(store.ping().await);
        let ping = Ping {
            at: Instant::now(),
            answer,
            failures: metrics.store_failures(),
        };
        *last = Some(ping);
        answer
    }
}

impl Admin {
    /// The admin endpoints over these metrics and this store; `/readyz` fails once `shutdown` is cancelled.
    pub fn new(metrics: Metrics, store: StoreHandle, shutdown: CancellationToken) -> Admin {
        Admin {
            metrics,
            store,
            shutdown,
            readiness: Arc::default(),
            key_sets: Arc::default(),
            reloads: None,
        }
    }

    /// `/readyz` also waits for the first read of each of the key sets in force (`scope_jwt`): until
    /// then, keyed requests on their routes are refused. A reload replaces them.
    pub fn waiting_for_keys(self, key_sets: Arc<ArcSwap<KeySets>>) -> Admin {
        Admin { key_sets, ..self }
    }

    /// `POST /-/reload` asks `reloads` for a reload and answers its outcome.
    pub fn reloading(self, reloads: mpsc::Sender<ReloadAsk>) -> Admin {
        Admin {
            reloads: Some(reloads),
            ..self
        }
    }

    /// Answers one admin request.
    pub async fn handle(self, request: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
        if request.uri().path() == "/-/reload" {
            return Ok(self.reload(request.method()).await);
        }
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"));
        }
        let response = match request.uri().path() {
            "/metrics" => {
                let mut response = Response::new(body::full(self.metrics.render()));
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => self.readyz().await,
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        };
        Ok(response)
    }

    /// `POST /-/reload`: 200 with what was applied and what waits for a restart, 500 with the reason
    /// when the configuration does not load (the running one is kept), 404 where nothing reloads.
    async fn reload(&self, method: &Method) -> Response<ProxyBody> {
        if method != Method::POST {
            let mut response = text(
                StatusCode::METHOD_NOT_ALLOWED,
                "POST to reload the configuration\n",
            );
            response
                .headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
            return response;
        }
        let Some(reloads) = &self.reloads else {
            return text(
                StatusCode::NOT_FOUND,
                "this process does not reload its configuration\n",
            );
        };
        let (ask, answer) = oneshot::channel();
        let outcome = match reloads.send(ask).await {
            Ok(()) => answer.await.ok(),
            Err(_) => None,
        };
        let (status, body) = match outcome {
            Some(Ok(reloaded)) => (
                StatusCode::OK,
                serde_json::json!({"reloaded": true, "applied": reloaded.applied, "restart": reloaded.restart}),
            ),
            Some(Err(error)) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({"reloaded": false, "error": error}),
            ),
            None => return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n"),
        };
        let mut response = Response::new(body::full(format!("{body}\n")));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        response
    }

    /// Not ready from the moment shutdown begins, whatever the last ping said; otherwise ready while the
    /// store answers, by a ping at most [`READINESS_TTL`] old and not contradicted by a failure since.
    /// Before the store has opened, the ping fails at once (and is counted, as the store-unavailable
    /// alert expects), and the answer says so.
    async fn readyz(&self) -> Response<ProxyBody> {
        if self.shutdown.is_cancelled() {
            return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n");
        }
        if self.key_sets.load().waiting_for().is_some() {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "waiting for the first read of a JWKS (scope_jwt)\n",
            );
        }
        self.readiness
            .store_answers(&self.store, &self.metrics)
            .await
            .response()
    }
}

fn text(status: StatusCode, message: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(body::full(message));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
