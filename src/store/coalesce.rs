//! Coalescing of concurrent store operations (claims, completions) into batches, so that many
//! keys cost one statement and one commit instead of one each. Natural batching, no timer: an operation
//! that finds no batch running starts one at once, alone, and pays no wait; operations that arrive while
//! a batch runs queue, and the next batch to finish takes them all (up to `max_batch`) in one go. So
//! batches grow exactly as fast as the store falls behind. A further batch (up to `max_in_flight` at
//! once) starts only when a full batch is waiting, more than the running ones take in their next round:
//! batches that run side by side by choice would each be smaller and cost a commit each.
//! A batch's answers reach callers waiting on other threads (the proxy's other workers) through one task
//! spawned on each such thread's runtime, so that thread is signalled once per batch, not once per
//! caller.
//! Runs wherever a store operation runs; touches nothing but its queue and the batch function it is given.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::StoreError;

/// A batch function's future: one output per input, in the same order.
pub(crate) type BatchFuture<O> = Pin<Box<dyn Future<Output = Vec<O>> + Send>>;

type BatchFn<I, O> = Box<dyn Fn(Vec<I>) -> BatchFuture<O> + Send + Sync>;

/// Queues operations of one kind and runs them in batches through a batch function.
pub(crate) struct Coalescer<I, O> {
    inner: Arc<Inner<I, O>>,
}

struct Inner<I, O> {
    queue: Mutex<Queue<I, O>>,
    max_batch: usize,
    max_in_flight: usize,
    run: BatchFn<I, O>,
}

struct Queue<I, O> {
    waiting: Vec<Waiting<I, O>>,
    in_flight: usize,
}

/// A queued operation, the way to its caller, and where the caller waits.
type Waiting<I, O> = (I, oneshot::Sender<O>, Option<Home>);

/// The thread an operation's caller waits on, and its runtime, through which a batch that ran on
/// another thread hands it its output.
struct Home {
    thread: ThreadId,
    runtime: Handle,
}

impl Home {
    fn here() -> Option<Home> {
        Some(Home {
            thread: std::thread::current().id(),
            runtime: Handle::try_current().ok()?,
        })
    }
}

impl<I: Send + 'static, O: Send + 'static> Coalescer<I, O> {
    /// At most `max_in_flight` batches run at once, each of at most `max_batch` operations (both at
    /// least 1); more than one only while a full batch waits. `run` must return exactly one output per
    /// input, in order.
    pub(crate) fn new<F>(max_batch: usize, max_in_flight: usize, run: F) -> Coalescer<I, O>
    where
        F: Fn(Vec<I>) -> BatchFuture<O> + Send + Sync + 'static,
    {
        Coalescer {
            inner: Arc::new(Inner {
                queue: Mutex::new(Queue {
                    waiting: Vec::new(),
                    in_flight: 0,
                }),
                max_batch: max_batch.max(1),
                max_in_flight: max_in_flight.max(1),
                run: Box::new(run),
            }),
        }
    }

    /// Runs `item` in the next batch and returns its output; `None` if its batch never answered (its
    /// task panicked or the runtime is shutting down). Once submitted, the operation runs even if the
    /// caller stops waiting for it.
    pub(crate) async fn submit(&self, item: I) -> Option<O> {
        let (answer, output) = oneshot::channel();
        let home = Home::here();
        let batch = {
            let mut queue = self.inner.lock();
            queue.waiting.push((item, answer, home));
            let idle = queue.in_flight == 0;
            let backlog = queue.waiting.len() >= self.inner.max_batch;
            if idle || (backlog && queue.in_flight < self.inner.max_in_flight) {
                queue.in_flight += 1;
                Some(self.inner.take(&mut queue))
            } else {
                None
            }
        };
        if let Some(batch) = batch {
            tokio::spawn(Arc::clone(&self.inner).drive(batch));
        }
        output.await.ok()
    }
}

impl<I: Send + 'static, O: Send + 'static> Inner<I, O> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<I, O>> {
        // The lock is only held to move items in and out of the queue, never across a panic-prone call.
        self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn take(&self, queue: &mut Queue<I, O>) -> Vec<Waiting<I, O>> {
        let n = queue.waiting.len().min(self.max_batch);
        queue.waiting.drain(..n).collect()
    }

    /// Runs batches until the queue is empty, then gives its slot back. The queue is checked under the
    /// same lock that `submit` pushes under, so no operation is left waiting without a batch to take it.
    async fn drive(self: Arc<Self>, mut batch: Vec<Waiting<I, O>>) {
        let _slot = Slot(&self);
        loop {
            let (items, answers): (Vec<I>, Vec<_>) = batch
                .into_iter()
                .map(|(item, answer, home)| (item, (answer, home)))
                .unzip();
            let outputs = (self.run)(items).await;
            debug_assert_eq!(
                outputs.len(),
                answers.len(),
                "a batch function must answer every input"
            );
            deliver(answers, outputs);
            let mut queue = self.lock();
            if queue.waiting.is_empty() {
                return;
            }
            batch = self.take(&mut queue);
        }
    }
}

