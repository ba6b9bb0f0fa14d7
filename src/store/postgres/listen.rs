//! Wake-ups across replicas for requests that wait for a key in flight (`on_in_flight = "wait"`): the
//! `NOTIFY` a process sends after a record of a wait route settled, and the one connection per process
//! that `LISTEN`s for them and wakes this process's waiters (`store/wake.rs`). The NOTIFY runs in the
//! forwarding task, after the completion, release or hold has committed, over the pool, and only for
//! wait routes; the listener runs as a background task from start to shutdown (`store/listen.rs`
//! reconnects it), on a dedicated connection of its own (not the pool's), and only when some route waits.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::poll_fn;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, NoTls, Socket};
use tokio_util::sync::CancellationToken;

use super::connect::{pg_config, tls_connector};
use super::db::Db;
use crate::config::StoreConfig;
use crate::error_chain::error_chain;
use crate::metrics::Metrics;
use crate::store::StoreError;
use crate::store::listen::{self, Ended, keep_listening, now_listening};
use crate::store::wake::Waiters;

/// Subscribes the listener's session to the channel. The channel is named for the key table of the
/// `idemproxy` schema, so other applications' channels on a shared database never meet ours; NOTIFY is
/// per database, so proxies on other databases of the server never hear it.
const LISTEN: &str = "LISTEN idemproxy_records";

/// One announcement. `pg_notify` rather than `NOTIFY` so the payload is a parameter. Sent in its own
/// transaction after the settlement has committed: a waiter woken by it re-checks the record, so it only
/// has to arrive after the commit, and the completion statements of routes that do not wait stay as
/// they are.
const NOTIFY: &str = "SELECT pg_notify('idemproxy_records', $1)";

/// Announcements that arrive together (coalesced), in one statement: every NOTIFY takes the database's
/// one notification-queue lock at commit, so one commit for many is cheaper than one each. Identical
/// payloads in one transaction are delivered once.
const NOTIFY_BATCH: &str = "SELECT pg_notify('idemproxy_records', a) FROM unnest($1::text[]) AS a";

/// Sends one announcement.
pub(super) async fn announce(db: &Db, announcement: &str) -> Result<(), StoreError> {
    db.execute(NOTIFY, &[&announcement]).await.map(drop)
}

/// A batch of announcements: one alone runs NOTIFY; more run NOTIFY_BATCH.
pub(super) async fn announce_batch(db: Arc<Db>, items: Vec<String>) -> Vec<Result<(), StoreError>> {
    let result = match items.as_slice() {
        [one] => announce(&db, one).await,
        _ => {
            let params: [(&(dyn ToSql + Sync), Type); 1] = [(&items, Type::TEXT_ARRAY)];
            db.query_batch(NOTIFY_BATCH, &params).await.map(drop)
        }
    };
    items.iter().map(|_| result.clone()).collect()
}

/// Listens for other replicas' announcements and wakes this process's waiters, from now until
/// `shutdown`, reconnecting with backoff whenever the connection is lost.
pub async fn listen(
    config: StoreConfig,
    waiters: Arc<Waiters>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let (sessions, metered) = (waiters.clone(), metrics.clone());
    keep_listening(waiters, metrics, shutdown, |_| {
        session(&config, &sessions, &metered)
    })
    .await;
}

fn before_listening(error: StoreError) -> Ended {
    Ended {
        listened: false,
        why: error.to_string(),
    }
}

async fn session(config: &StoreConfig, waiters: &Waiters, metrics: &Metrics) -> Ended {
    let pg = match pg_config(config) {
        Ok(pg) => pg,
        Err(error) => return before_listening(error),
    };
    match tls_connector(config) {
        Ok(Some(tls)) => session_over(&pg, tls, config.timeout, waiters, metrics).await,
        Ok(None) => session_over(&pg, NoTls, config.timeout, waiters, metrics).await,
        Err(error) => before_listening(error),
    }
}

/// Connects, listens, and reads notifications until the connection ends. The connection is driven by
/// reading its messages, which also carries the LISTEN statement's exchange.
async fn session_over<T>(
    pg: &tokio_postgres::Config,
    tls: T,
    bound: Duration,
    waiters: &Waiters,
    metrics: &Metrics,
) -> Ended
where
    T: MakeTlsConnect<Socket>,
{
    let (client, mut connection) = match pg.connect(tls).await {
        Ok(connected) => connected,
        Err(error) => return before_listening(StoreError::Backend(error_chain(&error))),
    };
    let mut listened = false;
    let listening = async {
        match tokio::time::timeout(bound, client.batch_execute(LISTEN)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return StoreError::Backend(error_chain(&error)),
            Err(_) => return StoreError::Timeout(bound),
        }
        listened = true;
        now_listening(waiters, metrics);
        std::future::pending().await
    };
    let reading = async {
        loop {
            match poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(note))) => {
                    if !listen::heard(waiters, note.payload()) {
                        tracing::debug!(
                            channel = note.channel(),
                            "ignored a notification that is not ours"
                        );
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(error)) => return StoreError::Backend(error_chain(&error)),
                None => return StoreError::Backend("the listener's connection closed".into()),
            }
        }
    };
    let error = tokio::select! {
        error = listening => error,
        error = reading => error,
    };
    Ended {
        listened,
        why: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::db::assert_typed_params;
    use super::*;

    #[test]
    fn every_statement_uses_the_one_channel() {
        let channel = LISTEN.strip_prefix("LISTEN ").unwrap();
        for sql in [NOTIFY, NOTIFY_BATCH] {
            assert!(sql.contains(&format!("pg_notify('{channel}', ")), "{sql}");
        }
    }

    #[test]
    fn batch_arguments_fit_the_statements_casts() {
        let items = vec!["a".to_owned(), "b".to_owned()];
        assert_typed_params(NOTIFY_BATCH, &[(&items, Type::TEXT_ARRAY)]);
    }
}
