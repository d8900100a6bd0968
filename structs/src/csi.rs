//! CSI volumes, their claims, and CSI plugins as the servers track them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::limits::{capacity_limit_text, too_large, MAX_VOLUME_CAPACITY_BYTES};
use crate::names::{check_name, quoted};
use crate::ValidationError;

/// The access modes of CSI, in Nomad's spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AccessMode {
    #[serde(rename = "single-node-reader-only")]
    SingleNodeReader,
    #[serde(rename = "single-node-writer")]
    SingleNodeWriter,
    #[serde(rename = "multi-node-reader-only")]
    MultiNodeReader,
    #[serde(rename = "multi-node-single-writer")]
    MultiNodeSingleWriter,
    #[serde(rename = "multi-node-multi-writer")]
    MultiNodeMultiWriter,
}

impl AccessMode {
    pub const ALL: [AccessMode; 5] = [
        AccessMode::SingleNodeReader,
        AccessMode::SingleNodeWriter,
        AccessMode::MultiNodeReader,
        AccessMode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            AccessMode::SingleNodeReader => "single-node-reader-only",
            AccessMode::SingleNodeWriter => "single-node-writer",
            AccessMode::MultiNodeReader => "multi-node-reader-only",
            AccessMode::MultiNodeSingleWriter => "multi-node-single-writer",
            AccessMode::MultiNodeMultiWriter => "multi-node-multi-writer",
        }
    }

    pub fn is_reader_only(&self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReader | AccessMode::MultiNodeReader
        )
    }

    pub fn is_single_node(&self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReader | AccessMode::SingleNodeWriter
        )
    }

    /// The claim mode this access mode implies.
    pub fn claim_mode(&self) -> ClaimMode {
        if self.is_reader_only() {
            ClaimMode::Read
        } else {
            ClaimMode::Write
        }
    }
}

impl std::fmt::Display for AccessMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AccessMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AccessMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown access_mode {s:?} (want one of {})",
                    AccessMode::ALL.map(|m| m.as_str()).join(", ")
                )
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AttachmentMode {
    #[serde(rename = "file-system")]
    FileSystem,
    #[serde(rename = "block-device")]
    BlockDevice,
}

impl AttachmentMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            AttachmentMode::FileSystem => "file-system",
            AttachmentMode::BlockDevice => "block-device",
        }
    }
}

impl std::fmt::Display for AttachmentMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AttachmentMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "file-system" => Ok(AttachmentMode::FileSystem),
            "block-device" => Ok(AttachmentMode::BlockDevice),
            other => Err(format!(
                "unknown attachment_mode {other:?} (want file-system or block-device)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimMode {
    Read,
    Write,
}

impl ClaimMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            ClaimMode::Read => "read",
            ClaimMode::Write => "write",
        }
    }
}

impl std::str::FromStr for ClaimMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read" => Ok(ClaimMode::Read),
            "write" => Ok(ClaimMode::Write),
            other => Err(format!("unknown claim mode {other:?} (want read or write)")),
        }
    }
}

/// One `capability` block of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VolumeCapability {
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
}

/// Where a claim stands on its way to being freed. The state is checkpointed
/// in the state store before each detach call, so a failed call is retried
/// from where it stopped; steps with no call between them share one write
/// (a claim with nothing to detach is freed in one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClaimState {
    #[default]
    Taken,
    NodeDetached,
    ControllerDetached,
    ReadyToFree,
}

