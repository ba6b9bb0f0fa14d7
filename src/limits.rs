//! The open-files limit (`RLIMIT_NOFILE`), once as `serve` starts (`lib.rs`): raises the soft limit to
//! the hard one, as Caddy and oauth2-proxy do, works out how many files and sockets the settings may hold
//! open at once ([`Need`]), logs both, warns once when even the hard limit is below that need, and sets
//! the `idemproxy_open_files_*` gauges. Touches only the process's limit and those gauges; the formula is
//! in docs/operations.md, "Open files".

use crate::config::{Config, StoreBackend};
use crate::metrics::Metrics;

/// Connections to the admin listener counted in the need: it has no cap of its own, and is reached by
/// a few scrapers and probes at a time.
const ADMIN_CONNECTIONS: u64 = 8;

/// Descriptors held whatever the traffic: the two listeners, the log, the store's file or its
/// `LISTEN` connection, TLS and key-set files being read, the trace exporter's and the key-set
/// fetcher's connections, DNS lookups.
const SPARE: u64 = 64;

/// Descriptors each worker's runtime holds for itself (its epoll instance and its waker).
const PER_WORKER: u64 = 2;

/// How many files and sockets the settings may hold open at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// Client connections (`server.max_connections`).
    clients: u64,
    /// Upstream connections per worker (`upstream.max_connections`), each worker having its own pool.
    upstream: u64,
    /// Worker threads (`server.workers`).
    workers: u64,
    /// The store's pooled connections (`store.pool_size`; none for Redis, which multiplexes one
    /// connection per node, counted in [`SPARE`]).
    store: u64,
}

impl Need {
    /// What `config` may hold open.
    pub fn of(config: &Config) -> Need {
        let store = match config.store.backend {
            StoreBackend::Redis(_) => 0,
            _ => config.store.pool_size,
        };
        Need {
            clients: count(config.server.max_connections),
            upstream: count(config.upstream.max_connections),
            workers: count(config.server.workers),
            store: count(store),
        }
    }

    /// The need, in descriptors.
    pub fn total(&self) -> u64 {
        let upstream = self.upstream.saturating_mul(self.workers);
        let spare = SPARE.saturating_add(PER_WORKER.saturating_mul(self.workers));
        [self.clients, ADMIN_CONNECTIONS, upstream, self.store, spare]
            .into_iter()
            .fold(0, u64::saturating_add)
    }

    /// The sum, naming the settings it comes from.
    fn settings(&self) -> String {
        format!(
            "server.max_connections {} + {ADMIN_CONNECTIONS} admin + upstream.max_connections {} × \
             server.workers {} + store.pool_size {} + {SPARE} spare + {PER_WORKER} per worker",
            self.clients, self.upstream, self.workers, self.store
        )
    }
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Raises the soft open-files limit to the hard one, logs the limits and what `config` needs, warns
/// once when the limit is below that, and sets the gauges in `metrics`.
pub fn apply(config: &Config, metrics: &Metrics) {
    let need = Need::of(config);
    metrics.open_files_needed.set(gauge(need.total()));
    let Some(limit) = raise() else { return };
    metrics.open_files_limit.set(gauge(limit));
    if limit < need.total() {
        warn(limit, &need);
    }
}

/// After a reload (`reload.rs`): what the configuration in force needs, against the limit the process
/// has, with the same gauge and warning as at start (a reload may have grown `upstream.max_connections`).
pub fn reassess(config: &Config, metrics: &Metrics) {
    let need = Need::of(config);
    metrics.open_files_needed.set(gauge(need.total()));
    if let Ok((limit, _)) = rlimit::getrlimit(rlimit::Resource::NOFILE)
        && limit < need.total()
    {
        warn(limit, &need);
    }
}

/// Raises the soft limit as far as the hard one; the soft limit in force after, if it could be read.
fn raise() -> Option<u64> {
    let (before, hard) = match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok(limits) => limits,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open files limit (RLIMIT_NOFILE)");
            return None;
        }
    };
    let after = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(after) => after,
        Err(error) => {
            tracing::warn!(%error, soft = before, hard, "cannot raise the open files limit");
            before
        }
    };
    tracing::info!(
        before,
        after,
        hard,
        "open files limit (RLIMIT_NOFILE) soft limit raised to the hard limit"
    );
    Some(after)
}

fn warn(limit: u64, need: &Need) {
    let total = need.total();
    tracing::warn!(
        limit,
        needed = total,
        "the open files limit {limit} is below the {total} this configuration may hold open ({}); \
         past the limit new connections fail: raise the hard limit (`ulimit -n {total}` before starting, \
         `LimitNOFILE={total}` in the systemd unit, `--ulimit nofile={total}:{total}` for docker or podman, \
         or the container runtime's own LimitNOFILE for Kubernetes), or lower those settings",
        need.settings()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_need_adds_clients_admin_each_worker_s_upstream_pool_the_store_and_a_margin() {
        let config = Config::from_toml_str(
            "[server]\nmax_connections = 100\nworkers = 3\n[upstream]\nmax_connections = 40\n\
             [store]\nurl = \"postgres://db/idem\"\npool_size = 20\n",
        )
        .unwrap();
        let need = Need::of(&config);
        assert_eq!(need.total(), 100 + 8 + 40 * 3 + 20 + 64 + 2 * 3);
        let settings = need.settings();
        for named in [
            "server.max_connections 100",
            "upstream.max_connections 40",
            "server.workers 3",
        ] {
            assert!(settings.contains(named), "{settings}");
        }
    }

    #[test]
    fn the_defaults_need_about_two_thousand_files() {
        // SQLite, the default store, keeps one connection.
        let config = Config::from_toml_str("[server]\nworkers = 2\n").unwrap();
        assert_eq!(Need::of(&config).total(), 1024 + 8 + 512 * 2 + 1 + 64 + 4);
    }

    #[test]
    fn a_redis_store_pools_nothing() {
        let config =
            Config::from_toml_str("[server]\nworkers = 1\n[store]\nurl = \"redis://r:6379\"\n").unwrap();
        assert_eq!(Need::of(&config).store, 0);
    }
}
