//! The proxy under test: its config, run in-process through `idemproxy::run` or as the real binary.

use std::{
    net::SocketAddr,
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    net::TcpListener,
    process::{Child, ChildStderr, Command},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;

use super::store::TestStore;

/// Bound on the proxy starting, becoming ready and exiting.
const START_BOUND: Duration = Duration::from_secs(30);

/// A proxy config as TOML: test defaults, then the test's own settings.
#[derive(Clone)]
pub struct ProxyConfig {
    table: toml::Table,
}

impl ProxyConfig {
    /// Defaults for tests: both listeners on 127.0.0.1:0, JSON logs, a small pool, and a 1 s bound
    /// on store operations so a cut store is noticed quickly.
    pub fn new(store_url: &str, upstream_url: &str) -> ProxyConfig {
        ProxyConfig {
            table: toml::Table::new(),
        }
        .set("server.listen", "127.0.0.1:0")
        .set("server.admin_listen", "127.0.0.1:0")
        .set("server.shutdown_grace", "10s")
        .set("upstream.url", upstream_url)
        .set("store.url", store_url)
        .set("store.pool_size", 4)
        .set("store.timeout", "1s")
        .set("log.format", "json")
        .set("log.filter", "info")
    }

    /// [`ProxyConfig::new`] on `store`, with the settings beyond its URL that it needs, in front of
    /// `upstream_url`: for a test whose upstream is not the stub.
    pub fn on(store: &TestStore, upstream_url: &str) -> ProxyConfig {
        ProxyConfig::new(&store.url(), upstream_url).with_toml(&store.store_toml())
    }

    /// Sets `section.key` (e.g. `"idempotency.lock_timeout"`) to `value`.
    pub fn set(mut self, path: &str, value: impl Into<toml::Value>) -> ProxyConfig {
        let (section, key) = path
            .split_once('.')
            .unwrap_or_else(|| panic!("config path {path:?} is not section.key"));
        let section = self
            .table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section) = section else {
            unreachable!("sections are tables")
        };
        section.insert(key.to_string(), value.into());
        self
    }

    /// Appends a `[[routes]]` entry, written as the TOML of its table (`name = "a"\npath = "/a"`).
    pub fn route(self, table: &str) -> ProxyConfig {
        self.with_toml(&format!("[[routes]]\n{table}"))
    }

    /// Lays raw TOML over the config, for what `set` cannot write (`[[routes]]`): arrays of tables are
    /// appended to any already there, tables are merged key by key, anything else replaces.
    pub fn with_toml(mut self, text: &str) -> ProxyConfig {
        let extra: toml::Table = text
            .parse()
            .unwrap_or_else(|e| panic!("test TOML does not parse: {e}\n{text}"));
        for (key, value) in extra {
            match (self.table.get_mut(&key), value) {
                (Some(toml::Value::Array(have)), toml::Value::Array(more)) => have.extend(more),
                (Some(toml::Value::Table(have)), toml::Value::Table(more)) => have.extend(more),
                (_, value) => {
                    self.table.insert(key, value);
                }
            }
        }
        self
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(&self.table).expect("test config renders as TOML")
    }

    fn config(&self) -> idemproxy::Config {
        let text = self.to_toml();
        idemproxy::Config::from_toml_str(&text)
            .unwrap_or_else(|e| panic!("test config rejected: {e}\n{text}"))
    }
}

/// The proxy running inside the test's runtime through `idemproxy::run`.
pub struct InProcessProxy {
    /// Base URL of the proxy listener, without a trailing slash.
    pub url: String,
    /// Base URL of the admin listener, without a trailing slash.
    pub admin_url: String,
    pub shutdown: CancellationToken,
    pub task: Option<JoinHandle<Result<(), idemproxy::RunError>>>,
}

impl InProcessProxy {
    /// Starts the proxy and waits until `/readyz` answers 200. Its logs go to the test's output.
    pub async fn start(config: &ProxyConfig) -> InProcessProxy {
        InProcessProxy::start_on(config, bind().await.into()).await
    }