impl ClaimState {
    pub fn as_str(&self) -> &'static str {
        match self {
            ClaimState::Taken => "taken",
            ClaimState::NodeDetached => "node-detached",
            ClaimState::ControllerDetached => "controller-detached",
            ClaimState::ReadyToFree => "ready-to-free",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CsiVolumeClaim {
    pub alloc_id: String,
    pub node_id: String,
    /// The storage provider's ID of the node (NodeGetInfo).
    #[serde(default)]
    pub external_node_id: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    pub attachment_mode: AttachmentMode,
    #[serde(default)]
    pub state: ClaimState,
    /// What ControllerPublishVolume returned, handed to the node plugin.
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    /// Set once the release has started (client unpublish or a reap).
    #[serde(default)]
    pub releasing: bool,
    /// Set (and persisted) before ControllerPublishVolume is sent for this
    /// claim, whatever its outcome: the release then makes sure
    /// ControllerUnpublishVolume is done, however the plugin's health looks.
    #[serde(default)]
    pub controller_published: bool,
    /// A write claim whose node was purged without `-force`: its tasks
    /// may still write, so the claim is kept (the volume watcher leaves
    /// it) until an operator frees it (`volume detach VOLUME NODE-ID`).
    #[serde(default)]
    pub kept_after_purge: bool,
}

/// A CSI volume. Its `Debug` shows how many secrets it has, never them.
#[derive(Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CsiVolume {
    pub id: String,
    #[serde(default)]
    pub name: String,
    /// The storage provider's ID of the volume.
    #[serde(default)]
    pub external_id: String,
    pub plugin_id: String,
    #[serde(default)]
    pub provider: String,
    #[serde(default)]
    pub capabilities: Vec<VolumeCapability>,
    #[serde(default)]
    pub capacity_min: Option<u64>,
    #[serde(default)]
    pub capacity_max: Option<u64>,
    #[serde(default)]
    pub capacity: u64,
    #[serde(default)]
    pub mount_options: crate::job::CsiMountOptions,
    /// Passed to the plugin; never returned by the API, never logged.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub context: BTreeMap<String, String>,
    /// Claims by alloc ID.
    #[serde(default)]
    pub read_claims: BTreeMap<String, CsiVolumeClaim>,
    #[serde(default)]
    pub write_claims: BTreeMap<String, CsiVolumeClaim>,
    /// The spec's `topology_request`: where the volume must (`required`)
    /// or should (`preferred`) be created.
    #[serde(default)]
    pub requested_topologies: CsiTopologyRequest,
    /// Where the volume can be used: any one of these topologies (the
    /// plugin's answer to `CreateVolume`, or the required topologies of a
    /// registered volume). Empty: from everywhere.
    #[serde(default)]
    pub accessible_topology: Vec<CsiTopology>,
    /// Create the volume from this snapshot (the plugin's snapshot ID).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub snapshot_id: String,
    /// Create the volume as a clone of this volume (the plugin's volume
    /// ID, as `external_id`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub clone_id: String,
    /// Whether a healthy node plugin exists for it; computed on read.
    #[serde(default)]
    pub schedulable: bool,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl std::fmt::Debug for CsiVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured so that a new field cannot be left out silently.
        let CsiVolume {
            id,
            name,
            external_id,
            plugin_id,
            provider,
            capabilities,
            capacity_min,
            capacity_max,
            capacity,
            mount_options,
            secrets,
            parameters,
            context,
            read_claims,
            write_claims,
            requested_topologies,
            accessible_topology,
            snapshot_id,
            clone_id,
            schedulable,
            create_index,
            modify_index,
        } = self;
        f.debug_struct("CsiVolume")
            .field("id", id)
            .field("name", name)
            .field("external_id", external_id)
            .field("plugin_id", plugin_id)
            .field("provider", provider)
            .field("capabilities", capabilities)
            .field("capacity_min", capacity_min)
            .field("capacity_max", capacity_max)
            .field("capacity", capacity)
            .field("mount_options", mount_options)
            .field("secrets", &format_args!("<{} redacted>", secrets.len()))
            .field("parameters", parameters)
            .field("context", context)
            .field("read_claims", read_claims)
            .field("write_claims", write_claims)
            .field("requested_topologies", requested_topologies)
            .field("accessible_topology", accessible_topology)
            .field("snapshot_id", snapshot_id)
            .field("clone_id", clone_id)
            .field("schedulable", schedulable)
            .field("create_index", create_index)
            .field("modify_index", modify_index)
            .finish()
    }
}

