//! What every stage answers a request with: [`Handled`], the response and how the request ended (or the
//! error the spine turns into a problem), and [`Answer`], where a keyed request's answer goes from the
//! task that claims and executes it. A leaf: it knows the response body, the errors and the metrics only.

use std::sync::Arc;

use http::Response;
use tokio::sync::oneshot;

use crate::body::ProxyBody;
use crate::error::ProxyError;
use crate::metrics::{Outcome, RouteSeries};

/// A request's answer: the response and its outcome, or the error to answer with.
pub(crate) type Handled = Result<(Response<ProxyBody>, Outcome), ProxyError>;

/// Where a keyed request's answer goes. The spine counts every outcome, unless the client hung up and
/// took the spine's future with it; such answers are counted here instead, so executions are never
/// missing from `idemproxy_requests_total`.
pub(crate) struct Answer {
    head: oneshot::Sender<Handled>,
    series: Arc<RouteSeries>,
}

impl Answer {
    /// An answer for the request whose route counts in `series`, and where the client receives it.
    pub(crate) fn new(series: Arc<RouteSeries>) -> (Answer, oneshot::Receiver<Handled>) {
        let (head, response) = oneshot::channel();
        (Answer { head, series }, response)
    }

    /// Hands the answer to the client; `false` when the client has gone.
    pub(crate) fn send(self, answer: Handled) -> bool {
        let outcome = match &answer {
            Ok((_, outcome)) => *outcome,
            Err(error) => error.outcome(),
        };
        let delivered = self.head.send(answer).is_ok();
        if !delivered {
            self.series.record(outcome);
        }
        delivered
    }

    /// Returns once the client has gone (its request's handler was dropped).
    pub(crate) async fn closed(&mut self) {
        self.head.closed().await;
    }
}
