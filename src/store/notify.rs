//! Who is waiting for which record, in this process: the registry behind `on_in_flight = "wait"`. A
//! request that may wait subscribes to its record's [`Topic`] before its claim statement is sent, and is
//! woken when that record settles (completed, released or held). The wake comes from this process's own
//! completion, or from another replica's announcement heard by the one listener connection: `NOTIFY` on
//! PostgreSQL (`store/postgres/listen.rs`), `PUBLISH` on Redis (`store/redis/listen.rs`); its loss
//! wakes everyone (`store/listener.rs`). With SQLite (a single instance by design) the
//! in-process wake is all there is. Runs on the request path and in the listener task; touches nothing
//! but its own map.
//!
//! A wake carries no state: a woken request asks the store (or the replay cache) what became of its
//! record. So a spurious wake costs one re-check and a missed one is impossible once subscribed: every
//! settlement after the subscription bumps the topic's generation, which the waiter compares with the
//! one it saw before its last claim statement.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// A record's name in wake-ups: the first 8 bytes of SHA-256 over its scope and key (each prefixed by
/// its length), the same hash the access log shows. Neither the key nor the scope can be read back from
/// it; two records sharing one only wake each other's waiters for a needless re-check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topic(u64);

impl Topic {
    /// The topic of the record `(scope, key)`.
    pub fn of(scope: &str, key: &str) -> Topic {
        let mut hash = Sha256::new();
        for field in [scope.as_bytes(), key.as_bytes()] {
            hash.update((field.len() as u64).to_be_bytes());
            hash.update(field);
        }
        let digest = hash.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Topic(u64::from_be_bytes(first))
    }
}

/// The requests of this process waiting for records, by topic. One per process, shared by every worker.
pub struct Waiters {
    topics: Mutex<HashMap<Topic, watch::Sender<u64>>>,
    /// Tags this process's own announcements, so that its listener does not wake its waiters twice.
    instance: u64,
}

impl Waiters {
    /// An empty registry with a random instance tag.
    pub fn new() -> Arc<Waiters> {
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        Arc::new(Waiters {
            topics: Mutex::new(HashMap::new()),
            instance,
        })
    }

    /// Registers interest in `topic`: every [`Waiters::wake`] of it from now on is seen by the
    /// subscription, until it is dropped.
    pub fn subscribe(self: &Arc<Self>, topic: Topic) -> Subscription {
        let seen = self
            .lock()
            .entry(topic)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Subscription {
            waiters: Arc::clone(self),
            topic,
            seen,
        }
    }

