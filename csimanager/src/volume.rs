//! The volume manager: stages and publishes volumes for allocs, counts
//! usage per volume on the node, and undoes it all on unmount.

use std::collections::BTreeMap;
use std::path::PathBuf;

use berth_structs::{AccessMode, AttachmentMode, CsiMountOptions};
use serde::{Deserialize, Serialize};

/// What the CSI hook asks for to mount one volume for one alloc.
/// `secrets` are passed to the plugin and never logged (Debug redacts them).
#[derive(Clone)]
pub struct MountRequest {
    pub plugin_id: String,
    pub volume_id: String,
    pub external_id: String,
    pub alloc_id: String,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    pub read_only: bool,
    pub mount_options: CsiMountOptions,
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
}

impl std::fmt::Debug for MountRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountRequest")
            .field("plugin_id", &self.plugin_id)
            .field("volume_id", &self.volume_id)
            .field("external_id", &self.external_id)
            .field("alloc_id", &self.alloc_id)
            .field("access_mode", &self.access_mode)
            .field("attachment_mode", &self.attachment_mode)
            .field("read_only", &self.read_only)
            .field("secrets", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Where a mounted volume is on the host, for the task runner to bind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountInfo {
    /// The per-alloc publish target (host path).
    pub source: PathBuf,
    pub read_only: bool,
}

#[derive(Debug, Clone)]
pub struct UnmountRequest {
    pub plugin_id: String,
    pub volume_id: String,
    pub external_id: String,
    pub alloc_id: String,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    pub read_only: bool,
}

/// What is persisted about one volume on this node, per usage (access mode,
/// attachment mode, read-only): enough to unpublish and unstage it after a
/// restart, and the allocs that use it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStub {
    pub plugin_id: String,
    pub volume_id: String,
    pub external_id: String,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    pub read_only: bool,
    pub staging_path: PathBuf,
    /// Whether NodeStageVolume has succeeded (or may have: it is set before
    /// the call, so a restart still unstages).
    pub staged: bool,
    /// What NodeStageVolume left at the staging path, recorded when it
    /// returned: `Some(false)` nothing mounted (the CSI spec allows a stage
    /// that mounts nothing), so the record alone says staged; `Some(true)`
    /// or `None` (a record from before) a mount (for a block volume, one
    /// below it), so a record whose mount is gone is a lost staging.
    #[serde(default)]
    pub staging_mounted: Option<bool>,
    /// Set (durably) before NodeUnstageVolume of the last user: a restart
    /// that finds it does not take the usage for staged (the unstage may
    /// have finished), and finishes the unstage.
    #[serde(default)]
    pub unstaging: bool,
    /// Allocs using the volume with this usage, with their publish targets.
    pub allocs: BTreeMap<String, PathBuf>,
    /// What the usage was staged with (for a plugin that does not stage:
    /// what its first alloc published it with), not the secrets, which
    /// are never written down: a lost staging is made again with it, and
    /// a lost publish when its alloc's own options are not known.
    #[serde(default)]
    pub mounted_with: MountContext,
}

/// The parts of a [`MountRequest`] that a lost stage or publish is made
/// again with. Persisted; holds no secrets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountContext {
    #[serde(default)]
    pub mount_options: CsiMountOptions,
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
}

impl MountContext {
    pub fn of(req: &MountRequest) -> MountContext {
        MountContext {
            mount_options: req.mount_options.clone(),
            publish_context: req.publish_context.clone(),
            volume_context: req.volume_context.clone(),
        }
    }
}

impl MountRequest {
    /// The [`VolumeStub::key`] of the usage this request mounts.
    pub(crate) fn stub_key(&self) -> String {
        stub_key(
            &self.plugin_id,
            &self.volume_id,
            self.access_mode,
            self.attachment_mode,
            self.read_only,
        )
    }
}

impl UnmountRequest {
    /// Unmounts `alloc_id`'s use of the volume usage `stub` records.
    pub fn for_stub(stub: &VolumeStub, alloc_id: &str) -> UnmountRequest {
        UnmountRequest {
            plugin_id: stub.plugin_id.clone(),
            volume_id: stub.volume_id.clone(),
            external_id: stub.external_id.clone(),
            alloc_id: alloc_id.to_string(),
            access_mode: stub.access_mode,
            attachment_mode: stub.attachment_mode,
            read_only: stub.read_only,
        }
    }

    /// The [`VolumeStub::key`] of the usage this request unmounts.
    pub(crate) fn stub_key(&self) -> String {
        stub_key(
            &self.plugin_id,
            &self.volume_id,
            self.access_mode,
            self.attachment_mode,
            self.read_only,
        )
    }
}

/// Undoes the mount `req` asks for.
impl From<&MountRequest> for UnmountRequest {
    fn from(req: &MountRequest) -> UnmountRequest {
        UnmountRequest {
            plugin_id: req.plugin_id.clone(),
            volume_id: req.volume_id.clone(),
            external_id: req.external_id.clone(),
            alloc_id: req.alloc_id.clone(),
            access_mode: req.access_mode,
            attachment_mode: req.attachment_mode,
            read_only: req.read_only,
        }
    }
}

impl VolumeStub {
    /// `<plugin>/<volume>/<usage>`: unique per usage of a volume on a node.
    pub fn key(&self) -> String {
        stub_key(
            &self.plugin_id,
            &self.volume_id,
            self.access_mode,
            self.attachment_mode,
            self.read_only,
        )
    }
}

/// The name of a usage: `<access>-<attachment>[-ro]`.
pub fn usage_name(access: AccessMode, attach: AttachmentMode, read_only: bool) -> String {
    format!(
        "{}-{}{}",
        access.as_str(),
        attach.as_str(),
        if read_only { "-ro" } else { "" }
    )
}

pub fn stub_key(
    plugin_id: &str,
    volume_id: &str,
    access: AccessMode,
    attach: AttachmentMode,
    read_only: bool,
) -> String {
    format!(
        "{plugin_id}/{volume_id}/{}",
        usage_name(access, attach, read_only)
    )
}

/// What the servers ask for to grow the filesystem of a volume published on
/// this node (`NodeExpandVolume`). `secrets` are passed to the plugin and
/// never logged (Debug redacts them).
#[derive(Clone)]
pub struct ExpandRequest {
    pub plugin_id: String,
    pub volume_id: String,
    pub external_id: String,
    /// The allocs whose claims put the volume on this node; the publish
    /// target of any of them (of any alloc using it when empty) is the
    /// `volume_path`.
    pub alloc_ids: Vec<String>,
    pub capacity_min: i64,
    pub capacity_max: i64,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    pub mount_options: CsiMountOptions,
    pub secrets: BTreeMap<String, String>,
}

impl std::fmt::Debug for ExpandRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpandRequest")
            .field("plugin_id", &self.plugin_id)
            .field("volume_id", &self.volume_id)
            .field("external_id", &self.external_id)
            .field("alloc_ids", &self.alloc_ids)
            .field("capacity_min", &self.capacity_min)
            .field("capacity_max", &self.capacity_max)
            .field("secrets", &"<redacted>")
            .finish_non_exhaustive()
    }
}