    /// [`InProcessProxy::start`] with the proxy listening on `proxy`; `url` is `unix:<path>` for a unix
    /// socket.
    pub async fn start_on(config: &ProxyConfig, proxy: idemproxy::server::ProxySocket) -> InProcessProxy {
        init_tracing();
        let admin = bind().await;
        let local = proxy.local_addr().expect("proxy address");
        let url = if local.starts_with("unix:") {
            local
        } else {
            format!("http://{local}")
        };
        let admin_url = base_url(admin.local_addr().expect("admin address"));
        let listeners = idemproxy::Listeners { proxy, admin };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(idemproxy::run(config.config(), listeners, shutdown.clone()));
        let mut started = InProcessProxy {
            url,
            admin_url,
            shutdown,
            task: Some(task),
        };
        started.wait_ready().await;
        started
    }

    /// Cancels the shutdown token and waits (bounded) for `run` to return.
    pub async fn stop(mut self) -> Result<(), idemproxy::RunError> {
        self.shutdown.cancel();
        let task = self.task.take().expect("proxy task present until stopped");
        tokio::time::timeout(START_BOUND, task)
            .await
            .expect("proxy did not stop within the bound")
            .expect("proxy task panicked")
    }

    async fn wait_ready(&mut self) {
        let ready = async {
            while !is_ready(&self.admin_url).await {
                if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                    let task = self.task.take().expect("checked above");
                    panic!("proxy stopped while starting: {:?}", task.await);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(START_BOUND, ready).await.is_err() {
            panic!("in-process proxy not ready after {START_BOUND:?}");
        }
    }
}

impl Drop for InProcessProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The real `idemproxy serve` binary, run as a child process.
pub struct ProxyProcess {
    child: Child,
    /// Base URL of the proxy listener, without a trailing slash.
    pub url: String,
    /// Base URL of the admin listener, without a trailing slash.
    pub admin_url: String,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The config file the process reads; removed when the process handle is dropped.
    config_path: tempfile::TempPath,
}

impl ProxyProcess {
    /// Spawns `idemproxy serve --config <file>`, reads the listening addresses from its JSON log
    /// on stderr and waits until `/readyz` answers 200.
    pub async fn spawn(config: &ProxyConfig) -> ProxyProcess {
        let process = ProxyProcess::spawn_serving(config).await;
        process.wait_ready().await;
        process
    }

    /// [`ProxyProcess::spawn`] without waiting for `/readyz`: returns once both listeners are logged,
    /// for a proxy whose store is not there yet.
    pub async fn spawn_serving(config: &ProxyConfig) -> ProxyProcess {
        let config_path = write_config(config);
        let mut child = command(&config_path).spawn().expect("spawn the idemproxy binary");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let pipe = child.stderr.take().expect("stderr is piped");
        let addrs = tokio::time::timeout(START_BOUND, listening(pipe, stderr.clone())).await;
        let Ok(Some((proxy, admin))) = addrs else {
            let _ = child.start_kill();
            panic!(
                "idemproxy did not log both \"proxy listening\" and \"admin listening\" within \
                 {START_BOUND:?}; stderr:\n{}",
                stderr.lock().unwrap().join("\n")
            );
        };
        ProxyProcess {
            child,
            url: base_url(proxy),
            admin_url: base_url(admin),
            stderr,
            config_path,
        }
    }

    /// Whether the process is still running (it has not exited).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id, for sending signals.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("process still running")
    }

    /// Kills the process with SIGKILL and reaps it.
    pub async fn kill(&mut self) {
        self.child.start_kill().expect("send SIGKILL");
        self.wait().await;
    }

    /// Sends SIGTERM: the proxy should drain in-flight work and exit 0.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends SIGHUP: the proxy reads its configuration again.
    pub fn hangup(&self) {
        self.signal("HUP");
    }

    /// Sends the signal `name` (`TERM`, `HUP`) with `kill`.
    fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.pid().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("run kill -{name}: {e}"));
        assert!(status.success(), "kill -{name} failed: {status}");
    }

    /// The config file the process reads, for a test to rewrite before a SIGHUP.
    pub fn config_file(&self) -> &std::path::Path {
        &self.config_path
    }

    /// Waits (bounded) for the process to exit.
    pub async fn wait(&mut self) -> ExitStatus {
        match tokio::time::timeout(START_BOUND, self.child.wait()).await {
            Ok(status) => status.expect("wait for idemproxy"),
            Err(_) => panic!(
                "idemproxy did not exit within {START_BOUND:?}; stderr:\n{}",
                self.stderr()
            ),
        }
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    async fn wait_ready(&self) {
        let ready = async {
            while !is_ready(&self.admin_url).await {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(START_BOUND, ready).await.is_err() {
            panic!(
                "idemproxy not ready after {START_BOUND:?}; stderr:\n{}",
                self.stderr()
            );
        }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("idemproxy {} stderr:\n{}", self.url, self.stderr());
        }
        let _ = self.child.start_kill();
    }
}

fn command(config_path: &std::path::Path) -> Command {
    let mut command = binary();
    command
        .arg("serve")
        .arg("--config")
        .arg(config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Starts `idemproxy demo-upstream` on a free port; the child (killed on drop) and its base URL, from the line it prints.
pub async fn demo_upstream() -> (tokio::process::Child, String) {
    let mut child = binary()
        .args(["demo-upstream", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start idemproxy demo-upstream");
    let stderr = child.stderr.take().expect("its stderr");
    let mut lines = BufReader::new(stderr).lines();
    let line = lines
        .next_line()
        .await
        .expect("read stderr")
        .expect("a first line");
    let url = line
        .strip_prefix("demo upstream listening on ")
        .unwrap_or_else(|| panic!("not the listening line: {line}"))
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
}

/// The binary, run without the test process's `RUST_LOG` and `IDEMPROXY_*` variables (the binary reads
/// every `IDEMPROXY_` variable as config, `IDEMPROXY_TEST_CITUS_URL` included): it sees only what the
/// test gives it.
pub fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemproxy"));
    without_test_env(&mut command);
    command
}

/// `command` without the test process's `RUST_LOG` and `IDEMPROXY_*` variables, for a program that runs
/// the binary itself (`script` giving it a terminal).
pub fn without_test_env(command: &mut Command) -> &mut Command {
    command.env_remove("RUST_LOG");
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("IDEMPROXY_")) {
        command.env_remove(name);
    }
    command
}

/// The config as a temporary TOML file, removed when the returned path is dropped.
fn write_config(config: &ProxyConfig) -> tempfile::TempPath {
    let mut file = tempfile::Builder::new()
        .prefix("idemproxy-test-")
        .suffix(".toml")
        .tempfile()
        .expect("create the test config file");
    std::io::Write::write_all(&mut file, config.to_toml().as_bytes()).expect("write the test config file");
    file.into_temp_path()
}

/// Reads JSON log lines until both listening addresses are known, then keeps draining the pipe
/// in the background so the process never blocks on a full stderr.
async fn listening(pipe: ChildStderr, seen: Arc<Mutex<Vec<String>>>) -> Option<(SocketAddr, SocketAddr)> {
    let mut lines = BufReader::new(pipe).lines();
    let (mut proxy, mut admin) = (None, None);
    while proxy.is_none() || admin.is_none() {
        let line = lines.next_line().await.ok()??;
        match listening_addr(&line) {
            Some(("proxy listening", addr)) => proxy = Some(addr),
            Some(("admin listening", addr)) => admin = Some(addr),
            _ => {}
        }
        seen.lock().unwrap().push(line);
    }
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.lock().unwrap().push(line);
        }
    });
    Some((proxy?, admin?))
}

