//! The frameworks: one line each (name, how it starts, the upstream protocols it speaks). Each app has the
//! same routes in its own terms (`POST /payments`, `POST /webhooks/stripe`, a catch-all; see the apps in
//! `apps/`), listens on 127.0.0.1:0, says its ports as a first JSON line (`{"listen":{"http1":..}}`), then
//! reports every handler execution as a JSON line on stdout, once the request's body has ended or
//! failed: the handler, the method and target as the framework read them, the headers and the trailers.
//! The hyper app runs in the test's runtime and reports into the same [`Ledger`].

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Notify;

use super::hyper_app;
use Protocol::{H2c, Http1};

/// An upstream protocol, as `upstream.protocol` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Http1,
    H2c,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Http1 => "http1",
            H2c => "h2c",
        }
    }
}

/// The ports an app listens on, one per protocol it speaks.
pub type Ports = Vec<(Protocol, u16)>;

/// How an app starts.
pub enum Launch {
    /// A program, built or installed first if need be (blocking; run off the runtime).
    Program(fn() -> std::process::Command),
    /// In the test's runtime: starts serving, reporting into the ledger, and returns its ports.
    InProcess(fn(Ledger) -> BoxFuture<'static, Ports>),
}

pub struct Framework {
    pub name: &'static str,
    pub launch: Launch,
    pub protocols: &'static [Protocol],
}

#[rustfmt::skip]
pub const FRAMEWORKS: &[Framework] = &[
    Framework { name: "flask", launch: Launch::Program(flask), protocols: &[Http1] },
    Framework { name: "go", launch: Launch::Program(go), protocols: &[Http1, H2c] },
    Framework { name: "node", launch: Launch::Program(node), protocols: &[Http1, H2c] },
    Framework { name: "hyper", launch: Launch::InProcess(hyper_app::serve), protocols: &[Http1, H2c] },
];

/// The apps' sources, and the Flask app's pinned requirements.
const APPS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/attacks/differential/apps");

/// Bound on an app starting (a first run installs Flask from PyPI first, off this bound).
const START_BOUND: Duration = Duration::from_secs(60);

fn flask() -> std::process::Command {
    let requirements = PathBuf::from(format!("{APPS}/requirements.txt"));
    let python = crate::support::tools::python_venv("flask", &requirements);
    let mut command = std::process::Command::new(python);
    command.arg(format!("{APPS}/flask_app.py"));
    command
}

/// Go's h2c is in golang.org/x/net, which Debian packages (golang-golang-x-net-dev) for GOPATH builds;
/// no module proxy is needed.
const GOPATH: &str = "/usr/share/gocode";

fn go() -> std::process::Command {
    assert!(
        Path::new(GOPATH).join("src/golang.org/x/net/http2/h2c").is_dir(),
        "the Go app needs golang.org/x/net in {GOPATH}: apt-get install golang-golang-x-net-dev"
    );
    let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-tools");
    let binary = tools.join("differential-go/app");
    let status = std::process::Command::new("go")
        .args(["build", "-o"])
        .arg(&binary)
        .arg(format!("{APPS}/go_app.go"))
        .env("GO111MODULE", "off")
        .env("GOPATH", GOPATH)
        .env("GOCACHE", tools.join("go-cache"))
        .status()
        .expect("the go command runs (Debian's golang-go)");
    assert!(status.success(), "go build of the Go app: {status}");
    std::process::Command::new(binary)
}

fn node() -> std::process::Command {
    let mut command = std::process::Command::new("node");
    command.arg(format!("{APPS}/node_app.js"));
    command
}

/// One handler execution, as the app reported it.
#[derive(Clone, Debug, Deserialize)]
pub struct Execution {
    pub handler: String,
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub trailers: Vec<(String, String)>,
    pub body_error: Option<String>,
}

impl Execution {
    /// Every value of header `name` (lower case) it saw.
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The case id it carried (`x-diff-case`).
    pub fn case(&self) -> Option<&str> {
        self.values("x-diff-case").first().copied()
    }
}

/// Every execution an app reported, and a signal for each new one.
#[derive(Clone, Default)]
pub struct Ledger {
    executions: Arc<Mutex<Vec<Execution>>>,
    added: Arc<Notify>,
}

impl Ledger {
    pub fn push(&self, execution: Execution) {
        self.executions.lock().unwrap().push(execution);
        self.added.notify_waiters();
    }

    /// The executions that carried the case id `id`.
    pub fn of(&self, id: &str) -> Vec<Execution> {
        let executions = self.executions.lock().unwrap();
        executions
            .iter()
            .filter(|e| e.case() == Some(id))
            .cloned()
            .collect()
    }

    /// The executions of case `id`, waiting (bounded) for a first one to be reported.
    pub async fn await_of(&self, id: &str, bound: Duration) -> Vec<Execution> {
        let waiting = async {
            loop {
                let added = self.added.notified();
                let found = self.of(id);
                if !found.is_empty() {
                    return found;
                }
                added.await;
            }
        };
        tokio::time::timeout(bound, waiting).await.unwrap_or_default()
    }

    /// Executions whose case id is not one of `known`.
    pub fn unclaimed(&self, known: &dyn Fn(&str) -> bool) -> Vec<Execution> {
        let executions = self.executions.lock().unwrap();
        executions
            .iter()
            .filter(|e| !e.case().is_some_and(known))
            .cloned()
            .collect()
    }
}

/// An app serving, and what it reported.
pub struct Running {
    pub name: &'static str,
    pub ports: Ports,
    pub ledger: Ledger,
    _child: Option<Child>,
}

impl Running {
    /// The app's URL for `protocol`.
    pub fn url(&self, protocol: Protocol) -> String {
        let (_, port) = self
            .ports
            .iter()
            .find(|(p, _)| *p == protocol)
            .expect("the app speaks it");
        format!("http://127.0.0.1:{port}")
    }
}

/// Starts `framework`'s app and waits for its ports.
pub async fn start(framework: &'static Framework) -> Running {
    let ledger = Ledger::default();
    let (ports, child) = match framework.launch {
        Launch::InProcess(serve) => (serve(ledger.clone()).await, None),
        Launch::Program(prepare) => {
            let command = tokio::task::spawn_blocking(prepare)
                .await
                .expect("the app builds");
            let (ports, child) = spawn(framework.name, command, ledger.clone()).await;
            (ports, Some(child))
        }
    };
    Running {
        name: framework.name,
        ports,
        ledger,
        _child: child,
    }
}

#[derive(Deserialize)]
struct Listening {
    listen: std::collections::HashMap<Protocol, u16>,
}

/// Runs `command`, reads its ports from its first line, and its executions from the rest into `ledger`.
async fn spawn(name: &str, command: std::process::Command, ledger: Ledger) -> (Ports, Child) {
    let mut child = Command::from(command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("the {name} app does not start: {e}"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(START_BOUND, lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("the {name} app said no ports within {START_BOUND:?}"))
        .unwrap_or_default()
        .unwrap_or_default();
    let listening: Listening = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("the {name} app's first line is its ports ({e}): {first:?}"));
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let execution = serde_json::from_str(&line).unwrap_or_else(|e| Execution {
                handler: format!("(a line the harness cannot read: {e})"),
                method: String::new(),
                target: line,
                headers: Vec::new(),
                trailers: Vec::new(),
                body_error: None,
            });
            ledger.push(execution);
        }
    });
    (listening.listen.into_iter().collect(), child)
}
