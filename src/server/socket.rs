//! The proxy's listening socket, bound at start by `lib.rs` and accepted from by `server.rs`: a TCP
//! listener, or a unix stream socket (`server.listen = "unix:/path"`). A unix socket's file is bound
//! after removing a stale one that nothing listens on (never another kind of file, never a live one),
//! has `server.socket_mode` from the moment its path names it, and is removed when the listener closes
//! at shutdown. Touches only that file, and a private directory beside it while binding.

use std::fs::Permissions;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// The proxy listener's socket.
pub enum ProxySocket {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A unix stream socket, and its file.
    Unix(UnixSocket),
}

impl From<TcpListener> for ProxySocket {
    fn from(listener: TcpListener) -> ProxySocket {
        ProxySocket::Tcp(listener)
    }
}

/// A bound unix socket; its file goes when this does, if the file is still this socket's.
pub struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the file as bound, so a file another process put there since is left alone.
    id: (u64, u64),
}

/// A connection just accepted.
pub enum Accepted {
    /// A TCP client and its address.
    Tcp(TcpStream, SocketAddr),
    /// A client of the unix socket: it has no address to name.
    Unix(UnixStream),
}

impl ProxySocket {
    /// Binds a unix socket at `path` with permissions `mode`. A socket file already there is removed
    /// first if connecting to it is refused (its process is gone); a live socket or a file of any other
    /// kind is an error naming the path.
    pub fn bind_unix(path: &Path, mode: u32) -> io::Result<ProxySocket> {
        let named = |error: io::Error| io::Error::new(error.kind(), format!("{}: {error}", path.display()));
        clear_stale(path).map_err(named)?;
        let listener = bind_with_mode(path, mode).map_err(named)?;
        let meta = std::fs::symlink_metadata(path).map_err(named)?;
        Ok(ProxySocket::Unix(UnixSocket {
            listener,
            path: path.to_owned(),
            id: (meta.dev(), meta.ino()),
        }))
    }

    /// Where it listens, for the log: `ip:port`, or `unix:/path`.
    pub fn local_addr(&self) -> io::Result<String> {
        match self {
            ProxySocket::Tcp(listener) => Ok(listener.local_addr()?.to_string()),
            ProxySocket::Unix(socket) => Ok(format!("unix:{}", socket.path.display())),
        }
    }

    /// The next connection (TCP ones with Nagle's algorithm off).
    pub async fn accept(&self) -> io::Result<Accepted> {
        match self {
            ProxySocket::Tcp(listener) => {
                let (stream, addr) = listener.accept().await?;
                let _ = stream.set_nodelay(true);
                Ok(Accepted::Tcp(stream, addr))
            }
            ProxySocket::Unix(socket) => Ok(Accepted::Unix(socket.listener.accept().await?.0)),
        }
    }
}

/// Binds a unix socket at `path` whose file has `mode` from the moment `path` names it. Bound at `path`
/// and then given its mode, the file would have the process's default mode (0777 less the umask) in
/// between, open to any local user who connects then. So it is bound in a directory beside `path` that
/// only this user may enter, given its mode there, and linked at `path`: like a bind, the link fails if
/// anything is there already, and the socket is the same file under its new name.
fn bind_with_mode(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let private = PrivateDir::create(parent)?;
    let staged = private.socket();
    let listener = UnixListener::bind(&staged)?;
    std::fs::set_permissions(&staged, Permissions::from_mode(mode))?;
    std::fs::hard_link(&staged, path)?;
    Ok(listener)
}

/// A directory only this user may enter, made beside the socket's path (so on its file system) and
/// removed, with what it holds, when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    /// Names are short, so a socket path within the system's limit (108 bytes on Linux) stays within it
    /// when staged here.
    fn create(parent: &Path) -> io::Result<PrivateDir> {
        let pid = std::process::id();
        let mut builder = std::fs::DirBuilder::new();
        builder.mode(0o700);
        for attempt in 0..64u32 {
            let dir = parent.join(format!(".{pid:x}{attempt:x}"));
            match builder.create(&dir) {
                Ok(()) => return Ok(PrivateDir(dir)),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(error) => return Err(error),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "cannot make a private directory beside the socket to bind it in",
        ))
    }

    /// Where the socket is bound first.
    fn socket(&self) -> PathBuf {
        self.0.join("s")
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        if let Err(error) = std::fs::remove_dir(&self.0) {
            tracing::warn!(path = %self.0.display(), %error, "cannot remove the directory the socket was bound in");
        }
    }
}

/// Removes a socket file at `path` that nothing listens on.
fn clear_stale(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
        Ok(meta) => meta,
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "exists and is not a socket; not removing it",
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another process is listening on this socket",
        )),
        Err(error) if error.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing a stale socket file nothing listens on");
            std::fs::remove_file(path)
        }
        Err(error) => Err(error),
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|meta| (meta.dev(), meta.ino()) == self.id);
        if ours && let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove the socket file");
        }
    }
}
