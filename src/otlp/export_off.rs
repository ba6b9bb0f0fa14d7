//! The trace export of a build without the `otlp` feature: nothing to export with, so `[traces]` is
//! refused at load (`config/traces.rs`) and [`layer`] adds nothing. Touches the configuration only.

use tracing_subscriber::layer::Identity;

use crate::config::TracesConfig;

/// Why the export could not be set up: never, in this build.
#[derive(Debug, thiserror::Error)]
pub enum StartError {}

/// The export this build does not have.
#[derive(Debug)]
pub struct Exporting(());

impl Exporting {
    /// Nothing to send.
    pub fn shutdown(self) {}
}

/// No layer: this build exports nothing.
pub fn layer(_config: &TracesConfig) -> Result<Option<(Identity, Exporting)>, StartError> {
    Ok(None)
}
