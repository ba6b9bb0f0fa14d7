//! Signals. SIGINT and SIGTERM cancel one [`CancellationToken`], which every accept loop and background
//! task watches; set up once, at start-up. SIGHUP never stops the process: [`Hangups`] hands it to each
//! task that acts on it (`reload.rs`: the configuration and the log filter; `server/cert_reload.rs`: the
//! listener certificate), every one of them hearing every SIGHUP.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGINT or SIGTERM.
pub fn cancel_on_signal(token: CancellationToken) -> std::io::Result<()> {
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
            _ = token.cancelled() => return,
        };
        tracing::info!(
            signal = name,
            "shutting down: no new connections, draining in-flight requests"
        );
        token.cancel();
    });
    Ok(())
}

/// The SIGHUPs this process receives from now on. Once one exists, SIGHUP no longer ends the process
/// (its default); several tasks may each have one, and each hears every SIGHUP.
pub struct Hangups(Option<Signal>);

impl Hangups {
    /// Starts listening. If the handler cannot be installed, says so and never yields.
    pub fn listen() -> Hangups {
        match signal(SignalKind::hangup()) {
            Ok(signal) => Hangups(Some(signal)),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; it will not reload anything");
                Hangups(None)
            }
        }
    }

    /// Returns at the next SIGHUP.
    pub async fn next(&mut self) {
        if let Some(signal) = &mut self.0
            && signal.recv().await.is_some()
        {
            return;
        }
        std::future::pending().await
    }
}
