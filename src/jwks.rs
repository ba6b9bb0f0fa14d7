//! The key sets `scope_jwt` verifies bearer tokens with, one per source (`jwks_file` or `jwks_url`)
//! however many routes name it. Each set is read at start, again every `refresh`, and again when a
//! token names a `kid` the set lacks (a key rotation), at most once per `min_refetch`, every such
//! token waiting for that one read (a few seconds at most; then, or when the read fails, 503). A read
//! that fails keeps the last good set and is logged; until a set's first read succeeds, `/readyz` says
//! not ready and keyed requests on its routes get 503 at once.
//! Built by `lib.rs` from the configuration; the refresh tasks stop with the proxy. A reload
//! (`reload.rs`) keeps each set the new configuration still names with the same timings (its keys and
//! its refresh task), reads the key files again, and stops the refresh of a set no longer named.
//! Touches the key files and the network (the set's URL) only.

mod fetch;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::config::jwk_set::Keys;
use crate::config::{Config, JwksSource, JwtRules};

/// The first reads of a set that fail are tried again after this, doubling up to `min_refetch`.
const FIRST_RETRY: Duration = Duration::from_secs(1);

/// The longest a token naming a kid the set lacks waits for the set: for a read running, then for its
/// own (then 503 `keys-unavailable`, try again). Scheduled reads may take `fetch::READ_TIMEOUT`.
const REFETCH_WAIT: Duration = Duration::from_secs(3);

/// Every key set the configuration names.
#[derive(Default)]
pub struct KeySets {
    sets: HashMap<JwksSource, Arc<KeySet>>,
}

impl KeySets {
    /// The sets the configuration's routes name, none read yet but those from files (which the
    /// configuration has just read, so they are read again here at once).
    pub fn of(config: &Config) -> Arc<KeySets> {
        let sets = KeySets::named(config);
        for set in sets.values() {
            set.read_file();
        }
        Arc::new(KeySets { sets })
    }

    /// The sets of a reloaded configuration: each of these sets it still names with the same timings is
    /// kept as it is (its keys, its refresh), a key file read again; a set it names anew is read as at
    /// start, its refresh started until `shutdown`; the refresh of a set it no longer names stops.
    pub fn again(&self, config: &Config, shutdown: &CancellationToken) -> Arc<KeySets> {
        let mut sets = KeySets::named(config);
        let mut new = Vec::new();
        for (source, set) in sets.iter_mut() {
            match self.sets.get(source) {
                Some(kept) if (kept.refresh, kept.min_refetch) == (set.refresh, set.min_refetch) => {
                    *set = kept.clone();
                }
                // Other timings: a set and a refresh of its own, which starts from the keys the kept one
                // holds (else the routes would wait for a read, refused, and the proxy not ready).
                Some(kept) => {
                    *set.current.write().unwrap_or_else(|e| e.into_inner()) = kept.current();
                    set.failing.store(kept.failing(), Ordering::Relaxed);
                    new.push(set.clone());
                }
                None => new.push(set.clone()),
            }
            set.read_file();
        }
        for (source, old) in &self.sets {
            if !sets.get(source).is_some_and(|set| Arc::ptr_eq(set, old)) {
                old.stop.cancel();
            }
        }
        for set in new {
            tokio::spawn(set.refresh(shutdown.clone()));
        }
        Arc::new(KeySets { sets })
    }

    /// A set, not read yet, for each source the configuration's routes name.
    fn named(config: &Config) -> HashMap<JwksSource, Arc<KeySet>> {
        let mut sets: HashMap<JwksSource, Arc<KeySet>> = HashMap::new();
        let routes = config
            .routes
            .routes
            .iter()
            .chain(std::iter::once(&config.routes.default));
        for rules in routes.filter_map(|route| route.policy.key.scope_jwt.as_deref()) {
            match sets.get_mut(&rules.source) {
                // Two routes with the same set and other timings: the set is read as often as either asks.
                Some(set) => {
                    let set = Arc::get_mut(set).expect("not shared while built");
                    set.refresh = set.refresh.min(rules.refresh);
                    set.min_refetch = set.min_refetch.min(rules.min_refetch);
                }
                None => {
                    sets.insert(rules.source.clone(), Arc::new(KeySet::new(rules)));
                }
            }
        }
        sets
    }

    /// The set of this source.
    pub fn get(&self, source: &JwksSource) -> Option<&Arc<KeySet>> {
        self.sets.get(source)
    }

    /// The first set not read yet, if any: while there is one, the proxy is not ready.
    pub fn waiting_for(&self) -> Option<&JwksSource> {
        self.sets
            .values()
            .find(|set| set.current().is_none())
            .map(|set| &set.source)
    }

    /// Starts reading each set on its schedule, until `shutdown`.
    pub fn spawn_refresh(&self, shutdown: &CancellationToken) {
        for set in self.sets.values() {
            tokio::spawn(set.clone().refresh(shutdown.clone()));
        }
    }
}

