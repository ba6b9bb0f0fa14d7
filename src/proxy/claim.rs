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

/// The decision table. Errors are the refusals (409, 422).
pub fn decide(result: ClaimResult, key: &str, metrics: &Metrics) -> Result<Decision, ProxyError> {
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
        ClaimResult::Held(existing) => held(existing),
    }
}

fn held(existing: Existing) -> Result<Decision, ProxyError> {
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
            retry_after: lease_remaining.max(Duration::from_secs(1)),
        }),
        Existing::Completed { .. } | Existing::Processing { .. } | Existing::Failed => {
            Err(ProxyError::KeyReused)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(matches!(decide(result, "k", &metrics), Ok(Decision::Execute)));
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
            decide(result, "k", &Metrics::new()),
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
        ];
        for state in states {
            let result = decide(ClaimResult::Held(state), "k", &Metrics::new());
            assert!(matches!(result, Err(ProxyError::KeyReused)), "{result:?}");
        }
    }

    #[test]
    fn live_claim_is_a_conflict_with_time_left() {
        let result = ClaimResult::Held(Existing::Processing {
            same_fingerprint: true,
            lease_remaining: Duration::from_millis(7_400),
        });
        match decide(result, "k", &Metrics::new()) {
            Err(ProxyError::KeyInFlight { retry_after }) => {
                assert_eq!(retry_after, Duration::from_millis(7_400))
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }
}
