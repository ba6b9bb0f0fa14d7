//! Runs once a keyed request has been taken in and missed the replay cache, on a task of its own: sends
//! the claim statement, feeds the replay cache from what it found, and decides with the decision table of
//! the design (execute, replay, 409, 422, 502 for a held outcome); a won claim goes on to `execute.rs`, a
//! completed one to `replay.rs`, and a store that did not answer to fail_closed or fail_open
//! (`passthrough.rs`). The table itself, [`decide`], is pure apart from logging and counting.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::execute::{self, Claimed};
use super::intake::Intake;
use super::upstream::Downstream;
use super::{Answer, Proxy, expiry, replay};
use crate::error::ProxyError;
use crate::metrics::{Metrics, Outcome};
use crate::store::{ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, StoreError, StoredResponse};

impl Proxy {
    /// The keyed lifecycle from the claim on. It runs on its own task: once the claim statement is sent,
    /// a client that disconnects can no longer cancel anything, so a won claim is always executed and
    /// completed (or released) instead of being left to its lease. The answer goes to `head`.
    pub(crate) async fn claim(
        self: Arc<Self>,
        intake: Intake,
        peer: Downstream,
        head: Answer,
        _slot: OwnedSemaphorePermit,
    ) {
        let Intake {
            route,
            parts,
            claim,
            body,
        } = intake;
        let started = Instant::now();
        let sent = SystemTime::now();
        let result = match self.store.claim(&claim).await {
            Ok(result) => result,
            // The store answered, but with a record that must not be replayed; never forward either.
            Err(StoreError::Undecryptable(_)) => {
                head.send(Err(ProxyError::RecordUnreadable));
                return;
            }
            Err(error) => {
                tokio::spawn(release_orphan(self.clone(), claim.id.clone(), claim.lease));
                head.send(self.store_down(parts, body, &peer, error).await);
                return;
            }
        };
        let fill = self.cache.remember(&claim, &result, started);
        let new_record = matches!(
            result,
            ClaimResult::Won {
                kind: ClaimKind::New,
                ..
            }
        );
        let answer = match decide(
            result,
            &claim.id.key,
            route.policy.in_flight_retry_after,
            &self.metrics,
        ) {
            Ok(Decision::Execute) => {
                let waited = started.elapsed();
                if waited > claim.lease / 2 {
                    let late = self.claimed_too_late(&claim, waited).await;
                    head.send(self.store_down(parts, body, &peer, late).await);
                    return;
                }
                let request = self.upstream.request(parts, body.into_body(), &peer);
                let claimed = Claimed {
                    expires_at: new_record.then(|| expiry::after(sent, claim.ttl)),
                    id: claim.id,
                    lease: claim.lease,
                    route,
                };
                return execute::execute(self, claimed, request, head, fill).await;
            }
            Ok(Decision::Replay(stored, expires_in)) => replay::response(&stored).map(|mut response| {
                let expires_at = expiry::after(sent, expires_in);
                expiry::stamp(response.headers_mut(), &route.policy, Some(expires_at));
                (response, Outcome::Replayed)
            }),
            Err(refusal) => Err(refusal),
        };
        head.send(answer);
    }

    /// A won claim whose answer came after more than half its lease (the lease started no earlier than the
    /// claim was sent): a starved process, or a store slower than the lease. The heartbeat's first
    /// extension, a third of a lease after forwarding, might come after the lease ran out, and another
    /// proxy could take the key over while the upstream works. So the claim is given back (fenced by its
    /// token) and the request is answered as if the store had not answered in time.
    async fn claimed_too_late(&self, claim: &ClaimRequest, waited: Duration) -> StoreError {
        tracing::warn!(
            key = %claim.id.key,
            waited_ms = waited.as_millis() as u64,
            lease_ms = claim.lease.as_millis() as u64,
            "claim answered after more than half its lease; not forwarded on it"
        );
        if let Err(error) = self.store.release(&claim.id).await {
            tracing::warn!(key = %claim.id.key, %error, "releasing the late claim failed; it expires with its lease");
        }
        StoreError::Timeout(waited)
    }
}

/// A claim whose statement did not answer in time may still have been won, by a statement that
/// committed after its request stopped waiting; left alone, it would hold the key for a lease and then
/// count as a stale takeover although nothing ran. It is given back by its token (which matches nothing
/// if it was never won), tried after one store timeout, when such a statement has most likely ended,
/// and again with doubling waits while its lease could still be live.
async fn release_orphan(proxy: Arc<Proxy>, id: RecordId, lease: Duration) {
    let deadline = Instant::now() + lease + proxy.store_timeout;
    let mut wait = proxy.store_timeout;
    while Instant::now() + wait <= deadline {
        tokio::time::sleep(wait).await;
        if let Ok(true) = proxy.store.release(&id).await {
            proxy.metrics.orphan_claims_released.inc();
            tracing::warn!(key = %id.key, "a claim won after its request gave up waiting was given back");
            return;
        }
        wait *= 2;
    }
}

