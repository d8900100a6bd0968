//! CSI claims on the servers, as the CSI hook needs them. The agent
//! implements [`VolumeClaimer`] over its RPC connection.

pub use berth_structs::ClaimGrant;
use berth_structs::{AccessMode, AttachmentMode, ClaimMode, CsiMountOptions};

/// Claims and releases CSI volumes on the servers for an alloc.
#[async_trait::async_trait]
pub trait VolumeClaimer: Send + Sync {
    /// `CSIVolume.Claim`: the servers record the claim and run
    /// `ControllerPublishVolume` when the plugin needs it.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimGrant, ClaimError>;
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

/// A claim or release the servers refused or that did not reach them.
/// `retryable` errors may succeed later (no free claim yet because a
/// previous one is being freed, servers unreachable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ClaimError {
    pub retryable: bool,
    pub message: String,
    /// The servers refused the claim because they hold the alloc terminal
    /// (see [`berth_structs::CLAIM_REFUSED_ALLOC_TERMINAL`]).
    pub alloc_terminal: bool,
}

impl ClaimError {
    pub fn retryable(message: impl Into<String>) -> ClaimError {
        ClaimError {
            retryable: true,
            message: message.into(),
            alloc_terminal: false,
        }
    }

    pub fn fatal(message: impl Into<String>) -> ClaimError {
        ClaimError {
            retryable: false,
            message: message.into(),
            alloc_terminal: false,
        }
    }
}
