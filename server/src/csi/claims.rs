//! Claims: taking a volume for an alloc (with `ControllerPublishVolume` when
//! the plugin needs it) and releasing it through
//! `taken → node-detached → controller-detached → ready-to-free → freed`.
//!
//! The state is checkpointed in the state store before each detach call
//! (node detach, controller detach), so a call that fails (or a server
//! restart) resumes where it stopped; steps with no call between them share
//! one write. A client's own release of a claim that needs no controller
//! detach is freed in a single write; with a controller detach it takes
//! two (node-detached before the call, the free after it). The claim
//! records (`controller_published`) that ControllerPublish was sent, before
//! it is sent; the controller detach follows that record, never the plugin's
//! current fingerprint, and waits (claim `node-detached`, retried) while no
//! healthy controller is reachable. `NotFound` from ControllerUnpublish means
//! the volume is not published: the step is done. Error codes
//! a client sees from `Claim`:
//! - `NotFound`: the volume or alloc does not exist (final);
//! - `FailedPrecondition` (`ServerError::Conflict`): the volume lacks the
//!   requested capability, the alloc is terminal or on another node, the
//!   node is not in the volume's accessible topology (final);
//! - `ResourceExhausted` (`ServerError::InUse`): the claims of that kind are
//!   taken, retry once they are freed;
//! - `Unavailable`: no client runs a controller (or the node plugin) now;
//! - a controller plugin's own code, passed through.

use berth_structs::{AccessMode, AttachmentMode, ClaimMode, CsiMountOptions};

use crate::error::ServerError;

/// A request to claim a volume for an alloc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeClaimRequest {
    pub volume_id: String,
    pub alloc_id: String,
    pub node_id: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    /// The job's mount options; they lie over the volume's.
    pub mount_options: CsiMountOptions,
}

pub use berth_structs::ClaimGrant;

/// The message of the `Storage` node event that records a detach step an
/// operator's release went on past.
pub const FORCED_RELEASE_EVENT: &str = "Volume claim freed despite a failed detach";

/// Who releases a claim; it decides whether the node detach is needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOrigin {
    /// The client of `node_id` already unpublished and unstaged the volume
    /// locally before asking (`CSIVolume.Unpublish`); when it is the claim's
    /// node, the node detach step is done.
    Client { node_id: String },
    /// The volume watcher reaping a claim nobody released.
    Watcher,
    /// An operator (`volume detach`, forced deregister).
    Operator,
}

/// gRPC codes after which a plugin certainly did not act.
pub(crate) fn is_final(e: &ServerError) -> bool {
    matches!(
        e.grpc_code(),
        tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::AlreadyExists
            | tonic::Code::FailedPrecondition
            | tonic::Code::PermissionDenied
    )
}
