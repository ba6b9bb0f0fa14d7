//! A fresh PostgreSQL database per test, dropped when the test ends, on the server the test process
//! found once: `DATABASE_URL` when set; else the server answering on 127.0.0.1:5432
//! (`postgres://postgres@localhost:5432/postgres`); else one this process starts for itself from the
//! installed server binaries (`initdb`, `pg_ctl`, found as [`super::cluster`] finds them), shared by
//! every test of the process: a temporary directory, a free loopback port, `max_connections` 300, TLS on
//! with a self-signed certificate for `localhost`. `IDEMPROXY_TEST_PG=own` starts that server even when
//! 5432 answers (a machine whose server is busy or short of connections). Like the Redis servers of
//! [`super::redis`], it runs under a small shell that stops it and removes its directory when this
//! process goes away (its stdin closes), so it never outlives the tests, even when they are killed.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use url::Url;

const DEFAULT_URL: &str = "postgres://postgres@localhost:5432/postgres";
const HOW_TO: &str = "integration tests need PostgreSQL: set DATABASE_URL=postgres://user@host:port/db, \
    start PostgreSQL on localhost:5432, or install its server binaries (initdb, pg_ctl) so the tests \
    start their own (docs/development.md, Prerequisites)";

/// Set to `own`, the tests start their own server even when one answers on 127.0.0.1:5432.
pub const OWN_SERVER: &str = "IDEMPROXY_TEST_PG";

/// The connection limit of the server the tests start: the suite's tests run side by side, each with a
/// proxy's pool or two and its own clients.
const OWN_MAX_CONNECTIONS: u32 = 300;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A database that exists for one test. Dropping it drops the database (WITH (FORCE)).
pub struct TestDb {
    name: String,
    admin_url: Url,
}

/// Inserts `key`'s record (processing, for the test credential's scope) in a transaction left open, so
/// that a claim of the key waits on the row until the transaction ends.
pub async fn hold_key_row<'a>(
    client: &'a mut tokio_postgres::Client,
    key: &str,
) -> tokio_postgres::Transaction<'a> {
    let scope = super::history::scope_of(super::http::TEST_CREDENTIAL);
    let blocking = client.transaction().await.expect("begin");
    blocking
        .execute(
            "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                 locked_until, created_at, expires_at, updated_at)
             VALUES ($1, $2, '\\x00', 'processing', gen_random_uuid(), 1, 'new', now(), now(),
                 now() + interval '1 day', now())",
            &[&scope, &key],
        )
        .await
        .expect("insert the held row");
    blocking
}

impl TestDb {
    /// Creates a database with a unique name on the server named by `DATABASE_URL`.
    pub async fn create() -> TestDb {
        let admin_url = base_url();
        let name = unique_name();
        let client = connect(&admin_url).await;
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));
        TestDb { name, admin_url }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL of this test's database.
    pub fn url(&self) -> String {
        let mut url = self.admin_url.clone();
        url.set_path(&self.name);
        url.to_string()
    }

    /// The URL of this test's database, reached through `addr` (a relay) instead of the server itself.
    pub fn url_via(&self, addr: std::net::SocketAddr) -> String {
        let mut url = self.admin_url.clone();
        url.set_path(&self.name);
        url.set_host(Some(&addr.ip().to_string()))
            .expect("a postgres URL takes a host");
        url.set_port(Some(addr.port()))
            .expect("a postgres URL takes a port");
        url.to_string()
    }

    /// A client connected to this test's database, for setting up races by hand.
    pub async fn client(&self) -> tokio_postgres::Client {
        let url = Url::parse(&self.url()).expect("test database URL");
        connect(&url).await
    }

    /// Waits until some session on this database is blocked on a lock (a statement queued behind a
    /// transaction the test holds open).
    pub async fn wait_for_a_lock_waiter(&self) {
        let observer = self.client().await;
        for _ in 0..1000 {
            let row = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .expect("read pg_stat_activity");
            if row.get::<_, i64>(0) > 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("no session on {} ever waited on a lock", self.name);
    }

    /// `host:port` of the PostgreSQL server, for a relay to forward to.
    pub fn server_addr(&self) -> String {
        let host = self.admin_url.host_str().unwrap_or("localhost");
        let port = self.admin_url.port().unwrap_or(5432);
        format!("{host}:{port}")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = std::mem::take(&mut self.name);
        // Drop cannot await: drop the database from a thread with its own runtime.
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for dropping the test database");
            runtime.block_on(drop_database(&admin_url, &name));
        });
        let _ = dropper.join();
    }
}

async fn drop_database(admin_url: &Url, name: &str) {
    let Ok((client, connection)) = tokio_postgres::connect(admin_url.as_str(), tokio_postgres::NoTls).await
    else {
        return;
    };
    tokio::spawn(connection);
    let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    if let Err(e) = client.batch_execute(&sql).await {
        eprintln!("could not drop test database {name}: {e}");
    }
}

/// The server's URL as the tests find it (see the module's header), naming its admin database. The
/// first call finds it, starting the process's own server if it comes to that (blocking, a few seconds);
/// every call after returns the same URL, or fails with the same reason.
pub fn base_url() -> Url {
    static FOUND: OnceLock<Result<Found, String>> = OnceLock::new();
    match FOUND.get_or_init(find_server) {
        Ok(found) => found.url.clone(),
        Err(reason) => panic!("{reason}"),
    }
}

/// The server the process uses, and the one it started, if it started one (kept until it exits).
struct Found {
    url: Url,
    _own: Option<OwnServer>,
}