/// One key set: the keys read last, and when they were.
pub struct KeySet {
    source: JwksSource,
    refresh: Duration,
    min_refetch: Duration,
    current: RwLock<Option<Arc<Keys>>>,
    /// When the set was last read (or tried), as the read ended; held while a read runs, so that reads
    /// never overlap and every token waiting for a new key waits for the same one.
    last_read: tokio::sync::Mutex<Option<Instant>>,
    /// Whether the last read failed (the keys kept are older than the source's).
    failing: AtomicBool,
    /// Stops its refresh when a reload no longer names it.
    stop: CancellationToken,
}

impl KeySet {
    fn new(rules: &JwtRules) -> KeySet {
        KeySet {
            source: rules.source.clone(),
            refresh: rules.refresh,
            min_refetch: rules.min_refetch,
            current: RwLock::new(None),
            last_read: tokio::sync::Mutex::new(None),
            failing: AtomicBool::new(false),
            stop: CancellationToken::new(),
        }
    }

    /// Reads a set from a file now (the configuration has just read it, so it is there); a set from a
    /// URL is read by its refresh.
    fn read_file(&self) {
        if let JwksSource::File(path) = &self.source {
            match std::fs::read(path)
                .map_err(|e| e.to_string())
                .and_then(|b| Keys::parse(&b))
            {
                Ok(keys) => self.keep(keys),
                Err(e) => tracing::warn!(jwks = %self.source, error = %e, "cannot read the key set"),
            }
        }
    }

    /// Where the set comes from.
    pub fn source(&self) -> &JwksSource {
        &self.source
    }

    /// The keys read last, if a read has succeeded.
    pub fn current(&self) -> Option<Arc<Keys>> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the last read of the set failed, so that a key it lacks may be one the source holds.
    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// The set after reading it again, for a token whose key it lacks: unless it was read less than
    /// `min_refetch` ago (then the set as it is), or a read is running (then the set that read brings).
    /// `None` when no set can be had without waiting past [`REFETCH_WAIT`] (a read running or its own
    /// taking longer), and before the first read succeeds: the refresh task is reading it, and a
    /// request never waits for an endpoint that may take `fetch`'s whole timeout to fail.
    pub async fn refetch(&self) -> Option<Arc<Keys>> {
        self.current()?;
        let started = Instant::now();
        let mut last = tokio::time::timeout(REFETCH_WAIT, self.last_read.lock())
            .await
            .ok()?;
        if last.is_some_and(|at| at.elapsed() < self.min_refetch) {
            return self.current();
        }
        let left = REFETCH_WAIT.saturating_sub(started.elapsed());
        self.read(&mut last, left, "a token names a key the set lacks")
            .await
            .ok()?;
        drop(last);
        self.current()
    }

    fn keep(&self, keys: Keys) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(keys));
    }

    /// Reads the set now; a failure keeps the set there was.
    async fn read(&self, last: &mut Option<Instant>, limit: Duration, why: &'static str) -> Result<(), ()> {
        *last = Some(Instant::now());
        let read = fetch::read(&self.source, limit).await;
        // Counted from the read's end: a read slower than `min_refetch` is not followed at once by
        // another for the tokens that waited for it.
        *last = Some(Instant::now());
        self.failing.store(read.is_err(), Ordering::Relaxed);
        match read {
            Ok(keys) => {
                let first = self.current().is_none();
                for skipped in &keys.skipped {
                    tracing::debug!(jwks = %self.source, "key set: left out {skipped}");
                }
                tracing::info!(jwks = %self.source, keys = keys.len(), first, why, "key set read");
                self.keep(keys);
                Ok(())
            }
            Err(error) if self.current().is_some() => {
                tracing::warn!(
                    jwks = %self.source,
                    %error,
                    why,
                    "cannot read the key set; the last one read is kept"
                );
                Err(())
            }
            Err(error) => {
                // Said so only once a set was read: before, there is none to keep.
                tracing::warn!(
                    jwks = %self.source,
                    %error,
                    why,
                    "cannot read the key set; none read yet, so keyed requests on its routes get 503"
                );
                Err(())
            }
        }
    }

    /// Reads the set until the first read succeeds (the first try at once, then after [`FIRST_RETRY`],
    /// doubling up to `min_refetch`), then every `refresh` (unless a token's unknown `kid` has had it
    /// read in the last half of that), until `shutdown`.
    async fn refresh(self: Arc<Self>, shutdown: CancellationToken) {
        let mut wait = if self.current().is_some() {
            self.refresh
        } else {
            Duration::ZERO
        };
        let mut retry = FIRST_RETRY;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            let mut last = self.last_read.lock().await;
            let loaded = self.current().is_some();
            if !(loaded && last.is_some_and(|at| at.elapsed() < self.refresh / 2)) {
                let _ = self.read(&mut last, fetch::READ_TIMEOUT, "scheduled").await;
            }
            drop(last);
            wait = if self.current().is_some() {
                self.refresh
            } else {
                let now = retry;
                retry = (retry * 2).min(self.min_refetch);
                now
            };
        }
    }
}
