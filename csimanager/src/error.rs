//! CSI errors, classified.

use std::sync::Arc;

use tonic::Code;

/// Why a [`crate::VolumeStateStore`] could not read or write. It reads as
/// its cause, which it keeps (`source()` is the cause's own source; the
/// cause itself is [`StoreError::cause`]).
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct StoreError(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl StoreError {
    /// The store failed with `cause`.
    pub fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        StoreError(Arc::from(cause.into()))
    }

    /// What the store failed with, to downcast to the store's own type.
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

/// A CSI call that did not succeed.
///
/// `Final` errors will not change by retrying (`InvalidArgument`, `NotFound`,
/// `AlreadyExists`, `FailedPrecondition`, `PermissionDenied`, and any other
/// code not listed as uncertain). `Uncertain` errors leave the operation's
/// outcome unknown (`DeadlineExceeded`, `Unavailable`, `Aborted`,
/// `ResourceExhausted`, `Canceled`, transport failures): it is retried, and
/// its undo is still made if the alloc goes away.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CsiError {
    #[error("{op} on plugin {plugin_id}: {code:?}: {message}")]
    Final {
        plugin_id: String,
        op: &'static str,
        code: Code,
        message: String,
    },
    #[error("{op} on plugin {plugin_id} is uncertain: {code:?}: {message}")]
    Uncertain {
        plugin_id: String,
        op: &'static str,
        code: Code,
        message: String,
    },
    #[error("plugin {0} is not registered on this node")]
    PluginNotFound(String),
    #[error("volume {volume_id}: {message}")]
    Volume { volume_id: String, message: String },
    #[error("persisting CSI state: {0}")]
    Store(StoreError),
    #[error("{0}")]
    Io(String),
}

impl CsiError {
    /// Classifies a status from `op` on `plugin_id`.
    pub fn from_status(plugin_id: &str, op: &'static str, status: &tonic::Status) -> CsiError {
        let code = status.code();
        let message = status.message().to_string();
        let plugin_id = plugin_id.to_string();
        if is_uncertain(code) {
            CsiError::Uncertain {
                plugin_id,
                op,
                code,
                message,
            }
        } else {
            CsiError::Final {
                plugin_id,
                op,
                code,
                message,
            }
        }
    }

    pub fn is_uncertain(&self) -> bool {
        matches!(self, CsiError::Uncertain { .. })
    }

    /// The gRPC code to report this error with.
    pub fn code(&self) -> Code {
        match self {
            CsiError::Final { code, .. } | CsiError::Uncertain { code, .. } => *code,
            CsiError::PluginNotFound(_) => Code::Unavailable,
            CsiError::Volume { .. } => Code::FailedPrecondition,
            CsiError::Store(_) | CsiError::Io(_) => Code::Internal,
        }
    }
}

/// Codes that leave a CSI operation's outcome unknown. `Unknown` is what
/// tonic reports for transport failures.
pub fn is_uncertain(code: Code) -> bool {
    matches!(
        code,
        Code::DeadlineExceeded
            | Code::Unavailable
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Cancelled
            | Code::Unknown
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_and_uncertain_codes_are_classified() {
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::PermissionDenied,
        ] {
            let e = CsiError::from_status("p", "NodeStageVolume", &tonic::Status::new(code, "x"));
            assert!(!e.is_uncertain(), "{code:?} must be final");
        }
        for code in [
            Code::DeadlineExceeded,
            Code::Unavailable,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::Cancelled,
        ] {
            let e = CsiError::from_status("p", "NodeStageVolume", &tonic::Status::new(code, "x"));
            assert!(e.is_uncertain(), "{code:?} must be uncertain");
        }
    }
}