fn find_server() -> Result<Found, String> {
    let found = |url| Found { url, _own: None };
    if let Some(text) = std::env::var("DATABASE_URL").ok().filter(|text| !text.is_empty()) {
        return Url::parse(&text)
            .map(found)
            .map_err(|e| format!("DATABASE_URL is not a URL ({e}); {HOW_TO}"));
    }
    let own = match std::env::var(OWN_SERVER).unwrap_or_default().as_str() {
        "" => false,
        "own" => true,
        other => {
            return Err(format!(
                "{OWN_SERVER}={other:?}: the one value it takes is \"own\""
            ));
        }
    };
    let local = SocketAddr::from(([127, 0, 0, 1], 5432));
    if !own && TcpStream::connect_timeout(&local, Duration::from_secs(2)).is_ok() {
        return Ok(found(Url::parse(DEFAULT_URL).expect("the default URL")));
    }
    let server = OwnServer::start()?;
    Ok(Found {
        url: server.url.clone(),
        _own: Some(server),
    })
}

/// The server this process started; it stops when the process exits (the shell's stdin closes).
struct OwnServer {
    url: Url,
    _shell: Child,
    _stdin: ChildStdin,
}

/// Run by the watching shell: starts the server and says `ready`, or prints its log; once its stdin
/// closes, stops the server at once and removes its directory. Signals from a terminal do not reach it
/// (its own process group); the end of this process does.
const WATCH: &str = r#"bin=$1 dir=$2 options=$3
if ! "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 -o "$options" start >/dev/null 2>&1; then
  cat "$dir/server.log"; rm -rf "$dir"; exit 1
fi
echo ready
read line
"$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1
rm -rf "$dir""#;

impl OwnServer {
    fn start() -> Result<OwnServer, String> {
        let no_server = "no PostgreSQL answers on 127.0.0.1:5432 and DATABASE_URL is not set";
        let bin = super::cluster::server_bin_dir().ok_or_else(|| {
            format!(
                "{no_server}, and no initdb and pg_ctl were found to start one (on PATH, in \
                 /usr/lib/postgresql/<n>/bin, /usr/local/bin or /usr/local/pgsql/bin); {HOW_TO}"
            )
        })?;
        let as_postgres = super::cluster::running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pg-shared-")
            .tempdir()
            .map_err(|e| format!("create the test server's directory: {e}"))?
            .keep();
        let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
            .map_err(|e| format!("make the test server's certificate: {e}"))?;
        write_private(&dir.join("server.crt"), &certified.cert.pem())?;
        write_private(&dir.join("server.key"), &certified.signing_key.serialize_pem())?;
        if as_postgres {
            run(
                false,
                Path::new("chown"),
                &["-R".as_ref(), "postgres:".as_ref(), dir.as_os_str()],
            )?;
        }
        let data = dir.join("data");
        let mut initdb = vec!["-D".as_ref(), data.as_os_str()];
        initdb.extend(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"].map(OsStr::new));
        run(as_postgres, &bin.join("initdb"), &initdb)?;
        let port = super::cluster::free_port();
        let dir_text = dir.display();
        let options = format!(
            "-p {port} -k {dir_text} -c listen_addresses=127.0.0.1 -c max_connections={OWN_MAX_CONNECTIONS} \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c ssl=on \
             -c ssl_cert_file={dir_text}/server.crt -c ssl_key_file={dir_text}/server.key"
        );
        let mut shell = if as_postgres {
            let mut runuser = Command::new("runuser");
            runuser.args(["-u", "postgres", "--", "sh"]);
            runuser
        } else {
            Command::new("sh")
        };
        let mut shell = std::os::unix::process::CommandExt::process_group(
            shell
                .arg("-c")
                .arg(WATCH)
                .arg("sh")
                .arg(&bin)
                .arg(&dir)
                .arg(&options),
            0,
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start the test server's shell: {e}"))?;
        let stdin = shell.stdin.take().expect("piped stdin");
        let mut out = BufReader::new(shell.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        let _ = out.read_line(&mut line);
        if line.trim() != "ready" {
            let mut log = line;
            let _ = out.read_to_string(&mut log);
            let _ = shell.wait();
            return Err(format!(
                "{no_server}, and the server the tests started failed; its log:\n{log}"
            ));
        }
        let url = Url::parse(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).expect("a URL");
        Ok(OwnServer {
            url,
            _shell: shell,
            _stdin: stdin,
        })
    }
}

/// Writes `text` to `path`, readable by its owner alone (PostgreSQL refuses a key others may read).
fn write_private(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|e| format!("write {}: {e}", path.display()))
}

/// Runs `program` with `args`, through `runuser -u postgres` when `as_postgres`; its output when it
/// fails.
fn run(as_postgres: bool, program: &Path, args: &[&OsStr]) -> Result<(), String> {
    let mut command = Command::new(if as_postgres {
        Path::new("runuser")
    } else {
        program
    });
    if as_postgres {
        command.args(["-u", "postgres", "--"]).arg(program);
    }
    let output = command
        .args(args)
        .output()
        .map_err(|e| format!("run {command:?}: {e}; {HOW_TO}"))?;
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{command:?} failed ({}): {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

fn unique_name() -> String {
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("idemproxy_t_{}_{counter}_{random}", std::process::id())
}

pub async fn connect(url: &Url) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url.as_str(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            let server = format!("{}:{}", url.host_str().unwrap_or("?"), url.port().unwrap_or(5432));
            panic!(
                "cannot connect to PostgreSQL at {server} ({}); {HOW_TO}",
                error_chain(&e)
            )
        });
    tokio::spawn(connection);
    client
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}
