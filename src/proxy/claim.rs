//! Runs right after the claim statement: turns what the store found into the decision table of the design
//! (execute, replay, 409, 422, 410) and counts stale takeovers. Pure apart from logging and counting.

use std::time::Duration;

use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::store::{ClaimKind, ClaimResult, Existing, StoredResponse};

/// What to do with a request after its claim statement.
#[derive(Debug)]
pub enum Decision {
    /// This request holds the key: forward it.
    Execute,
    /// Answer from the stored response.
    Replay(StoredResponse),
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
            ..
        } => Ok(Decision::Replay(response)),
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
            Ok(Decision::Replay(_))
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
