//! Runs before the claim of a keyed request: answers the retry of a record this process has seen completed
//! (replay, or 422 for another payload) without a store round trip. Filled right after the claim
//! statement (a completed record it found) and after a won claim's completion (the [`Fill`] its claim
//! earned). Holds completed records only: they
//! change only by expiry, so a copy stays true until its deadline, which is never later than the record's
//! `expires_at` by the store's clock (and never later than `replay_cache.max_age`). Bounded in bytes; the
//! oldest entries go first. Touches nothing but its own map.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::time::Instant;

use crate::store::{ClaimRequest, ClaimResult, Existing, StoredResponse};

/// What an entry costs beyond its key and response bytes: the map slot at its load factor, the eviction
/// queue item, the `Arc`s and the allocator's rounding. Set so that the accounted bytes match the heap
/// growth measured with the benchmark's entries (bench/RESULTS.md).
const ENTRY_OVERHEAD: usize = 448;

/// What one stored header costs beyond its name and value: two allocations and the pair in its `Vec`.
const HEADER_OVERHEAD: usize = 64;

/// What the cache knows about a key.
#[derive(Debug)]
pub enum Lookup {
    /// Completed with the same fingerprint: replay this. The time is no later than the record's expiry.
    Replay(Arc<StoredResponse>, SystemTime),
    /// Completed with another fingerprint: the store would answer 422 too.
    Mismatch,
    /// Not known here (or no longer): ask the store.
    Miss,
}

/// What a won claim needs to enter the cache once its completion is stored: the request's fingerprint and
/// a deadline known to be no later than the record's expiry.
#[derive(Debug, Clone, Copy)]
pub struct Fill {
    /// The fingerprint the record is completed with.
    pub fingerprint: [u8; 32],
    /// No later than the record's `expires_at`.
    pub deadline: Instant,
}

/// A bounded map of completed records, shared by every request.
pub struct ReplayCache {
    max_bytes: usize,
    max_age: Duration,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Arc<str>, Entry>,
    /// Insertion order for eviction; an item whose generation no longer matches its entry is stale.
    order: VecDeque<(Arc<str>, u64)>,
    bytes: usize,
    generation: u64,
}

struct Entry {
    fingerprint: [u8; 32],
    response: Arc<StoredResponse>,
    deadline: Instant,
    expires_at: SystemTime,
    weight: usize,
    generation: u64,
}

impl ReplayCache {
    /// A cache of at most `max_bytes` (0 turns it off) whose entries live at most `max_age`.
    pub fn new(max_bytes: u64, max_age: Duration) -> ReplayCache {
        ReplayCache {
            max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            max_age,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Whether the cache can hold anything at all.
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0 && !self.max_age.is_zero()
    }

    /// Looks `(scope, key)` up for a request with `fingerprint`; an entry past its deadline is dropped.
    pub fn lookup(&self, scope: &str, key: &str, fingerprint: &[u8; 32]) -> Lookup {
        if !self.enabled() {
            return Lookup::Miss;
        }
        let name = entry_name(scope, key);
        let mut inner = self.lock();
        let Some(entry) = inner.entries.get(name.as_str()) else {
            return Lookup::Miss;
        };
        if entry.deadline <= Instant::now() {
            inner.remove(&name);
            return Lookup::Miss;
        }
        if entry.fingerprint == *fingerprint {
            Lookup::Replay(entry.response.clone(), entry.expires_at)
        } else {
            Lookup::Mismatch
        }
    }

    /// Remembers a completed record until `deadline` (capped by `max_age`). The caller vouches that the
    /// record's `expires_at` is no earlier than `deadline`. Too large a response is not kept.
    pub fn insert(
        &self,
        scope: &str,
        key: &str,
        fingerprint: [u8; 32],
        response: StoredResponse,
        deadline: Instant,
    ) {
        if !self.enabled() {
            return;
        }
        let now = Instant::now();
        let expires_at = SystemTime::now() + deadline.saturating_duration_since(now);
        let deadline = deadline.min(now + self.max_age);
        let name: Arc<str> = entry_name(scope, key).into();
        // The body may be a slice of a much larger receive buffer; keep only its own bytes.
        let response = StoredResponse {
            body: response.body.map(|body| Bytes::copy_from_slice(&body)),
            ..response
        };
        let weight = name.len() + response_weight(&response) + ENTRY_OVERHEAD;
        if deadline <= now || weight > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        inner.generation += 1;
        let entry = Entry {
            fingerprint,
            response: Arc::new(response),
            deadline,
            expires_at,
            weight,
            generation: inner.generation,
        };
        inner.remove(&name);
        inner.bytes += weight;
        inner.order.push_back((name.clone(), entry.generation));
        inner.entries.insert(name, entry);
        inner.evict_expired(now);
        inner.evict_down_to(self.max_bytes);
        inner.compact();
    }

    /// Entries held now (expired ones included until they are looked up or evicted).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes accounted to the entries held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while the lock is held; a poisoned map is still consistent.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Inner {
    fn remove(&mut self, name: &str) {
        if let Some(old) = self.entries.remove(name) {
            self.bytes -= old.weight;
        }
    }

    /// Drops the oldest entries while they are past their deadline, so entries nobody asks for again do
    /// not sit in memory until the byte bound pushes them out.
    fn evict_expired(&mut self, now: Instant) {
        while let Some((name, generation)) = self.order.front() {
            match self.entries.get(name) {
                Some(entry) if entry.generation == *generation && entry.deadline > now => return,
                Some(entry) if entry.generation == *generation => {
                    let name = name.clone();
                    self.remove(&name);
                }
                _ => {}
            }
            self.order.pop_front();
        }
    }

    fn evict_down_to(&mut self, max_bytes: usize) {
        while self.bytes > max_bytes {
            let Some((name, generation)) = self.order.pop_front() else {
                return;
            };
            if self
                .entries
                .get(&name)
                .is_some_and(|e| e.generation == generation)
            {
                self.remove(&name);
            }
        }
    }

    /// Drops stale queue items once they outnumber the live ones, so the queue stays proportional to the map.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.entries.len() + 16 {
            return;
        }
        let entries = &self.entries;
        self.order
            .retain(|(name, generation)| entries.get(name).is_some_and(|e| e.generation == *generation));
    }
}

