//! The plugin's errors and their one mapping to gRPC status codes.

use std::io;
use std::path::{Path, PathBuf};

use tonic::{Code, Status};

/// Everything an RPC can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A REQUIRED field is missing or empty.
    #[error("missing required field `{0}`")]
    MissingField(&'static str),
    /// A field has a value the plugin does not accept.
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request cannot be met with what the plugin has (e.g. an
    /// accessibility requirement this instance does not serve).
    #[error("{0}")]
    ResourceExhausted(String),
    /// A capacity outside what the plugin can give.
    #[error("{0}")]
    OutOfRange(String),
    /// Another operation on the same volume is in flight.
    #[error("an operation on volume {0} is already in progress")]
    Busy(String),
    /// A `starting_token` that does not come from this plugin.
    #[error("invalid starting_token `{0}`")]
    BadToken(String),
    #[error("{0} is not implemented by this plugin")]
    Unimplemented(&'static str),
    #[error("{rpc}: injected failure")]
    Injected { rpc: &'static str, code: Code },
    #[error("{context} {}: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{context} {}: {source}", path.display())]
    Sys {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("saving plugin state: {0}")]
    Persist(#[source] io::Error),
    /// Another instance sharing the state directory held the state lock for
    /// longer than the plugin waits.
    #[error("the state lock {} is still held by another plugin instance after {waited:?}", path.display())]
    StateLocked {
        path: PathBuf,
        waited: std::time::Duration,
    },
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// Wraps an I/O error on `path`; `context` says what was being done
    /// ("creating", "removing", ...).
    pub fn io<'a>(context: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Self + 'a {
        move |source| Self::Io {
            context,
            path: path.to_owned(),
            source,
        }
    }

    /// Wraps a failed system call on `path`.
    pub fn sys<'a>(context: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> Self + 'a {
        move |source| Self::Sys {
            context,
            path: path.to_owned(),
            source,
        }
    }

    /// The gRPC code this error is answered with.
    pub fn code(&self) -> Code {
        match self {
            Self::MissingField(_) | Self::InvalidArgument { .. } => Code::InvalidArgument,
            Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::OutOfRange(_) => Code::OutOfRange,
            Self::Busy(_) | Self::BadToken(_) => Code::Aborted,
            Self::Unimplemented(_) => Code::Unimplemented,
            Self::Injected { code, .. } => *code,
            Self::StateLocked { .. } => Code::Unavailable,
            // A full disk: the request may succeed once space is freed.
            Self::Io { source, .. } | Self::Persist(source)
                if source.raw_os_error() == Some(libc::ENOSPC) =>
            {
                Code::ResourceExhausted
            }
            Self::Io { .. } | Self::Sys { .. } | Self::Persist(_) | Self::Internal(_) => {
                Code::Internal
            }
        }
    }
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        Status::new(err.code(), err.to_string())
    }
}

/// Returns `Err(MissingField)` when a REQUIRED string field is empty.
pub fn require<'a>(value: &'a str, field: &'static str) -> Result<&'a str, Error> {
    if value.is_empty() {
        Err(Error::MissingField(field))
    } else {
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let cases = [
            (Error::MissingField("volume_id"), Code::InvalidArgument),
            (
                Error::invalid("capacity_range", "negative"),
                Code::InvalidArgument,
            ),
            (Error::NotFound("x".into()), Code::NotFound),
            (Error::AlreadyExists("x".into()), Code::AlreadyExists),
            (
                Error::FailedPrecondition("x".into()),
                Code::FailedPrecondition,
            ),
            (
                Error::ResourceExhausted("x".into()),
                Code::ResourceExhausted,
            ),
            (Error::OutOfRange("x".into()), Code::OutOfRange),
            (Error::Busy("v".into()), Code::Aborted),
            (Error::BadToken("t".into()), Code::Aborted),
            (Error::Unimplemented("GetCapacity"), Code::Unimplemented),
            (
                Error::Injected {
                    rpc: "Probe",
                    code: Code::Unavailable,
                },
                Code::Unavailable,
            ),
            (Error::Internal("x".into()), Code::Internal),
            (
                Error::StateLocked {
                    path: "/s/state.lock".into(),
                    waited: std::time::Duration::from_secs(20),
                },
                Code::Unavailable,
            ),
        ];
        for (err, code) in cases {
            assert_eq!(Status::from(err).code(), code);
        }
    }

    #[test]
    fn a_full_disk_is_resource_exhausted() {
        let full = || io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(
            Error::io("copying", Path::new("/s/snapshots/x"))(full()).code(),
            Code::ResourceExhausted
        );
        assert_eq!(Error::Persist(full()).code(), Code::ResourceExhausted);
        let denied = io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(
            Error::io("copying", Path::new("/x"))(denied).code(),
            Code::Internal
        );
    }

    #[test]
    fn missing_field_names_the_field() {
        let status = Status::from(require("", "staging_target_path").unwrap_err());
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("staging_target_path"));
        assert_eq!(require("x", "f").unwrap(), "x");
    }
}
