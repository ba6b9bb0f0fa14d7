//! Programs the tests install for themselves under `target/test-tools/`: Python virtual environments
//! filled from PyPI, pinned by a requirements file. And how a test that cannot run here says so:
//! [`skip`], which fails instead where `CI` is set, so CI never counts a skipped test as passed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Says on stderr that the test cannot run here, `skipped: <missing> (<fix>)`, for the test to return;
/// where the `CI` environment variable is set (not empty), fails the test with that line instead.
/// (Citus is the one exception, optional everywhere: [`super::citus::url`].)
pub fn skip(missing: &str, fix: &str) {
    let line = format!("skipped: {missing} ({fix})");
    assert!(
        std::env::var_os("CI").is_none_or(|ci| ci.is_empty()),
        "{line}; CI is set, where a test that cannot run fails"
    );
    eprintln!("{line}");
}

/// [`skip`] for a program that is not installed, with the Debian line that installs it.
pub fn skip_missing(program: &str, install: &str) {
    skip(&format!("{program} is not installed"), install);
}

/// The Python of a virtual environment in `target/test-tools/<name>`, made and filled from PyPI with
/// `requirements` on first use, then reused until that file changes. Installed by the tests themselves,
/// so CI runs them on a clean clone rather than skipping them. Blocking; one install at a time.
pub fn python_venv(name: &str, requirements: &Path) -> PathBuf {
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _one = INSTALLING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/test-tools")
        .join(name);
    let python = dir.join("bin/python");
    let wanted = std::fs::read_to_string(requirements)
        .unwrap_or_else(|e| panic!("read {}: {e}", requirements.display()));
    let installed = dir.join("installed-requirements.txt");
    if std::fs::read_to_string(&installed).is_ok_and(|text| text == wanted) {
        return python;
    }
    let _ = std::fs::remove_dir_all(&dir);
    run(Command::new("python3").args(["-m", "venv"]).arg(&dir));
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(requirements));
    std::fs::write(&installed, wanted).unwrap();
    python
}

fn run(command: &mut Command) {
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("{command:?} does not start: {e}"));
    assert!(status.success(), "{command:?}: {status}");
}
