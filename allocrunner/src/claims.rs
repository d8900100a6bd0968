//! CSI claims on the servers, as the CSI hook needs them. The agent
//! implements [`VolumeClaimer`] over its RPC connection.

use std::collections::BTreeMap;

use berth_structs::{AccessMode, AttachmentMode, ClaimMode, CsiMountOptions};

/// Claims and releases CSI volumes on the servers for an alloc.
#[async_trait::async_trait]
pub trait VolumeClaimer: Send + Sync {
    /// `CSIVolume.Claim`: the servers record the claim and run
    /// `ControllerPublishVolume` when the plugin needs it.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimResult, ClaimError>;
    /// `CSIVolume.Unpublish`: the servers detach and free the alloc's claim.
    /// Releasing a claim that does not exist succeeds.
    async fn unpublish(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    pub volume_id: String,
    pub alloc_id: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    pub read_only: bool,
    /// The job's mount options; the servers lay them over the volume's for
    /// ControllerPublishVolume and answer with the result.
    pub mount_options: CsiMountOptions,
}

/// What the servers answer to a claim: enough to stage and publish the
/// volume on this node. `secrets` are passed to the plugin and never
/// printed (`Debug` redacts them).
#[derive(Clone, Default)]
pub struct ClaimResult {
    pub volume_id: String,
    pub external_id: String,
    pub plugin_id: String,
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    /// The volume's own mount options; the job's are laid over them.
    pub mount_options: CsiMountOptions,
}

impl std::fmt::Debug for ClaimResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimResult")
            .field("volume_id", &self.volume_id)
            .field("external_id", &self.external_id)
            .field("plugin_id", &self.plugin_id)
            .field("publish_context", &self.publish_context)
            .field("volume_context", &self.volume_context)
            .field("secrets", &"<redacted>")
            .field("mount_options", &self.mount_options)
            .finish()
    }
}

/// A claim or release the servers refused or that did not reach them.
/// `retryable` errors may succeed later (no free claim yet because a
/// previous one is being freed, servers unreachable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ClaimError {
    pub retryable: bool,
    pub message: String,
}

impl ClaimError {
    pub fn retryable(message: impl Into<String>) -> ClaimError {
        ClaimError {
            retryable: true,
            message: message.into(),
        }
    }

    pub fn fatal(message: impl Into<String>) -> ClaimError {
        ClaimError {
            retryable: false,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_result_debug_redacts_secrets() {
        let r = ClaimResult {
            secrets: [("password".to_string(), "hunter2".to_string())].into(),
            ..Default::default()
        };
        let s = format!("{r:?}");
        assert!(!s.contains("hunter2"), "{s}");
        assert!(s.contains("<redacted>"));
    }
}
