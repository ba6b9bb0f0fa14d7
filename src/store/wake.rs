//! Waking, in this process: who is waiting for which record, the registry behind `on_in_flight =
//! "wait"`. The words of waiting are used one way each across the code: a record *settles* (completed,
//! released or held; `proxy/settle.rs`); its waiters in this process are *woken* here; the other
//! replicas are told by an *announcement* and hear it by *listening* (`store/listen.rs`, and each shared
//! backend's `listen.rs`). A request that may wait starts waiting for its record's [`RecordTag`] before
//! its claim statement is sent, and is woken when that record settles: by this process's own
//! settlement, or by another replica's announcement heard by the one listening connection; losing that
//! connection wakes everyone. With SQLite (a single instance by design) the in-process wake is all there
//! is. Runs on the request path and in the listening task; touches nothing but its own map.
//!
//! A wake carries no state: a woken request asks the store (or the replay cache) what became of its
//! record. So a spurious wake costs one re-check and a missed one is impossible once waiting: every
//! settlement after the waiter was made bumps the tag's generation, which the waiter compares with the
//! one it saw before its last claim statement.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// A record's name in wakes and announcements: the first 8 bytes of SHA-256 over its scope and key (each prefixed by
/// its length), the same hash the access log shows. Neither the key nor the scope can be read back from
/// it; two records sharing one only wake each other's waiters for a needless re-check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecordTag(u64);

impl RecordTag {
    /// The tag of the record `(scope, key)`.
    pub fn of(scope: &str, key: &str) -> RecordTag {
        let mut hash = Sha256::new();
        for field in [scope.as_bytes(), key.as_bytes()] {
            hash.update((field.len() as u64).to_be_bytes());
            hash.update(field);
        }
        let digest = hash.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        RecordTag(u64::from_be_bytes(first))
    }

    /// The tag as a number, as announcements write it.
    pub(crate) fn bits(self) -> u64 {
        self.0
    }

    /// The tag an announcement names.
    pub(crate) fn from_bits(bits: u64) -> RecordTag {
        RecordTag(bits)
    }
}

/// The requests of this process waiting for records, by tag. One per process, shared by every worker.
pub struct Waiters {
    tags: Mutex<HashMap<RecordTag, watch::Sender<u64>>>,
    /// Marks this process's own announcements, so that its listening does not wake its waiters twice.
    instance: u64,
}

impl Waiters {
    /// An empty registry with a random instance id.
    pub fn new() -> Arc<Waiters> {
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        Arc::new(Waiters {
            tags: Mutex::new(HashMap::new()),
            instance,
        })
    }

    /// A waiter for `tag`: every [`Waiters::wake`] of it from now on is seen by the waiter, until it is
    /// dropped.
    pub fn wait_for(self: &Arc<Self>, tag: RecordTag) -> Waiter {
        let seen = self
            .lock()
            .entry(tag)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Waiter {
            waiters: Arc::clone(self),
            tag,
            seen,
        }
    }

    /// Wakes every waiter for `tag`; nothing when none is waiting.
    pub fn wake(&self, tag: RecordTag) {
        if let Some(generation) = self.lock().get(&tag) {
            generation.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// Wakes every waiter: settlements may have been missed (the listening connection was lost, or has
    /// just been made).
    pub fn wake_all(&self) {
        for generation in self.lock().values() {
            generation.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// How many tags have waiters now.
    pub fn tags(&self) -> usize {
        self.lock().len()
    }

    /// This process's id in its announcements.
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordTag, watch::Sender<u64>>> {
        // Held only to look a tag up or change the map, never across a call that could panic.
        self.tags.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One request waiting for a record; dropping it stops the wait.
pub struct Waiter {
    waiters: Arc<Waiters>,
    tag: RecordTag,
    seen: watch::Receiver<u64>,
}

impl Waiter {
    /// Marks every wake so far as seen. Call it before each re-check of the record: a wake that comes
    /// after it, even while the re-check runs, makes the next [`Waiter::woken`] return at once.
    pub fn mark_seen(&mut self) {
        self.seen.borrow_and_update();
    }

    /// Returns once the tag has been woken since the last [`Waiter::mark_seen`] (or since the
    /// waiter was made).
    pub async fn woken(&mut self) {
        // The registry keeps the sender while any waiter exists, so this never fails; if it did,
        // returning is the safe answer (a needless re-check).
        let _ = self.seen.changed().await;
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut tags = self.waiters.lock();
        // Under the lock no one waits meanwhile; this waiter's receiver is still counted.
        if tags
            .get(&self.tag)
            .is_some_and(|generation| generation.receiver_count() <= 1)
        {
            tags.remove(&self.tag);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;

    /// Whether `waiter` has a wake it has not seen (waiting briefly for it).
    pub(crate) async fn is_woken(waiter: &mut Waiter) -> bool {
        tokio::time::timeout(Duration::from_millis(10), waiter.woken())
            .await
            .is_ok()
    }

    #[test]
    fn a_tag_depends_on_scope_and_key_and_never_on_how_they_split() {
        assert_eq!(RecordTag::of("s", "k"), RecordTag::of("s", "k"));
        assert_ne!(RecordTag::of("s", "k"), RecordTag::of("s", "k2"));
        assert_ne!(RecordTag::of("ab", "c"), RecordTag::of("a", "bc"));
    }

    #[tokio::test]
    async fn a_wake_after_waiting_begins_is_seen_even_before_anyone_awaits_it() {
        let waiters = Waiters::new();
        let tag = RecordTag::of("s", "k");
        let mut waiter = waiters.wait_for(tag);
        assert!(!is_woken(&mut waiter).await);
        waiters.wake(tag);
        assert!(is_woken(&mut waiter).await);
        assert!(!is_woken(&mut waiter).await, "one wake is seen once");
    }

    #[tokio::test]
    async fn marking_seen_forgets_earlier_wakes_but_not_later_ones() {
        let waiters = Waiters::new();
        let tag = RecordTag::of("s", "k");
        let mut waiter = waiters.wait_for(tag);
        waiters.wake(tag);
        waiter.mark_seen();
        assert!(!is_woken(&mut waiter).await);
        waiters.wake(tag);
        assert!(is_woken(&mut waiter).await);
    }

    #[tokio::test]
    async fn wakes_reach_only_their_tag_and_wake_all_reaches_every_one() {
        let waiters = Waiters::new();
        let (a, b) = (RecordTag::of("s", "a"), RecordTag::of("s", "b"));
        let (mut on_a, mut on_b) = (waiters.wait_for(a), waiters.wait_for(b));
        waiters.wake(a);
        assert!(is_woken(&mut on_a).await);
        assert!(!is_woken(&mut on_b).await);
        waiters.wake_all();
        assert!(is_woken(&mut on_a).await);
        assert!(is_woken(&mut on_b).await);
    }

    #[test]
    fn the_last_waiter_to_go_removes_its_tag() {
        let waiters = Waiters::new();
        let tag = RecordTag::of("s", "k");
        let first = waiters.wait_for(tag);
        let second = waiters.wait_for(tag);
        assert_eq!(waiters.tags(), 1);
        drop(first);
        assert_eq!(waiters.tags(), 1);
        drop(second);
        assert_eq!(waiters.tags(), 0);
        waiters.wake(tag);
        assert_eq!(
            waiters.tags(),
            0,
            "a wake with no one waiting leaves nothing behind"
        );
    }
}