impl CsiVolume {
    /// The checks a volume passes before it is created or registered: its
    /// ID and plugin ID pass [`check_name`] (both become path components on
    /// nodes), its capacities are within
    /// [`MAX_VOLUME_CAPACITY_BYTES`]. `register` also needs the provider's
    /// ID.
    pub fn validate(&self, register: bool) -> Result<(), ValidationError> {
        let mut errs = Vec::new();
        if let Err(e) = check_name("volume ID", &self.id) {
            errs.push(format!("volume: {e}"));
        }
        let at = format!("volume {}", quoted(&self.id));
        if let Err(e) = check_name("plugin_id", &self.plugin_id) {
            errs.push(format!("{at}: {e}"));
        }
        if self.capabilities.is_empty() {
            errs.push(format!("{at}: at least one capability block is required"));
        }
        if register && self.external_id.is_empty() {
            errs.push(format!(
                "{at}: external_id is required to register a volume"
            ));
        }
        for (what, value) in [
            ("capacity_min", self.capacity_min),
            ("capacity_max", self.capacity_max),
            ("capacity", Some(self.capacity)),
        ] {
            if let Some(v) = value.filter(|&v| v > MAX_VOLUME_CAPACITY_BYTES) {
                errs.push(format!(
                    "{at}: {what} {}",
                    too_large(v, capacity_limit_text())
                ));
            }
        }
        if !self.snapshot_id.is_empty() && !self.clone_id.is_empty() {
            errs.push(format!(
                "{at}: snapshot_id and clone_id are exclusive: a volume is created from a snapshot or as a clone, not both"
            ));
        }
        // A topology without segments holds every node that has one.
        for (what, list) in [
            ("required", &self.requested_topologies.required),
            ("preferred", &self.requested_topologies.preferred),
        ] {
            if list.iter().any(|t| t.segments.is_empty()) {
                errs.push(format!(
                    "{at}: topology_request {what}: a topology needs at least one segment"
                ));
            }
        }
        if let (Some(min), Some(max)) = (self.capacity_min, self.capacity_max) {
            if min > max {
                errs.push(format!(
                    "{at}: capacity_min ({min}) is larger than capacity_max ({max})"
                ));
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ValidationError(errs))
        }
    }

    pub fn has_capability(&self, access: AccessMode, attach: AttachmentMode) -> bool {
        self.capabilities
            .iter()
            .any(|c| c.access_mode == access && c.attachment_mode == attach)
    }

    pub fn claims(&self) -> impl Iterator<Item = &CsiVolumeClaim> {
        self.read_claims.values().chain(self.write_claims.values())
    }

    pub fn claim_for(&self, alloc_id: &str) -> Option<&CsiVolumeClaim> {
        self.read_claims
            .get(alloc_id)
            .or_else(|| self.write_claims.get(alloc_id))
    }

    /// Why a new claim of this kind cannot be taken now, if it cannot.
    pub fn claim_conflict(
        &self,
        alloc_id: &str,
        node_id: &str,
        access: AccessMode,
        mode: ClaimMode,
    ) -> Option<String> {
        let others = |m: &BTreeMap<String, CsiVolumeClaim>| {
            m.values()
                .filter(|c| c.alloc_id != alloc_id)
                .cloned()
                .collect::<Vec<_>>()
        };
        let writers = others(&self.write_claims);
        let readers = others(&self.read_claims);
        match mode {
            ClaimMode::Write => {
                if access.is_reader_only() {
                    return Some(format!("access mode {access} does not allow a write claim"));
                }
                if access != AccessMode::MultiNodeMultiWriter && !writers.is_empty() {
                    return Some(format!(
                        "volume {:?} already has a writer (alloc {})",
                        self.id, writers[0].alloc_id
                    ));
                }
                if access.is_single_node() {
                    if let Some(r) = readers.iter().find(|c| c.node_id != node_id) {
                        return Some(format!(
                            "volume {:?} is in use on node {} (alloc {}) and access mode {access} allows one node",
                            self.id, r.node_id, r.alloc_id
                        ));
                    }
                }
            }
            ClaimMode::Read => {
                if access.is_single_node() {
                    if let Some(c) = writers
                        .iter()
                        .chain(readers.iter())
                        .find(|c| c.node_id != node_id)
                    {
                        return Some(format!(
                            "volume {:?} is in use on node {} (alloc {}) and access mode {access} allows one node",
                            self.id, c.node_id, c.alloc_id
                        ));
                    }
                }
            }
        }
        None
    }
}

