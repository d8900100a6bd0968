//! HCL job and volume specs, in the shape Nomad users write.
//!
//! Specs hold literal values only. An attribute or block berth does not know
//! is an error that names it and its line, never silently dropped; so are
//! values of the wrong type and expressions (variables, operators, function
//! calls). `${NAME}` inside strings is kept verbatim: berth fills it in from
//! the task environment when the task starts. Parsing does not validate: the
//! caller runs [`Job::validate`] or [`CsiVolume::validate`].
//!
//! [`hcl`] is the schema reader under both specs, public so that other HCL
//! files berth reads (the agent's configuration) refuse the same things in
//! the same words.

pub mod hcl;
mod job;
mod units;
mod volume;

pub use units::{parse_duration, parse_size};

use crate::{CsiVolume, Job};

/// A spec that could not be read, with the (one-based) line it was found on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct SpecError {
    pub line: usize,
    pub message: String,
}

impl SpecError {
    pub(crate) fn at(line: usize, message: impl Into<String>) -> Self {
        SpecError {
            line,
            message: message.into(),
        }
    }
}

/// Parses a job spec: one `job "ID" { ... }` block.
pub fn parse_job(src: &str) -> Result<Job, SpecError> {
    let source = hcl::Source::new(src);
    let body = source.parse_body()?;
    job::decode_job(&source, &body)
}

/// Parses a volume spec (`id`, `type = "csi"`, `plugin_id`, `capability`
/// blocks, ...), for `volume create` and `volume register`.
pub fn parse_volume(src: &str) -> Result<CsiVolume, SpecError> {
    let source = hcl::Source::new(src);
    let body = source.parse_body()?;
    volume::decode_volume(&source, &body)
}
