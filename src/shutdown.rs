//! Turns SIGINT and SIGTERM into the cancellation of one [`CancellationToken`], which every accept loop and
//! background task watches. Runs once, at start-up.

use tokio::signal::unix::{SignalKind, signal};
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