/// What to do with a request after its claim statement.
#[derive(Debug)]
pub enum Decision {
    /// This request holds the key: forward it.
    Execute,
    /// Answer from the stored response; the record expires after the duration.
    Replay(StoredResponse, Duration),
}

/// The decision table. Errors are the refusals (409, 422, 502 for a held outcome). A 409's `Retry-After`
/// is `retry_hint` (`idempotency.in_flight_retry_after`), or the lease left if that is shorter, at
/// least a second: most keys in flight complete well within a lease, so the whole lease would keep a
/// client waiting for nothing.
pub fn decide(
    result: ClaimResult,
    key: &str,
    retry_hint: Duration,
    metrics: &Metrics,
) -> Result<Decision, ProxyError> {
    match result {
        ClaimResult::Won { attempt, kind } => {
            if kind == ClaimKind::Takeover {
                metrics.stale_takeovers.inc();
                tracing::warn!(key, attempt, "stale claim taken over: its lease ran out");
            } else if kind == ClaimKind::Retry {
                tracing::info!(key, attempt, "released key executes again");
            }
            Ok(Decision::Execute)
        }
        ClaimResult::Held(existing) => held(existing, retry_hint),
    }
}

fn held(existing: Existing, retry_hint: Duration) -> Result<Decision, ProxyError> {
    match existing {
        Existing::Completed {
            same_fingerprint: true,
            response,
            expires_in,
            ..
        } => Ok(Decision::Replay(response, expires_in)),
        Existing::Processing {
            same_fingerprint: true,
            lease_remaining,
        } => Err(ProxyError::KeyInFlight {
            retry_after: lease_remaining.min(retry_hint).max(Duration::from_secs(1)),
        }),
        Existing::Unknown {
            same_fingerprint: true,
        } => Err(ProxyError::OutcomeUnknown),
        Existing::Completed { .. }
        | Existing::Processing { .. }
        | Existing::Unknown { .. }
        | Existing::Failed => Err(ProxyError::KeyReused),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HINT: Duration = Duration::from_secs(1);

    fn stored() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![],
            body: None,
        }
    }

    #[test]
    fn takeover_executes_and_is_counted() {
        let metrics = Metrics::new();
        let result = ClaimResult::Won {
            attempt: 2,
            kind: ClaimKind::Takeover,
        };
        assert!(matches!(
            decide(result, "k", HINT, &metrics),
            Ok(Decision::Execute)
        ));
        assert_eq!(metrics.stale_takeovers.get(), 1);
    }

    #[test]
    fn completed_same_fingerprint_replays() {
        let result = ClaimResult::Held(Existing::Completed {
            same_fingerprint: true,
            response: stored(),
            expires_in: Duration::from_secs(60),
            token: uuid::Uuid::nil(),
        });
        assert!(matches!(
            decide(result, "k", HINT, &Metrics::new()),
            Ok(Decision::Replay(..))
        ));
    }

    #[test]
    fn other_fingerprint_is_a_mismatch_in_every_state() {
        let states = [
            Existing::Completed {
                same_fingerprint: false,
                response: stored(),
                expires_in: Duration::from_secs(60),
                token: uuid::Uuid::nil(),
            },
            Existing::Processing {
                same_fingerprint: false,
                lease_remaining: Duration::from_secs(3),
            },
            Existing::Failed,
            Existing::Unknown {
                same_fingerprint: false,
            },
        ];
        for state in states {
            let result = decide(ClaimResult::Held(state), "k", HINT, &Metrics::new());
            assert!(matches!(result, Err(ProxyError::KeyReused)), "{result:?}");
        }
    }

    #[test]
    fn live_claim_is_a_conflict_with_a_short_hint_never_the_whole_lease() {
        let conflict = |lease_ms: u64, hint: Duration| {
            let result = ClaimResult::Held(Existing::Processing {
                same_fingerprint: true,
                lease_remaining: Duration::from_millis(lease_ms),
            });
            match decide(result, "k", hint, &Metrics::new()) {
                Err(ProxyError::KeyInFlight { retry_after }) => retry_after,
                other => panic!("expected a conflict, got {other:?}"),
            }
        };
        assert_eq!(conflict(29_400, HINT), HINT, "the hint, not the lease");
        assert_eq!(conflict(29_400, Duration::from_secs(5)), Duration::from_secs(5));
        assert_eq!(
            conflict(2_500, Duration::from_secs(5)),
            Duration::from_millis(2_500)
        );
        assert_eq!(conflict(0, HINT), Duration::from_secs(1), "at least a second");
    }

    #[test]
    fn a_held_outcome_is_refused_for_the_same_request() {
        let result = ClaimResult::Held(Existing::Unknown {
            same_fingerprint: true,
        });
        assert!(matches!(
            decide(result, "k", HINT, &Metrics::new()),
            Err(ProxyError::OutcomeUnknown)
        ));
    }
}