/// A listening address from a JSON log line, or from a text one (`log.format = "text"`).
fn listening_addr(line: &str) -> Option<(&'static str, SocketAddr)> {
    let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
        return listening_addr_in_text(line);
    };
    let message = match event.get("message")?.as_str()? {
        "proxy listening" => "proxy listening",
        "admin listening" => "admin listening",
        _ => return None,
    };
    let addr = event.get("addr")?.as_str()?.parse().ok()?;
    Some((message, addr))
}

fn listening_addr_in_text(line: &str) -> Option<(&'static str, SocketAddr)> {
    let line = strip_ansi(line);
    let message = ["proxy listening", "admin listening"]
        .into_iter()
        .find(|m| line.contains(&format!(": {m} ")))?;
    let addr = line.split(' ').find_map(|field| field.strip_prefix("addr="))?;
    Some((message, addr.parse().ok()?))
}

/// The line without its ANSI colour sequences (`ESC [ ... m`).
pub fn strip_ansi(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            plain.push(c);
        }
    }
    plain
}

/// Sends in-process logs (`RUST_LOG`, else `info`) to the test's captured output.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0")
}

fn base_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

async fn is_ready(admin_url: &str) -> bool {
    let response = super::http::client()
        .get(format!("{admin_url}/readyz"))
        .send()
        .await;
    response.is_ok_and(|r| r.status() == 200)
}
