//! A throwaway PostgreSQL cluster owned by one test, so the test can crash and restart the database
//! itself: `initdb` into a temporary directory, a free port on 127.0.0.1, stopped and removed on drop.
//!
//! The server binaries are found on `PATH`, else in the newest `/usr/lib/postgresql/<n>/bin` (Debian's
//! layout), else in `/usr/local/bin` or `/usr/local/pgsql/bin` (a build from source). PostgreSQL refuses to run as root, so when the tests run as root the cluster runs as the
//! `postgres` OS user through `runuser`.

use std::{
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

use tokio::process::Command;

const HOW_TO: &str = "tests that restart PostgreSQL need its server binaries (initdb, pg_ctl): \
    install the postgresql package";

/// Bound on starting or restarting the cluster.
const START_BOUND: Duration = Duration::from_secs(60);

/// A running cluster; dropped, it is stopped at once and its directory removed.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl Cluster {
    /// Creates and starts a cluster that trusts local connections as user `postgres`.
    pub async fn start() -> Cluster {
        let bin = server_bin_dir().unwrap_or_else(|| panic!("no initdb found; {HOW_TO}"));
        let as_postgres = running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pg-")
            .tempdir()
            .expect("create the cluster directory");
        let cluster = Cluster {
            dir,
            bin,
            port: free_port(),
            as_postgres,
        };
        if as_postgres {
            cluster.run("chown", &["postgres:", &cluster.path()], false).await;
        }
        let data = cluster.data_dir();
        let initdb = cluster.bin.join("initdb");
        let initdb = initdb.to_string_lossy();
        let args = [
            "-D",
            &data,
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
        ];
        cluster.run(&initdb, &args, true).await;
        cluster.pg_ctl(&["start"]).await;
        cluster
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `127.0.0.1:<port>`, for a relay to forward to.
    pub fn server_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Crashes the server (immediate shutdown: no checkpoint, every connection dropped) and starts it
    /// again; returns once it accepts connections, after crash recovery.
    pub async fn crash_restart(&self) {
        self.pg_ctl(&["restart", "-m", "immediate"]).await;
    }

    /// Stops the server at once (immediate shutdown).
    pub async fn stop(&self) {
        self.pg_ctl(&["stop", "-m", "immediate"]).await;
    }

    /// Starts a stopped server and waits until it accepts connections.
    pub async fn start_again(&self) {
        self.pg_ctl(&["start"]).await;
    }

    /// A client connected to the cluster's `postgres` database.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect to the throwaway cluster: {e}"));
        tokio::spawn(connection);
        client
    }

    fn path(&self) -> String {
        self.dir.path().to_string_lossy().into_owned()
    }

    fn data_dir(&self) -> String {
        format!("{}/data", self.path())
    }

    async fn pg_ctl(&self, action: &[&str]) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60 \
             -c shared_buffers=16MB",
            self.port,
            self.path()
        );
        let log = format!("{}/server.log", self.path());
        let data = self.data_dir();
        let mut args = vec!["-D", &data, "-l", &log, "-w", "-t", "60", "-o", &options];
        args.extend_from_slice(action);
        let pg_ctl = self.bin.join("pg_ctl");
        let output = self.run(&pg_ctl.to_string_lossy(), &args, true).await;
        if !output.status.success() {
            let server_log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("pg_ctl {action:?} failed; server log:\n{server_log}");
        }
    }

    /// Runs a command, as `postgres` when `as_postgres` and the tests run as root; panics when it fails.
    async fn run(&self, program: &str, args: &[&str], as_postgres: bool) -> Output {
        let mut command = if as_postgres && self.as_postgres {
            let mut runuser = Command::new("runuser");
            runuser.args(["-u", "postgres", "--", program]);
            runuser
        } else {
            Command::new(program)
        };
        command.args(args).current_dir(self.dir.path()).kill_on_drop(true);
        let output = tokio::time::timeout(START_BOUND, command.output())
            .await
            .unwrap_or_else(|_| panic!("{program} {args:?} did not finish within {START_BOUND:?}"))
            .unwrap_or_else(|e| panic!("run {program}: {e}; {HOW_TO}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pg_ctl = self.bin.join("pg_ctl");
        let data = self.data_dir();
        let mut command = if self.as_postgres {
            let mut runuser = std::process::Command::new("runuser");
            runuser.args(["-u", "postgres", "--"]).arg(&pg_ctl);
            runuser
        } else {
            std::process::Command::new(&pg_ctl)
        };
        let _ = command
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Where `initdb` and `pg_ctl` are (see the module's header), if anywhere.
pub fn server_bin_dir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    let on_path =
        std::env::var_os("PATH").and_then(|path| std::env::split_paths(&path).find(|dir| has_both(dir)));
    on_path.or_else(newest_debian_bin_dir).or_else(|| {
        ["/usr/local/bin", "/usr/local/pgsql/bin"]
            .map(PathBuf::from)
            .into_iter()
            .find(|dir| has_both(dir))
    })
}

fn newest_debian_bin_dir() -> Option<PathBuf> {
    let versions = std::fs::read_dir("/usr/lib/postgresql").ok()?;
    versions
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            Path::new(&bin).join("initdb").is_file().then_some((version, bin))
        })
        .max_by_key(|(version, _)| *version)
        .map(|(_, bin)| bin)
}

/// Whether the tests run as root (`id -u` says 0); blocking, briefly.
pub fn running_as_root() -> bool {
    let output = std::process::Command::new("id")
        .arg("-u")
        .output()
        .expect("run id -u");
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local address").port()
}