/// What a granted claim hands the node: enough to stage and publish the
/// volume. The servers answer a claim with it; the client's CSI hook mounts
/// with it. `secrets` go to the node plugin only: `Debug` redacts them.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct ClaimGrant {
    pub volume_id: String,
    pub external_id: String,
    pub plugin_id: String,
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    /// The job's mount options laid over the volume's.
    pub mount_options: crate::job::CsiMountOptions,
}

impl std::fmt::Debug for ClaimGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimGrant")
            .field("volume_id", &self.volume_id)
            .field("external_id", &self.external_id)
            .field("plugin_id", &self.plugin_id)
            .field("publish_context", &self.publish_context)
            .field("volume_context", &self.volume_context)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .field("mount_options", &self.mount_options)
            .finish()
    }
}

/// A plugin's instance on one node, as fingerprinted there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiInfo {
    pub plugin_id: String,
    pub alloc_id: String,
    pub provider: String,
    pub version: String,
    pub healthy: bool,
    #[serde(default)]
    pub health_description: String,
    #[serde(default)]
    pub requires_controller_publish: bool,
    #[serde(default)]
    pub supports_stage_unstage: bool,
    #[serde(default)]
    pub supports_create_delete: bool,
    /// Node plugins: the provider's ID of the node.
    #[serde(default)]
    pub external_node_id: String,
    #[serde(default)]
    pub max_volumes: u64,
    /// Node plugins: `GET_VOLUME_STATS` and `VOLUME_CONDITION`
    /// (NodeGetCapabilities); known on the node only.
    #[serde(default)]
    pub supports_volume_stats: bool,
    #[serde(default)]
    pub supports_volume_condition: bool,
    /// Node plugins: where this node is, in the provider's terms
    /// (NodeGetInfo `accessible_topology`); `None` when it says nothing.
    #[serde(default)]
    pub accessible_topology: Option<CsiTopology>,
    /// `EXPAND_VOLUME`: of the controller service for a controller entry,
    /// of the node service for a node entry.
    #[serde(default)]
    pub supports_expand: bool,
    /// Controllers: `CREATE_DELETE_SNAPSHOT`.
    #[serde(default)]
    pub supports_snapshots: bool,
}

/// A CSI topology: segments such as `topology.hostpath.csi/node = "n1"` or
/// `zone = "a"`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct CsiTopology {
    #[serde(default)]
    pub segments: BTreeMap<String, String>,
}

impl CsiTopology {
    pub fn new(segments: BTreeMap<String, String>) -> CsiTopology {
        CsiTopology { segments }
    }

    /// Whether a node at `node` is in this topology: every segment of this
    /// one is on the node with the same value (the node may have more).
    pub fn contains(&self, node: &CsiTopology) -> bool {
        self.segments
            .iter()
            .all(|(k, v)| node.segments.get(k) == Some(v))
    }
}

impl std::fmt::Display for CsiTopology {
    /// `{zone=a,rack=r1}`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.segments.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{k}={v}")?;
        }
        f.write_str("}")
    }
}

/// Topologies shown in one line: `{zone=a} or {zone=b}`; `-` for none.
pub fn topologies_text(topologies: &[CsiTopology]) -> String {
    if topologies.is_empty() {
        return "-".to_string();
    }
    topologies
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(" or ")
}

/// A volume spec's `topology_request`, in Nomad's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiTopologyRequest {
    /// The volume must be reachable from one of these.
    #[serde(default)]
    pub required: Vec<CsiTopology>,
    /// The plugin should prefer these, in order.
    #[serde(default)]
    pub preferred: Vec<CsiTopology>,
}

impl CsiTopologyRequest {
    pub fn is_empty(&self) -> bool {
        self.required.is_empty() && self.preferred.is_empty()
    }
}

impl CsiVolume {
    /// Whether a node whose node plugin for this volume is at `node` may
    /// use it: the volume has no accessible topology, or the node is in
    /// one of them. A node plugin without a topology is in none.
    pub fn reachable_from(&self, node: Option<&CsiTopology>) -> bool {
        if self.accessible_topology.is_empty() {
            return true;
        }
        node.is_some_and(|n| self.accessible_topology.iter().any(|t| t.contains(n)))
    }
}

