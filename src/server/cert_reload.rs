//! Runs beside the proxy listener while it has TLS, until the server has stopped: every
//! `server.tls.reload_interval` reads `server.tls.cert_file` and `server.tls.key_file`, and when their
//! contents changed, loads the new pair and swaps it in for new handshakes (connections already made keep
//! theirs). A pair that does not load is refused: the old one keeps serving, an error naming the file is
//! logged, and `idemproxy_tls_reloads_total{result}` counts either way. Touches those two files and the
//! listener's [`SwappableCert`](crate::config::tls::SwappableCert).
//!
//! Polling the contents rather than watching for file events: Kubernetes updates a secret volume by
//! swapping a `..data` symlink in the directory, which a watch on the file never sees; reading two small
//! files every few seconds sees every kind of update (rename, symlink swap, rewrite in place, network
//! file systems) and needs no dependency. A change is taken once both files have read the same at two
//! ticks in a row, so a pair written one file after the other is never loaded half-written; and it is
//! acted on once: a broken pair is logged and counted once, not at every tick, and the next change is
//! tried again.
//!
//! SIGHUP (or a reload asked on the admin listener, `POST /-/reload`) reads the files at once and takes a changed pair without waiting for a second read: the
//! operator who sends it says the files are complete. `idemproxy_tls_last_reload_successful` is 0 from a
//! refused pair until a pair is taken again.

use std::sync::Arc;

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::config::ListenerTls;
use crate::config::tls::certified_key;
use crate::metrics::Metrics;
use crate::shutdown::Hangups;

/// What the two files held when last read: their contents, or why they could not be read.
type Seen = Result<(Vec<u8>, Vec<u8>), String>;

/// Watches the files until `stop`; a SIGHUP or `asked` (a reload asked on the admin listener) has them
/// read at once.
pub(super) async fn watch(
    tls: ListenerTls,
    (metrics, asked): (Metrics, Arc<tokio::sync::Notify>),
    stop: CancellationToken,
) {
    let mut taken: Seen = Ok(tls.loaded_pem.as_ref().clone());
    let mut last = taken.clone();
    let mut ticks = tokio::time::interval_at(
        tokio::time::Instant::now() + tls.reload_interval,
        tls.reload_interval,
    );
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut hangups = Hangups::listen();
    loop {
        let asked = tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => false,
            () = hangups.next() => true,
            () = asked.notified() => true,
        };
        let now = read(&tls).await;
        if (asked || now == last) && now != taken {
            reload(&tls, &now, &metrics);
            taken = now.clone();
        } else if asked {
            tracing::info!(cert_file = %tls.cert_file.display(), "reload: listener certificate unchanged");
        }
        last = now;
    }
}

async fn read(tls: &ListenerTls) -> Seen {
    let read = |path: &std::path::Path| {
        let path = path.to_owned();
        async move {
            tokio::fs::read(&path)
                .await
                .map_err(|e| format!("cannot read {}: {e}", path.display()))
        }
    };
    Ok((read(&tls.cert_file).await?, read(&tls.key_file).await?))
}

/// Takes the pair `seen` holds, or refuses it.
fn reload(tls: &ListenerTls, seen: &Seen, metrics: &Metrics) {
    let loaded = seen
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|(cert, key)| certified_key(cert, key, &tls.cert_file, &tls.key_file));
    match loaded {
        Ok(pair) => {
            tls.cert.swap(pair);
            metrics.tls_reloads.ok.inc();
            metrics.tls_last_reload_successful.set(1);
            tracing::info!(cert_file = %tls.cert_file.display(), "listener certificate reloaded");
        }
        Err(error) => {
            metrics.tls_reloads.error.inc();
            metrics.tls_last_reload_successful.set(0);
            tracing::error!(%error, "listener certificate not reloaded; keeping the one in use");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::tls::SwappableCert;

    /// The leaf certificate new handshakes get now.
    fn current(cert: &SwappableCert) -> Vec<u8> {
        cert.current().cert[0].to_vec()
    }

    /// Waits (bounded) until `counter` reaches `n`.
    async fn counted(counter: &prometheus::IntCounter, n: u64) {
        let reached = async {
            while counter.get() < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), reached)
            .await
            .expect("the reload was counted");
    }

    fn pair(name: &str) -> (String, String) {
        let cert = rcgen::generate_simple_self_signed(vec![name.into()]).unwrap();
        (cert.cert.pem(), cert.signing_key.serialize_pem())
    }

    fn write(dir: &std::path::Path, (cert, key): &(String, String)) {
        std::fs::write(dir.join("cert.pem"), cert).unwrap();
        std::fs::write(dir.join("key.pem"), key).unwrap();
    }

    #[tokio::test]
    async fn a_changed_pair_is_swapped_in_and_a_broken_one_is_refused_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = pair("a.test");
        write(dir.path(), &a);
        let config = crate::config::Config::from_toml_str(&format!(
            "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\nreload_interval = \"20ms\"\n",
            dir.path().join("cert.pem").display().to_string(),
            dir.path().join("key.pem").display().to_string(),
        ))
        .unwrap();
        let tls = config.server.tls.unwrap();
        let metrics = Metrics::new();
        let stop = CancellationToken::new();
        let task = tokio::spawn(watch(
            tls.clone(),
            (metrics.clone(), Arc::default()),
            stop.clone(),
        ));
        let first = current(&tls.cert);

        let b = pair("b.test");
        write(dir.path(), &b);
        counted(&metrics.tls_reloads.ok, 1).await;
        assert_ne!(current(&tls.cert), first, "the new pair is served");

        let served = current(&tls.cert);
        write(dir.path(), &(a.0.clone(), b.1.clone()));
        counted(&metrics.tls_reloads.error, 1).await;
        assert_eq!(current(&tls.cert), served, "a mismatched pair is refused");
        assert_eq!(metrics.tls_last_reload_successful.get(), 0);
        // Ten more ticks read the same broken pair: nothing more is counted.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            metrics.tls_reloads.error.get(),
            1,
            "a change is counted once, not at every tick"
        );
        assert_eq!(metrics.tls_reloads.ok.get(), 1);

        write(dir.path(), &a);
        counted(&metrics.tls_reloads.ok, 2).await;
        assert_eq!(metrics.tls_last_reload_successful.get(), 1, "a pair taken again");

        stop.cancel();
        task.await.unwrap();
    }
}
