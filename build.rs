//! Names the git commit the binary is built from, for `idemproxy --version` (`src/cmd.rs`):
//! `BUILD_COMMIT` is the short hash, with `-dirty` when tracked files had changes, or is left unset
//! outside a git checkout (a source tarball, the container build context, which has no `.git`). Set
//! `GIT_COMMIT` in the build's environment to name it there (CI systems such as Jenkins set it). Reruns
//! when HEAD or the branch moves.
//!
//! Neither name starts with `IDEMPROXY_`: cargo gives the variables a build script sets to the programs
//! `cargo run` and `cargo test` start, and the proxy they start would read an `IDEMPROXY_` one as a
//! configuration key.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=GIT_COMMIT");
    if let Ok(given) = std::env::var("GIT_COMMIT") {
        println!("cargo:rustc-env=BUILD_COMMIT={given}");
        return;
    }
    let Some(hash) = git(&["rev-parse", "--short", "HEAD"]) else {
        return;
    };
    watch_head();
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=BUILD_COMMIT={hash}{suffix}");
}

/// Git's trimmed output, when git runs and succeeds here.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    output.status.success().then(|| text.trim().to_owned())
}

/// Reruns this script when HEAD or the branch it names moves (in a worktree, HEAD is in the worktree's
/// git directory and the branch in the common one). Not at every edit, which would rebuild the crate
/// each time: `-dirty` says whether the tree was dirty when HEAD last moved or the build began afresh.
fn watch_head() {
    let path = |args: &[&str]| git(args).map(PathBuf::from);
    if let Some(dir) = path(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
    }
    let Some(common) = path(&["rev-parse", "--git-common-dir"]) else {
        return;
    };
    let branch = git(&["symbolic-ref", "-q", "HEAD"]).map(|branch| common.join(branch));
    // A path that does not exist would rerun the script, and rebuild the crate, at every build.
    for file in [Some(common.join("packed-refs")), branch].into_iter().flatten() {
        if file.exists() {
            println!("cargo:rerun-if-changed={}", file.display());
        }
    }
}