/// A snapshot of a volume, as its controller plugin reports it. The name
/// is known only in the answer to the create that made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiSnapshot {
    /// The plugin's ID of the snapshot.
    pub id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub plugin_id: String,
    /// The berth volume it was taken of, when berth knows that volume.
    #[serde(default)]
    pub source_volume_id: String,
    /// The plugin's ID of that volume.
    #[serde(default)]
    pub external_source_volume_id: String,
    #[serde(default)]
    pub size_bytes: u64,
    /// Unix milliseconds; 0 when the plugin did not say.
    #[serde(default)]
    pub create_time_ms: i64,
    #[serde(default)]
    pub ready_to_use: bool,
}

/// A plugin across the cluster, derived from node fingerprints and the jobs
/// that run it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiPlugin {
    pub id: String,
    pub provider: String,
    pub version: String,
    /// A controller must publish a volume to a node before the node can
    /// mount it (a controller with PUBLISH_UNPUBLISH_VOLUME), as Nomad
    /// means it: not merely that the plugin has a controller.
    pub controller_required: bool,
    pub controllers_healthy: u32,
    pub controllers_expected: u32,
    pub nodes_healthy: u32,
    pub nodes_expected: u32,
    /// By node ID.
    pub controllers: BTreeMap<String, CsiInfo>,
    pub nodes: BTreeMap<String, CsiInfo>,
    pub create_index: u64,
    pub modify_index: u64,
}

/// What a node plugin said of a volume mounted for an alloc
/// (`NodeGetVolumeStats`), as the node last collected it. Figures the
/// plugin did not give are `None`; when the call failed, `error` says why
/// and the figures are those of the last success, if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiVolumeStats {
    /// The volume (berth's ID) and its plugin.
    #[serde(default)]
    pub volume_id: String,
    #[serde(default)]
    pub plugin_id: String,
    #[serde(default)]
    pub bytes_total: Option<u64>,
    #[serde(default)]
    pub bytes_used: Option<u64>,
    #[serde(default)]
    pub bytes_available: Option<u64>,
    #[serde(default)]
    pub inodes_total: Option<u64>,
    #[serde(default)]
    pub inodes_used: Option<u64>,
    #[serde(default)]
    pub inodes_available: Option<u64>,
    /// The plugin's view of the volume's health (`VOLUME_CONDITION`);
    /// `None` when the plugin does not report it.
    #[serde(default)]
    pub condition: Option<CsiVolumeCondition>,
    /// Why the stats could not be collected in the last round.
    #[serde(default)]
    pub error: Option<String>,
    /// Unix milliseconds.
    #[serde(default)]
    pub collected_at_ms: i64,
}