/// Scope and key in one string; a newline cannot occur in either (keys are visible ASCII, scopes hex).
fn entry_name(scope: &str, key: &str) -> String {
    let mut name = String::with_capacity(scope.len() + 1 + key.len());
    name.push_str(scope);
    name.push('\n');
    name.push_str(key);
    name
}

fn response_weight(response: &StoredResponse) -> usize {
    let headers: usize = response
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + HEADER_OVERHEAD)
        .sum();
    headers + response.body.as_ref().map_or(0, |body| body.len())
}

impl ReplayCache {
    /// Feeds the replay cache from what the claim statement found, with deadlines measured from `started`,
    /// an instant before the statement ran. A completed record reported by the store enters now. A won
    /// claim's record (new, retried or taken over, expiring when the store said) can enter once it is
    /// completed: that is the returned [`Fill`]. Its expiry only moves later until then (a heartbeat
    /// may extend it, a completion keeps it).
    pub fn remember(&self, claim: &ClaimRequest, result: &ClaimResult, started: Instant) -> Option<Fill> {
        // The store rounds its time to expiry up to the millisecond.
        let until = |expires_in: &Duration| started + expires_in.saturating_sub(Duration::from_millis(1));
        match result {
            ClaimResult::Won { expires_in, .. } => Some(Fill {
                fingerprint: claim.fingerprint,
                deadline: until(expires_in),
            }),
            ClaimResult::Held(Existing::Completed {
                same_fingerprint: true,
                response,
                expires_in,
                ..
            }) => {
                let id = &claim.id;
                let deadline = until(expires_in);
                self.insert(&id.scope, &id.key, claim.fingerprint, response.clone(), deadline);
                None
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: [u8; 32] = [7; 32];
    const OTHER_FP: [u8; 32] = [8; 32];

    fn response(body: &'static [u8]) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: Some(Bytes::from_static(body)),
        }
    }

    fn in_secs(secs: u64) -> Instant {
        Instant::now() + Duration::from_secs(secs)
    }

    fn cache() -> ReplayCache {
        ReplayCache::new(1 << 20, Duration::from_secs(3600))
    }

    #[tokio::test(start_paused = true)]
    async fn same_fingerprint_replays_the_stored_response() {
        let cache = cache();
        cache.insert("s", "k", FP, response(b"{\"id\":1}"), in_secs(60));
        match cache.lookup("s", "k", &FP) {
            Lookup::Replay(stored, _) => assert_eq!(*stored, response(b"{\"id\":1}")),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn other_fingerprint_is_a_mismatch_and_other_scope_a_miss() {
        let cache = cache();
        cache.insert("s", "k", FP, response(b"x"), in_secs(60));
        assert!(matches!(cache.lookup("s", "k", &OTHER_FP), Lookup::Mismatch));
        assert!(matches!(cache.lookup("other", "k", &FP), Lookup::Miss));
        assert!(matches!(cache.lookup("s", "k2", &FP), Lookup::Miss));
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_is_never_served_at_or_past_its_deadline() {
        let cache = cache();
        cache.insert("s", "k", FP, response(b"x"), in_secs(10));
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(matches!(cache.lookup("s", "k", &FP), Lookup::Replay(..)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(matches!(cache.lookup("s", "k", &FP), Lookup::Miss));
        assert!(matches!(cache.lookup("s", "k", &OTHER_FP), Lookup::Miss));
        assert_eq!(cache.len(), 0, "an expired entry is dropped when seen");
    }

    #[tokio::test(start_paused = true)]
    async fn max_age_caps_the_deadline() {
        let cache = ReplayCache::new(1 << 20, Duration::from_secs(5));
        cache.insert("s", "k", FP, response(b"x"), in_secs(3600));
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(matches!(cache.lookup("s", "k", &FP), Lookup::Miss));
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_already_past_is_not_kept() {
        let cache = cache();
        cache.insert("s", "k", FP, response(b"x"), Instant::now());
        assert!(cache.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_entries_go_first_when_over_the_byte_bound() {
        let one = entry_name("s", "k0").len() + response_weight(&response(b"x")) + ENTRY_OVERHEAD;
        let cache = ReplayCache::new(3 * one as u64, Duration::from_secs(3600));
        for i in 0..5 {
            cache.insert("s", &format!("k{i}"), FP, response(b"x"), in_secs(60));
        }
        assert_eq!(cache.len(), 3);
        assert!(cache.bytes() <= 3 * one);
        assert!(matches!(cache.lookup("s", "k0", &FP), Lookup::Miss));
        assert!(matches!(cache.lookup("s", "k1", &FP), Lookup::Miss));
        assert!(matches!(cache.lookup("s", "k4", &FP), Lookup::Replay(..)));
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_leave_when_newer_ones_arrive() {
        let cache = cache();
        cache.insert("s", "old", FP, response(b"x"), in_secs(10));
        tokio::time::advance(Duration::from_secs(10)).await;
        cache.insert("s", "new", FP, response(b"y"), in_secs(10));
        assert_eq!(cache.len(), 1, "the expired entry is gone without a lookup");
        assert!(matches!(cache.lookup("s", "new", &FP), Lookup::Replay(..)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cached_body_does_not_keep_its_receive_buffer_alive() {
        let cache = cache();
        let buffer = Bytes::from(vec![b'x'; 64 * 1024]);
        let mut stored = response(b"");
        stored.body = Some(buffer.slice(0..10));
        cache.insert("s", "k", FP, stored, in_secs(60));
        let Lookup::Replay(cached, _) = cache.lookup("s", "k", &FP) else {
            panic!("expected a replay");
        };
        let body = cached.body.as_ref().expect("a body");
        assert_eq!(&body[..], &[b'x'; 10]);
        let within = buffer.as_ptr_range();
        assert!(
            !within.contains(&body.as_ptr()),
            "the body still points into the receive buffer"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_response_larger_than_the_bound_is_not_kept() {
        let cache = ReplayCache::new(256, Duration::from_secs(3600));
        cache.insert("s", "k", FP, response(&[0; 512]), in_secs(60));
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn reinserting_a_key_replaces_it_and_keeps_the_queue_bounded() {
        let cache = cache();
        for round in 0..1_000 {
            cache.insert("s", "k", FP, response(b"x"), in_secs(60));
            if round % 2 == 0 {
                tokio::time::advance(Duration::from_secs(61)).await;
                assert!(matches!(cache.lookup("s", "k", &FP), Lookup::Miss));
            }
        }
        assert_eq!(cache.len(), 1);
        assert!(cache.lock().order.len() <= 19, "stale queue items are compacted");
        let one = entry_name("s", "k").len() + response_weight(&response(b"x")) + ENTRY_OVERHEAD;
        assert_eq!(cache.bytes(), one);
    }

    #[tokio::test(start_paused = true)]
    async fn every_won_claim_fills_until_the_expiry_its_claim_reported() {
        use crate::store::{ClaimKind, RecordId};
        let claim = ClaimRequest {
            id: RecordId {
                scope: "s".into(),
                key: "k".into(),
                token: uuid::Uuid::nil(),
            },
            fingerprint: FP,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(86_400),
        };
        let started = Instant::now();
        for kind in [ClaimKind::New, ClaimKind::Retry, ClaimKind::Takeover] {
            let won = ClaimResult::Won {
                attempt: 2,
                kind,
                expires_in: Duration::from_secs(90),
            };
            let fill = cache().remember(&claim, &won, started).expect("a fill");
            assert_eq!(fill.fingerprint, FP);
            // Not the request's ttl: what the store reported, less its rounding.
            assert_eq!(fill.deadline, started + Duration::from_millis(89_999), "{kind:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn zero_size_turns_the_cache_off() {
        let cache = ReplayCache::new(0, Duration::from_secs(3600));
        cache.insert("s", "k", FP, response(b"x"), in_secs(60));
        assert!(!cache.enabled());
        assert!(matches!(cache.lookup("s", "k", &FP), Lookup::Miss));
    }
}