    /// Wakes every subscription to `topic`; nothing when none is subscribed.
    pub fn wake(&self, topic: Topic) {
        if let Some(generation) = self.lock().get(&topic) {
            generation.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// Wakes every subscription: settlements may have been missed (the listener's connection was lost,
    /// or has just been made).
    pub fn wake_all(&self) {
        for generation in self.lock().values() {
            generation.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// How many topics have subscriptions now.
    pub fn topics(&self) -> usize {
        self.lock().len()
    }

    /// What this process tells the others when `topic` settled: the topic and this process's tag, in
    /// hex (33 bytes, far under PostgreSQL's 8000-byte payload limit).
    pub fn announcement(&self, topic: Topic) -> String {
        format!("{:016x}.{:016x}", topic.0, self.instance)
    }

    /// Wakes the subscriptions an announcement names, unless it came from this process, which woke its
    /// own waiters as it announced. `false` for a payload that is not an announcement.
    pub fn receive(&self, payload: &str) -> bool {
        let Some((topic, instance)) = parse(payload) else {
            return false;
        };
        if instance != self.instance {
            self.wake(topic);
        }
        true
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Topic, watch::Sender<u64>>> {
        // Held only to look a topic up or change the map, never across a call that could panic.
        self.topics.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn parse(payload: &str) -> Option<(Topic, u64)> {
    let (topic, instance) = payload.split_once('.')?;
    if topic.len() != 16 || instance.len() != 16 {
        return None;
    }
    let topic = u64::from_str_radix(topic, 16).ok()?;
    let instance = u64::from_str_radix(instance, 16).ok()?;
    Some((Topic(topic), instance))
}

/// One request's interest in a topic; dropping it unsubscribes.
pub struct Subscription {
    waiters: Arc<Waiters>,
    topic: Topic,
    seen: watch::Receiver<u64>,
}

impl Subscription {
    /// Marks every wake so far as seen. Call it before each re-check of the record: a wake that comes
    /// after it, even while the re-check runs, makes the next [`Subscription::woken`] return at once.
    pub fn mark_seen(&mut self) {
        self.seen.borrow_and_update();
    }

    /// Returns once the topic has been woken since the last [`Subscription::mark_seen`] (or since the
    /// subscription was made).
    pub async fn woken(&mut self) {
        // The registry keeps the sender while any subscription exists, so this never fails; if it did,
        // returning is the safe answer (a needless re-check).
        let _ = self.seen.changed().await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut topics = self.waiters.lock();
        // Under the lock no one subscribes meanwhile; this subscription's receiver is still counted.
        if topics
            .get(&self.topic)
            .is_some_and(|generation| generation.receiver_count() <= 1)
        {
            topics.remove(&self.topic);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn is_woken(subscription: &mut Subscription) -> bool {
        tokio::time::timeout(Duration::from_millis(10), subscription.woken())
            .await
            .is_ok()
    }

    #[test]
    fn a_topic_depends_on_scope_and_key_and_never_on_how_they_split() {
        assert_eq!(Topic::of("s", "k"), Topic::of("s", "k"));
        assert_ne!(Topic::of("s", "k"), Topic::of("s", "k2"));
        assert_ne!(Topic::of("ab", "c"), Topic::of("a", "bc"));
    }

    #[tokio::test]
    async fn a_wake_after_subscribing_is_seen_even_before_anyone_awaits_it() {
        let waiters = Waiters::new();
        let topic = Topic::of("s", "k");
        let mut subscription = waiters.subscribe(topic);
        assert!(!is_woken(&mut subscription).await);
        waiters.wake(topic);
        assert!(is_woken(&mut subscription).await);
        assert!(!is_woken(&mut subscription).await, "one wake is seen once");
    }

    #[tokio::test]
    async fn marking_seen_forgets_earlier_wakes_but_not_later_ones() {
        let waiters = Waiters::new();
        let topic = Topic::of("s", "k");
        let mut subscription = waiters.subscribe(topic);
        waiters.wake(topic);
        subscription.mark_seen();
        assert!(!is_woken(&mut subscription).await);
        waiters.wake(topic);
        assert!(is_woken(&mut subscription).await);
    }

    #[tokio::test]
    async fn wakes_reach_only_their_topic_and_wake_all_reaches_every_one() {
        let waiters = Waiters::new();
        let (a, b) = (Topic::of("s", "a"), Topic::of("s", "b"));
        let (mut on_a, mut on_b) = (waiters.subscribe(a), waiters.subscribe(b));
        waiters.wake(a);
        assert!(is_woken(&mut on_a).await);
        assert!(!is_woken(&mut on_b).await);
        waiters.wake_all();
        assert!(is_woken(&mut on_a).await);
        assert!(is_woken(&mut on_b).await);
    }

    #[test]
    fn the_last_subscription_to_go_removes_its_topic() {
        let waiters = Waiters::new();
        let topic = Topic::of("s", "k");
        let first = waiters.subscribe(topic);
        let second = waiters.subscribe(topic);
        assert_eq!(waiters.topics(), 1);
        drop(first);
        assert_eq!(waiters.topics(), 1);
        drop(second);
        assert_eq!(waiters.topics(), 0);
        waiters.wake(topic);
        assert_eq!(
            waiters.topics(),
            0,
            "a wake with no one waiting leaves nothing behind"
        );
    }

    #[tokio::test]
    async fn another_process_announcement_wakes_and_our_own_is_ignored() {
        let (ours, theirs) = (Waiters::new(), Waiters::new());
        let topic = Topic::of("s", "k");
        let mut subscription = ours.subscribe(topic);
        let own = ours.announcement(topic);
        assert_eq!(own.len(), 33);
        assert!(ours.receive(&own));
        assert!(!is_woken(&mut subscription).await, "already woken locally");
        assert!(ours.receive(&theirs.announcement(topic)));
        assert!(is_woken(&mut subscription).await);
    }

    #[test]
    fn a_payload_that_is_not_an_announcement_is_refused() {
        let waiters = Waiters::new();
        for payload in [
            "",
            "abc",
            "0123456789abcdef",
            "0123456789abcdef.0123456789abcde",
            "zz23456789abcdef.0123456789abcdef",
        ] {
            assert!(!waiters.receive(payload), "{payload:?}");
        }
    }
}