/// A volume's condition as its node plugin reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiVolumeCondition {
    pub abnormal: bool,
    #[serde(default)]
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(alloc: &str, node: &str, mode: ClaimMode, access: AccessMode) -> CsiVolumeClaim {
        CsiVolumeClaim {
            alloc_id: alloc.into(),
            node_id: node.into(),
            external_node_id: String::new(),
            mode,
            access_mode: access,
            attachment_mode: AttachmentMode::FileSystem,
            state: ClaimState::Taken,
            publish_context: BTreeMap::new(),
            releasing: false,
            controller_published: false,
            kept_after_purge: false,
        }
    }

    #[test]
    fn debug_of_a_volume_redacts_its_secrets() {
        let v = CsiVolume {
            id: "data".into(),
            plugin_id: "hostpath".into(),
            secrets: [
                ("token".to_string(), "s3cret-value".to_string()),
                ("user".to_string(), "admin-name".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        for shown in [format!("{v:?}"), format!("{v:#?}")] {
            assert!(!shown.contains("s3cret-value"), "{shown}");
            assert!(!shown.contains("admin-name"), "{shown}");
            assert!(!shown.contains("token"), "secret keys too: {shown}");
            assert!(shown.contains("<2 redacted>"), "{shown}");
            assert!(shown.contains("hostpath"), "{shown}");
        }
        // Inside a containing value (a state change, a vector) as well.
        let shown = format!("{:?}", Some(vec![v]));
        assert!(!shown.contains("s3cret-value"), "{shown}");
    }

    #[test]
    fn single_writer_refuses_second_writer() {
        let mut v = CsiVolume {
            id: "data".into(),
            ..Default::default()
        };
        let a = AccessMode::SingleNodeWriter;
        assert!(v.claim_conflict("a1", "n1", a, ClaimMode::Write).is_none());
        v.write_claims
            .insert("a1".into(), claim("a1", "n1", ClaimMode::Write, a));
        assert!(v.claim_conflict("a1", "n1", a, ClaimMode::Write).is_none());
        assert!(v.claim_conflict("a2", "n1", a, ClaimMode::Write).is_some());
        assert!(v
            .claim_conflict("a3", "n2", AccessMode::SingleNodeReader, ClaimMode::Read)
            .is_some());
        assert!(v
            .claim_conflict("a3", "n1", AccessMode::SingleNodeReader, ClaimMode::Read)
            .is_none());
    }

    #[test]
    fn debug_of_a_claim_grant_redacts_its_secrets() {
        let g = ClaimGrant {
            secrets: [("password".to_string(), "hunter2".to_string())].into(),
            ..Default::default()
        };
        let s = format!("{g:?} {g:#?}");
        assert!(!s.contains("hunter2") && !s.contains("password"), "{s}");
        assert!(s.contains("<1 redacted>"), "{s}");
    }

    #[test]
    fn a_node_is_in_a_topology_when_it_has_every_segment_of_it() {
        let t = |pairs: &[(&str, &str)]| {
            CsiTopology::new(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let zone_a = t(&[("zone", "a")]);
        assert!(zone_a.contains(&t(&[("zone", "a"), ("rack", "r1")])));
        assert!(!zone_a.contains(&t(&[("zone", "b")])));
        assert!(!t(&[("zone", "a"), ("rack", "r1")]).contains(&zone_a));
        assert_eq!(
            t(&[("zone", "a"), ("rack", "r1")]).to_string(),
            "{rack=r1,zone=a}"
        );

        let mut v = CsiVolume::default();
        assert!(
            v.reachable_from(None),
            "no topology: reachable from anywhere"
        );
        v.accessible_topology = vec![zone_a.clone(), t(&[("zone", "c")])];
        assert!(v.reachable_from(Some(&t(&[("zone", "c")]))));
        assert!(!v.reachable_from(Some(&t(&[("zone", "b")]))));
        assert!(
            !v.reachable_from(None),
            "a node without a topology is in none"
        );
        assert_eq!(
            topologies_text(&v.accessible_topology),
            "{zone=a} or {zone=c}"
        );
        assert_eq!(topologies_text(&[]), "-");

        // A requested topology without segments is refused, naming it.
        let mut asked = CsiVolume {
            id: "v".into(),
            plugin_id: "p".into(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        asked.requested_topologies.required = vec![zone_a.clone()];
        asked
            .validate(false)
            .expect("a topology with a segment is valid");
        asked.requested_topologies.preferred = vec![CsiTopology::default()];
        let err = asked.validate(false).unwrap_err().to_string();
        assert!(
            err.contains("topology_request preferred: a topology needs at least one segment"),
            "{err}"
        );

        // Records from before topologies decode.
        let old: CsiVolume = serde_json::from_str(r#"{"id":"v","plugin_id":"p"}"#).expect("decode");
        assert!(old.accessible_topology.is_empty() && old.requested_topologies.is_empty());
        let info: CsiInfo = serde_json::from_str(
            r#"{"plugin_id":"p","alloc_id":"a","provider":"x","version":"1","healthy":true}"#,
        )
        .expect("decode");
        assert_eq!(info.accessible_topology, None);
    }

    #[test]
    fn access_modes_round_trip_their_names() {
        for m in AccessMode::ALL {
            assert_eq!(m.as_str().parse::<AccessMode>().unwrap(), m);
        }
        assert!("single-node".parse::<AccessMode>().is_err());
    }
}