/// An output and the way to its caller.
type Answered<O> = (oneshot::Sender<O>, O);

/// Hands each output to its caller. A caller waiting on this thread is woken directly. Callers waiting
/// on another thread, two or more to a thread, are woken by one task spawned on their runtime: waking
/// a task on another thread signals that thread, so their thread is signalled once per batch rather
/// than once per caller.
fn deliver<O: Send + 'static>(answers: Vec<(oneshot::Sender<O>, Option<Home>)>, outputs: Vec<O>) {
    let here = std::thread::current().id();
    let mut away: Vec<(Home, Vec<Answered<O>>)> = Vec::new();
    for ((answer, home), output) in answers.into_iter().zip(outputs) {
        match home {
            Some(home) if home.thread != here => {
                match away.iter_mut().find(|(other, _)| other.thread == home.thread) {
                    Some((_, group)) => group.push((answer, output)),
                    None => away.push((home, vec![(answer, output)])),
                }
            }
            _ => {
                let _ = answer.send(output);
            }
        }
    }
    for (home, group) in away {
        if let [_] = group.as_slice() {
            for (answer, output) in group {
                let _ = answer.send(output);
            }
            continue;
        }
        home.runtime.spawn(async move {
            for (answer, output) in group {
                let _ = answer.send(output);
            }
        });
    }
}

/// Gives a batch slot back when its driver ends, by returning or by unwinding; an unwinding driver also
/// starts a new one for anything still queued, so a panic in one batch never strands the others.
struct Slot<'a, I: Send + 'static, O: Send + 'static>(&'a Arc<Inner<I, O>>);

impl<I: Send + 'static, O: Send + 'static> Drop for Slot<'_, I, O> {
    fn drop(&mut self) {
        let mut queue = self.0.lock();
        if std::thread::panicking() && !queue.waiting.is_empty() {
            let batch = self.0.take(&mut queue);
            drop(queue);
            tokio::spawn(Arc::clone(self.0).drive(batch));
            return;
        }
        queue.in_flight -= 1;
    }
}

