//! HCL job and volume specs, in the shape Nomad users write.
//!
//! Specs hold literal values only. An attribute or block berth does not know
//! is an error that names it and its line, never silently dropped; so are
//! values of the wrong type and expressions (operators, function calls).
//! `${NAME}` inside strings is kept verbatim: berth fills it in from the
//! task environment when the task starts. A job file may declare input
//! variables (`variable "name" { ... }`, see [`variables`]) and use them as
//! `var.name` or `${var.name}`. Parsing does not validate: the caller runs
//! [`Job::validate`] or [`CsiVolume::validate`].
//!
//! [`hcl`] is the schema reader under both specs, public so that other HCL
//! files berth reads (the agent's configuration) refuse the same things in
//! the same words.

mod acl_policy;
pub mod hcl;
mod job;
mod units;
mod variables;
mod volume;

pub use acl_policy::parse_acl_policy;
pub use units::{parse_duration, parse_size};

use crate::{CsiVolume, Job};

/// A spec that could not be read, with the (one-based) line it was found on
/// (0 for a problem of no line: a `-var` that names no variable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct SpecError {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.line == 0 {
            f.write_str(&self.message)
        } else {
            write!(f, "line {}: {}", self.line, self.message)
        }
    }
}

impl SpecError {
    pub(crate) fn at(line: usize, message: impl Into<String>) -> Self {
        SpecError {
            line,
            message: message.into(),
        }
    }

    pub(crate) fn without_line(message: impl Into<String>) -> Self {
        SpecError::at(0, message)
    }
}

/// Parses a job spec: one `job "ID" { ... }` block, and the input variables
/// it declares (with their defaults).
pub fn parse_job(src: &str) -> Result<Job, SpecError> {
    parse_job_with_variables(src, &[])
}

/// Parses a job spec with `-var NAME=VALUE` overrides of its variables.
pub fn parse_job_with_variables(src: &str, vars: &[(String, String)]) -> Result<Job, SpecError> {
    let mut source = hcl::Source::new(src);
    let body = source.parse_body()?;
    let values = variables::decode_variables(&source, &body, vars)?;
    source.set_variables(values);
    job::decode_job(&source, &body)
}

/// Parses a volume spec (`id`, `type = "csi"`, `plugin_id`, `capability`
/// blocks, ...), for `volume create` and `volume register`.
pub fn parse_volume(src: &str) -> Result<CsiVolume, SpecError> {
    let source = hcl::Source::new(src);
    let body = source.parse_body()?;
    volume::decode_volume(&source, &body)
}
