//! The request path each worker thread serves with: one [`Proxy`] per worker (so each keeps its own
//! upstream connections), replaced whole when a reload (`reload.rs`) installs a new generation. A request
//! takes its worker's proxy as it arrives and keeps it to its end, so a request in flight finishes under
//! the configuration it started with while the next one is served under the new. Touches only the
//! proxies it holds.

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::proxy::Proxy;

/// Each worker's current request path.
pub struct Generations {
    workers: Box<[ArcSwap<Proxy>]>,
}

impl Generations {
    /// `workers` copies of `proxy`, each with its own upstream connections.
    pub fn new(proxy: &Proxy, workers: usize) -> Arc<Generations> {
        let workers = (0..workers.max(1))
            .map(|_| ArcSwap::from_pointee(proxy.for_worker()))
            .collect();
        Arc::new(Generations { workers })
    }

    /// Gives every worker its copy of `proxy`: a request that arrives from now on is served by it. The
    /// generation each request in flight holds lives until that request ends.
    pub fn install(&self, proxy: &Proxy) {
        for worker in self.workers.iter() {
            worker.store(Arc::new(proxy.for_worker()));
        }
    }

    /// Worker `index`'s request path now.
    pub fn worker(&self, index: usize) -> Arc<Proxy> {
        self.workers[index % self.workers.len()].load_full()
    }

    /// How many workers there are.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Never: there is a worker at least.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}