/// The error for an operation whose batch never answered.
pub(crate) fn unanswered() -> StoreError {
    StoreError::Backend("the operation's batch ended without an answer".into())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::Semaphore;

    use super::*;

    /// A batch function that records every batch's size as it starts, then doubles its inputs once `gate`
    /// lets it.
    fn doubling(
        max_batch: usize,
        max_in_flight: usize,
        gate: Arc<Semaphore>,
        sizes: Arc<Mutex<Vec<usize>>>,
    ) -> Coalescer<u32, u32> {
        Coalescer::new(max_batch, max_in_flight, move |items: Vec<u32>| {
            sizes.lock().unwrap().push(items.len());
            let gate = Arc::clone(&gate);
            Box::pin(async move {
                gate.acquire().await.expect("gate open").forget();
                items.into_iter().map(|n| n * 2).collect()
            }) as BatchFuture<u32>
        })
    }

    #[tokio::test]
    async fn a_lone_operation_runs_at_once_in_a_batch_of_one() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let coalescer = doubling(8, 1, Arc::new(Semaphore::new(100)), Arc::clone(&sizes));
        assert_eq!(coalescer.submit(21).await, Some(42));
        assert_eq!(*sizes.lock().unwrap(), vec![1]);
    }

    #[tokio::test]
    async fn operations_arriving_while_a_batch_runs_share_the_next_one_and_each_gets_its_own_answer() {
        let gate = Arc::new(Semaphore::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let coalescer = Arc::new(doubling(8, 1, Arc::clone(&gate), Arc::clone(&sizes)));
        let first = tokio::spawn({
            let coalescer = Arc::clone(&coalescer);
            async move { coalescer.submit(1).await }
        });
        // The first batch holds the only slot until the gate opens; 20 more queue behind it.
        while coalescer.inner.lock().in_flight == 0 {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = (2..=21)
            .map(|n| {
                let coalescer = Arc::clone(&coalescer);
                tokio::spawn(async move { (n, coalescer.submit(n).await) })
            })
            .collect();
        while coalescer.inner.lock().waiting.len() < 20 {
            tokio::task::yield_now().await;
        }
        gate.add_permits(100);
        assert_eq!(first.await.unwrap(), Some(2));
        for task in rest {
            let (n, answer) = task.await.unwrap();
            assert_eq!(answer, Some(n * 2));
        }
        // 1 alone, then the 20 queued in batches of at most 8.
        assert_eq!(*sizes.lock().unwrap(), vec![1, 8, 8, 4]);
        assert_eq!(coalescer.inner.lock().in_flight, 0);
    }

    #[tokio::test]
    async fn a_second_batch_starts_only_once_a_full_batch_is_waiting() {
        let gate = Arc::new(Semaphore::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let coalescer = Arc::new(doubling(4, 2, Arc::clone(&gate), Arc::clone(&sizes)));
        let submit = |n: u32| {
            let coalescer = Arc::clone(&coalescer);
            tokio::spawn(async move { coalescer.submit(n).await })
        };
        let in_flight = || coalescer.inner.lock().in_flight;
        let waiting = || coalescer.inner.lock().waiting.len();
        let mut tasks = vec![submit(0)];
        while in_flight() == 0 {
            tokio::task::yield_now().await;
        }
        // Three queue behind the running batch: less than a full batch, so no second one.
        tasks.extend((1..=3).map(submit));
        while waiting() < 3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 1);
        // The fourth makes a full batch waiting: it starts beside the first, with all four.
        tasks.push(submit(4));
        while waiting() > 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2);
        assert_eq!(*sizes.lock().unwrap(), vec![1, 4]);
        // With both slots taken, a full batch waiting starts nothing more.
        tasks.extend((5..=8).map(submit));
        while waiting() < 4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2);
        gate.add_permits(100);
        for (n, task) in tasks.into_iter().enumerate() {
            assert_eq!(task.await.unwrap(), Some(n as u32 * 2));
        }
        assert_eq!(in_flight(), 0);
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_does_not_stop_its_operation_or_the_others() {
        let gate = Arc::new(Semaphore::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let coalescer = Arc::new(doubling(8, 1, Arc::clone(&gate), Arc::clone(&sizes)));
        let abandoned = tokio::time::timeout(Duration::from_millis(10), coalescer.submit(1)).await;
        assert!(abandoned.is_err());
        let waiting = tokio::spawn({
            let coalescer = Arc::clone(&coalescer);
            async move { coalescer.submit(2).await }
        });
        gate.add_permits(100);
        assert_eq!(waiting.await.unwrap(), Some(4));
        assert_eq!(*sizes.lock().unwrap(), vec![1, 1]);
    }

    #[tokio::test]
    async fn a_panicking_batch_answers_none_and_later_operations_still_run() {
        let calls = Arc::new(AtomicUsize::new(0));
        let coalescer: Arc<Coalescer<u32, u32>> = Arc::new(Coalescer::new(8, 1, {
            let calls = Arc::clone(&calls);
            move |items: Vec<u32>| {
                let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                Box::pin(async move {
                    assert!(!first, "the first batch fails");
                    items
                }) as BatchFuture<u32>
            }
        }));
        assert_eq!(coalescer.submit(1).await, None);
        assert_eq!(coalescer.submit(2).await, Some(2));
        assert_eq!(coalescer.inner.lock().in_flight, 0);
    }

    /// As on the proxy's workers: the batch runs on one thread's runtime, and its callers wait on
    /// another's. Each still gets its own answer, handed over on its own runtime.
    #[test]
    fn callers_waiting_on_another_runtime_each_get_their_own_answer() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime")
        };
        let gate = Arc::new(Semaphore::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let coalescer = Arc::new(doubling(64, 1, Arc::clone(&gate), Arc::clone(&sizes)));
        let (finished, keep_running) = oneshot::channel::<()>();
        // The first operation starts the batch, so the batches run on this thread's runtime, which
        // stays up until the other thread's callers have their answers.
        let running = std::thread::spawn({
            let coalescer = Arc::clone(&coalescer);
            let runtime = runtime();
            move || {
                runtime.block_on(async move {
                    let first = coalescer.submit(1).await;
                    keep_running.await.expect("the test says when");
                    first
                })
            }
        });
        while coalescer.inner.lock().in_flight == 0 {
            std::thread::yield_now();
        }
        let waiting = std::thread::spawn({
            let coalescer = Arc::clone(&coalescer);
            let runtime = runtime();
            move || {
                runtime.block_on(async move {
                    let callers: Vec<_> = (2..=11)
                        .map(|n| {
                            let coalescer = Arc::clone(&coalescer);
                            tokio::spawn(async move { (n, coalescer.submit(n).await) })
                        })
                        .collect();
                    while coalescer.inner.lock().waiting.len() < 10 {
                        tokio::task::yield_now().await;
                    }
                    gate.add_permits(100);
                    let mut answers = Vec::new();
                    for caller in callers {
                        answers.push(caller.await.expect("the caller's task"));
                    }
                    answers
                })
            }
        });
        let answers = waiting.join().expect("the waiting thread");
        finished.send(()).expect("the running thread waits");
        assert_eq!(running.join().expect("the running thread"), Some(2));
        for (n, answer) in answers {
            assert_eq!(answer, Some(n * 2), "caller {n}");
        }
        assert_eq!(*sizes.lock().unwrap(), vec![1, 10]);
    }
}
