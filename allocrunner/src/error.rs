//! Errors of the alloc runner, its hooks and its drivers.

use std::path::PathBuf;

use berth_csimanager::CsiError;

use crate::claims::ClaimError;

/// A hook that failed. Its message becomes a task event and, for prerun
/// hooks, the alloc's description.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("{what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("claiming volume {volume_id}: {error}")]
    Claim {
        volume_id: String,
        #[source]
        error: ClaimError,
    },
    #[error("unpublishing volume {volume_id} on the servers: {error}")]
    Unpublish {
        volume_id: String,
        #[source]
        error: ClaimError,
    },
    #[error("mounting volume {volume_id}: {error}")]
    Mount {
        volume_id: String,
        #[source]
        error: CsiError,
    },
    #[error("unmounting volume {volume_id} (left claimed for the servers to reap): {error}")]
    Unmount {
        volume_id: String,
        #[source]
        error: CsiError,
    },
    #[error("bind-mounting {src} at {target}: {errno}")]
    Bind {
        src: PathBuf,
        target: PathBuf,
        errno: nix::Error,
    },
    #[error("unmounting {target}: {errno}")]
    Unbind { target: PathBuf, errno: nix::Error },
    #[error("plugin {plugin_id}: {message}")]
    Plugin { plugin_id: String, message: String },
    #[error("{0}")]
    Invalid(String),
    /// The alloc was stopped while the hook waited; not a failure.
    #[error("the alloc was stopped")]
    Stopped,
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Multiple(Vec<HookError>),
}

impl HookError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        HookError::Io {
            what,
            path: path.into(),
            error,
        }
    }

    /// `Ok` when `errs` is empty, the one error, or all of them.
    pub(crate) fn from_many(mut errs: Vec<HookError>) -> Result<(), HookError> {
        match errs.len() {
            0 => Ok(()),
            1 => Err(errs.remove(0)),
            _ => Err(HookError::Multiple(errs)),
        }
    }
}

/// A task driver that could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("driver {0:?} is not available on this node")]
    UnknownDriver(String),
    #[error("command {command:?} not found")]
    CommandNotFound { command: String },
    #[error("command {command:?} cannot be executed: permission denied")]
    PermissionDenied { command: String },
    #[error("starting {command:?}: {error}")]
    Spawn {
        command: String,
        #[source]
        error: std::io::Error,
    },
    #[error("opening log file {path}: {error}")]
    Logs {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("starting the executor {program}: {error}")]
    Executor {
        program: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("the executor of {command:?} failed: {message}")]
    ExecutorFailed { command: String, message: String },
    #[error("reattaching to task process {pid}: {message}")]
    Reattach { pid: u32, message: String },
    #[error("signalling process group {pgid}: {errno}")]
    Signal { pgid: i32, errno: nix::Error },
}

impl DriverError {
    /// `command` may not start on this node, for `why` (a driver turned
    /// off, a user the node denies).
    pub(crate) fn refused(command: &str, why: impl Into<String>) -> DriverError {
        DriverError::Spawn {
            command: command.to_string(),
            error: std::io::Error::new(std::io::ErrorKind::PermissionDenied, why.into()),
        }
    }
}

/// What [`crate::AllocRunner::destroy`] could not do.
#[derive(Debug, thiserror::Error)]
pub enum AllocRunnerError {
    #[error("alloc dir {path} still has mounts ({}); not removing it", .mounts.join(", "))]
    StillMounted { path: PathBuf, mounts: Vec<String> },
    #[error("volume {volume_id} is still mounted for the alloc; keeping its records: {error}")]
    VolumeStillMounted {
        volume_id: String,
        #[source]
        error: CsiError,
    },
    #[error("volume {volume_id} is still recorded as mounted for the alloc; keeping its records")]
    VolumeStillRecorded { volume_id: String },
    #[error("{what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
}

/// Why an [`crate::AllocStateStore`] could not read or write. Its message
/// is its cause's own, as stores have always reported it.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The store's backend (its database, the disk) failed.
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The record under `key` did not encode to (or decode from) its
    /// stored form.
    #[error("{source}")]
    Codec {
        key: String,
        source: serde_json::Error,
    },
}

impl StateError {
    /// The backend failed with `error`.
    pub fn backend(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        StateError::Backend(error.into())
    }

    /// The record under `key` did not encode or decode.
    pub fn codec(key: impl Into<String>, source: serde_json::Error) -> Self {
        StateError::Codec {
            key: key.into(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StateError;

    #[test]
    fn a_state_error_reads_as_its_cause_and_keeps_it() {
        let io = std::io::Error::other("disk full");
        let e = StateError::backend(io);
        assert_eq!(e.to_string(), "disk full");

        let json = serde_json::from_str::<u32>("x").unwrap_err();
        let message = json.to_string();
        let e = StateError::codec("a1/web", json);
        assert_eq!(e.to_string(), message);
        assert!(std::error::Error::source(&e).is_some());
        assert!(matches!(e, StateError::Codec { ref key, .. } if key == "a1/web"));
    }
}
