//! A store for unit tests, so that a stage can be tried alone under `tokio::time::pause()`: it answers
//! each operation as the test scripts it (queued answers first, then the operation's standing answer),
//! after the delay the test sets for that operation, and logs every call with the (paused) clock's time.
//! Unscripted, it answers as a healthy store does: claims are won as new records, fenced writes apply.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{
    ClaimKind, ClaimRequest, ClaimResult, Lifecycle, RecordId, RecordInfo, RecordStats, StoreError,
    StoreHandle, StoredResponse, Upkeep,
};
use crate::metrics::Metrics;

/// An operation of the [`Store`] trait, as the stub logs and scripts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Claim,
    Heartbeat,
    Complete,
    Release,
    Hold,
    ReleaseStale,
    Sweep,
    Find,
    Stats,
    Announce,
}

/// What the stub answers to one call.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    /// A fenced write applied (`true`) or refused by its fence (`false`).
    Done(bool),
    /// A claim statement's answer.
    Claim(ClaimResult),
    /// How many records a sweep deleted.
    Deleted(u64),
    /// The store failed.
    Fail(StoreError),
}

/// One call the stub received: the operation, when it began (by the tokio clock), and what it carried.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) op: Op,
    pub(crate) at: Instant,
    /// The response of a completion.
    pub(crate) stored: Option<StoredResponse>,
}

#[derive(Default)]
struct Script {
    queued: HashMap<Op, VecDeque<Reply>>,
    standing: HashMap<Op, Reply>,
    delays: HashMap<Op, Duration>,
    calls: Vec<Call>,
}

/// The scripted store. Script it through its methods, hand [`StubStore::handle`] to the stage, read
/// the calls back with [`StubStore::calls`].
#[derive(Default)]
pub(crate) struct StubStore {
    script: Mutex<Script>,
}

impl StubStore {
    pub(crate) fn new() -> Arc<StubStore> {
        Arc::new(StubStore::default())
    }

    /// The store behind a handle, as the request path holds it.
    pub(crate) fn handle(self: &Arc<Self>, metrics: &Metrics) -> StoreHandle {
        StoreHandle::new(self.clone(), metrics.clone())
    }

    /// Answers the next call of `op` (after any answers queued before) with `reply`.
    pub(crate) fn then(&self, op: Op, reply: Reply) -> &Self {
        self.lock().queued.entry(op).or_default().push_back(reply);
        self
    }

    /// Answers every call of `op` with `reply` once the queued answers are used up.
    pub(crate) fn always(&self, op: Op, reply: Reply) -> &Self {
        self.lock().standing.insert(op, reply);
        self
    }

    /// Makes every call of `op` take `delay` before it answers.
    pub(crate) fn delay(&self, op: Op, delay: Duration) -> &Self {
        self.lock().delays.insert(op, delay);
        self
    }

    /// Every call so far, in the order they began.
    pub(crate) fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// When each call of `op` so far began.
    pub(crate) fn times(&self, op: Op) -> Vec<Instant> {
        self.lock()
            .calls
            .iter()
            .filter(|call| call.op == op)
            .map(|call| call.at)
            .collect()
    }

    /// How many calls of `op` there have been.
    pub(crate) fn count(&self, op: Op) -> usize {
        self.times(op).len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Logs the call, waits its delay, and takes its answer.
    async fn call(&self, op: Op, stored: Option<&StoredResponse>) -> Reply {
        let delay = {
            let mut script = self.lock();
            script.calls.push(Call {
                op,
                at: Instant::now(),
                stored: stored.cloned(),
            });
            script.delays.get(&op).copied()
        };
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let mut script = self.lock();
        if let Some(reply) = script.queued.get_mut(&op).and_then(VecDeque::pop_front) {
            return reply;
        }
        script.standing.get(&op).cloned().unwrap_or(match op {
            Op::Claim => Reply::Claim(ClaimResult::Won {
                attempt: 1,
                kind: ClaimKind::New,
                expires_in: Duration::from_secs(86_400),
            }),
            Op::Sweep => Reply::Deleted(0),
            _ => Reply::Done(true),
        })
    }

    async fn done(&self, op: Op, stored: Option<&StoredResponse>) -> Result<bool, StoreError> {
        match self.call(op, stored).await {
            Reply::Done(applied) => Ok(applied),
            Reply::Fail(error) => Err(error),
            other => panic!("{op:?} was scripted to answer {other:?}"),
        }
    }
}

#[async_trait::async_trait]
impl Lifecycle for StubStore {
    async fn claim(&self, _: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        match self.call(Op::Claim, None).await {
            Reply::Claim(result) => Ok(result),
            Reply::Fail(error) => Err(error),
            other => panic!("a claim was scripted to answer {other:?}"),
        }
    }

    async fn heartbeat(&self, _: &RecordId, _: Duration) -> Result<bool, StoreError> {
        self.done(Op::Heartbeat, None).await
    }

    async fn complete(&self, _: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        self.done(Op::Complete, Some(response)).await
    }

    async fn release(&self, _: &RecordId) -> Result<bool, StoreError> {
        self.done(Op::Release, None).await
    }

    async fn hold(&self, _: &RecordId) -> Result<bool, StoreError> {
        self.done(Op::Hold, None).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn announce(&self, _: &str) -> Result<(), StoreError> {
        match self.call(Op::Announce, None).await {
            Reply::Fail(error) => Err(error),
            _ => Ok(()),
        }
    }
}

#[async_trait::async_trait]
impl Upkeep for StubStore {
    async fn release_stale(&self, _: &RecordId) -> Result<bool, StoreError> {
        self.done(Op::ReleaseStale, None).await
    }

    async fn sweep(&self, _: u32) -> Result<u64, StoreError> {
        match self.call(Op::Sweep, None).await {
            Reply::Deleted(deleted) => Ok(deleted),
            Reply::Fail(error) => Err(error),
            other => panic!("a sweep was scripted to answer {other:?}"),
        }
    }

    async fn find(&self, _: &str, _: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        match self.call(Op::Find, None).await {
            Reply::Fail(error) => Err(error),
            _ => Ok(Vec::new()),
        }
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        match self.call(Op::Stats, None).await {
            Reply::Fail(error) => Err(error),
            _ => Ok(RecordStats::default()),
        }
    }
}
