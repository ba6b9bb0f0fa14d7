//! Runs beside a followed execution while duplicates follow it: one task per execution, started by the
//! first follower to join, ending once none is left. A quarter of `server.write_timeout` apart it looks
//! at each follower (`Watched::tick`, which `attach/log.rs` implements), and cuts off one that has had bytes, or its end, ready and has taken
//! none for `write_timeout`: its place among those that wait and its claim on the log come back even
//! when nothing polls its body again (hyper polls an HTTP/2 body only while its stream has window, and a
//! client may grant none). A follower that keeps reading costs it nothing but a look per tick. Holds
//! only a weak reference to the log; touches nothing else.

use std::sync::Weak;
use std::time::Duration;

use tokio::time::MissedTickBehavior;

/// What a watchdog looks at each tick: the followers of one execution (`attach/log.rs`).
pub(super) trait Watched: Send + Sync + 'static {
    /// Cuts off the followers stalled since the last look; `false` once none is left to watch.
    fn tick(&self) -> bool;
}

/// Starts the watchdog of `log`'s followers, looking every `period`.
pub(super) fn spawn<W: Watched>(log: Weak<W>, period: Duration) {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period.max(Duration::from_millis(1)));
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(log) = log.upgrade() else {
                return;
            };
            if !log.tick() {
                return;
            }
        }
    });
}
