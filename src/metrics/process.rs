//! The standard `process_*` families (CPU, memory, file descriptors, threads, start time), under the names
//! every Prometheus client library exports, read from `/proc/self` at each scrape of `/metrics` and never
//! on a request's path. Registered by `metrics.rs`; touches only `/proc`.
//!
//! Read here rather than through the `prometheus` crate's `process` feature: that feature adds `procfs`
//! (two crates over `rustix`) and reports CPU time in whole seconds (an integer counter), which makes
//! `rate(process_cpu_seconds_total[1m])` of a sidecar using a fraction of a core jump between 0 and 1/60.
//! Here CPU time keeps the kernel's clock ticks (10 ms), and the clock tick and page size come from
//! `rustix` (safe `sysconf`), the one dependency. On a system without `/proc` the families are absent.

use std::fs;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntGauge, Registry};

/// Registers the process collector in `registry`.
pub(super) fn register(registry: &Registry) {
    let collector = ProcessCollector::new();
    registry
        .register(Box::new(collector))
        .expect("process metric names are unique");
}

/// The process's figures, refreshed from `/proc/self` when gathered.
struct ProcessCollector {
    cpu: Counter,
    resident: IntGauge,
    virtual_memory: IntGauge,
    open_fds: IntGauge,
    max_fds: IntGauge,
    threads: IntGauge,
    start_time: Gauge,
    descs: Vec<Desc>,
    ticks_per_second: f64,
    page_size: i64,
}

impl ProcessCollector {
    fn new() -> ProcessCollector {
        let int_gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("valid metric");
        let collector = ProcessCollector {
            cpu: Counter::new(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
            )
            .expect("valid metric"),
            resident: int_gauge("process_resident_memory_bytes", "Resident memory size in bytes."),
            virtual_memory: int_gauge("process_virtual_memory_bytes", "Virtual memory size in bytes."),
            open_fds: int_gauge("process_open_fds", "Number of open file descriptors."),
            max_fds: int_gauge("process_max_fds", "Maximum number of open file descriptors."),
            threads: int_gauge("process_threads", "Number of OS threads in the process."),
            start_time: Gauge::new(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
            )
            .expect("valid metric"),
            descs: Vec::new(),
            ticks_per_second: rustix::param::clock_ticks_per_second() as f64,
            page_size: i64::try_from(rustix::param::page_size()).unwrap_or(4096),
        };
        if let Some(started) = collector.started() {
            collector.start_time.set(started);
        }
        let descs = collector
            .parts()
            .iter()
            .flat_map(|part| part.desc().into_iter().cloned())
            .collect();
        ProcessCollector { descs, ..collector }
    }

    fn parts(&self) -> [&dyn Collector; 7] {
        [
            &self.cpu,
            &self.resident,
            &self.virtual_memory,
            &self.open_fds,
            &self.max_fds,
            &self.threads,
            &self.start_time,
        ]
    }

    /// When the process started, in seconds since the epoch: the boot time plus the start's clock tick.
    fn started(&self) -> Option<f64> {
        let stat = Stat::read()?;
        let boot = fs::read_to_string("/proc/stat").ok()?;
        let boot: f64 = boot
            .lines()
            .find_map(|line| line.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        Some(boot + stat.start_ticks as f64 / self.ticks_per_second)
    }

    fn refresh(&self) -> Option<()> {
        let stat = Stat::read()?;
        let cpu = (stat.user_ticks + stat.system_ticks) as f64 / self.ticks_per_second;
        // Two scrapes at once may both add: each adds only what the counter lacks.
        let lacking = cpu - self.cpu.get();
        if lacking > 0.0 {
            self.cpu.inc_by(lacking);
        }
        self.resident
            .set(stat.resident_pages.saturating_mul(self.page_size));
        self.virtual_memory.set(stat.virtual_bytes);
        self.threads.set(stat.threads);
        if let Ok(fds) = fs::read_dir("/proc/self/fd") {
            self.open_fds.set(i64::try_from(fds.count()).unwrap_or(i64::MAX));
        }
        if let Some(max) = max_open_files() {
            self.max_fds.set(max);
        }
        Some(())
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        if self.refresh().is_none() {
            return Vec::new();
        }
        self.parts().iter().flat_map(|part| part.collect()).collect()
    }
}

/// The fields of `/proc/self/stat` read here (proc(5)).
struct Stat {
    user_ticks: u64,
    system_ticks: u64,
    threads: i64,
    start_ticks: u64,
    virtual_bytes: i64,
    resident_pages: i64,
}

impl Stat {
    fn read() -> Option<Stat> {
        Stat::parse(&fs::read_to_string("/proc/self/stat").ok()?)
    }

    /// The fields after the command name, which is in parentheses and may itself hold spaces and `)`.
    fn parse(text: &str) -> Option<Stat> {
        let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
        // proc(5) numbers the fields from 1 with the pid; the list starts at field 3 (state).
        let field = |number: usize| fields.get(number - 3).copied();
        Some(Stat {
            user_ticks: field(14)?.parse().ok()?,
            system_ticks: field(15)?.parse().ok()?,
            threads: field(20)?.parse().ok()?,
            start_ticks: field(22)?.parse().ok()?,
            virtual_bytes: field(23)?.parse().ok()?,
            resident_pages: field(24)?.parse().ok()?,
        })
    }
}

/// The soft limit on open files, from `/proc/self/limits`; `None` when unlimited.
fn max_open_files() -> Option<i64> {
    let limits = fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|line| line.starts_with("Max open files"))?;
    line.strip_prefix("Max open files")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (idem (proxy) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 9 0 \
                    123456 104857600 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        let stat = Stat::parse(line).expect("parsed");
        assert_eq!((stat.user_ticks, stat.system_ticks), (250, 75));
        assert_eq!(stat.threads, 9);
        assert_eq!(stat.start_ticks, 123456);
        assert_eq!(stat.virtual_bytes, 104857600);
        assert_eq!(stat.resident_pages, 2560);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_reports_its_own_figures() {
        let registry = Registry::new();
        register(&registry);
        let families = registry.gather();
        let value = |name: &str| {
            let family = families.iter().find(|f| f.name() == name).expect(name);
            let series = &family.get_metric()[0];
            if name.ends_with("_total") {
                series.get_counter().get_value()
            } else {
                series.get_gauge().get_value()
            }
        };
        assert!(value("process_resident_memory_bytes") > 1_000_000.0);
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_threads") >= 1.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 3600.0,
            "{started} vs {now}"
        );
        assert!(value("process_cpu_seconds_total") >= 0.0);
    }
}
