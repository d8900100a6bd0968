//! CSI volumes on the servers: create, register, deregister, delete and
//! read (here), claims and their release (`claims.rs`), and the volume
//! watcher that frees claims nobody released (`watcher.rs`).
//!
//! Every operation that changes a volume's claims or talks to its plugin
//! holds the volume's lock, so a claim, an unpublish and a delete of the
//! same volume never interleave. Secrets are passed to plugins and never
//! returned by a read or logged.

mod claims;
mod expand;
mod snapshots;
mod watcher;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use berth_proto::berth::v1 as pb;
use berth_structs::{topologies_text, CsiTopology, CsiVolume, Node, NodeStatus};
use tokio::sync::OwnedMutexGuard;

pub use claims::{ClaimGrant, ReleaseOrigin, VolumeClaimRequest, FORCED_RELEASE_EVENT};
pub use snapshots::SnapshotRequest;
pub(crate) use watcher::{ReleaseClaim, VolumeWatcher};

use crate::error::ServerError;
use crate::nodes::resolve_node;
use crate::plugins::controller_nodes;
use crate::server::Server;
use crate::state::{Change, Tables};

/// What `volume detach` or a forced deregister did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VolumeRelease {
    pub volume_id: String,
    /// The node whose claims were released (`volume detach`; empty for a
    /// deregister), and its name.
    pub node_id: String,
    pub node_name: String,
    /// The allocs whose claims were freed.
    pub released: Vec<String>,
    /// What could not be done on the way: a node that could not unmount, a
    /// controller that could not detach. The claims were freed anyway.
    pub warnings: Vec<String>,
}

/// One async lock per volume ID. An entry lives only while someone holds
/// or waits for its lock, so IDs that come and go (unknown ones included)
/// leave nothing behind.
#[derive(Default)]
pub(crate) struct VolumeLocks {
    locks: Mutex<HashMap<String, LockEntry>>,
}

struct LockEntry {
    mutex: Arc<tokio::sync::Mutex<()>>,
    /// Holders and waiters; counted under the map's mutex.
    users: usize,
}

/// A held volume lock; dropping it unlocks, and removes the volume's entry
/// when nobody else holds or waits for it.
pub(crate) struct VolumeLockGuard<'a> {
    // Field order matters: the lock is given back before the user is
    // counted out, so an entry is never removed while its lock is held.
    _guard: OwnedMutexGuard<()>,
    _user: LockUser<'a>,
}

/// One holder or waiter of a volume's lock. Dropped also when a waiter is
/// cancelled.
struct LockUser<'a> {
    locks: &'a VolumeLocks,
    volume_id: String,
}

impl Drop for LockUser<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.map();
        if let Some(e) = map.get_mut(&self.volume_id) {
            e.users = e.users.saturating_sub(1);
            if e.users == 0 {
                map.remove(&self.volume_id);
            }
        }
    }
}

impl VolumeLocks {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, LockEntry>> {
        self.locks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn lock(&self, volume_id: &str) -> VolumeLockGuard<'_> {
        let (user, mutex) = {
            let mut map = self.map();
            let e = map
                .entry(volume_id.to_string())
                .or_insert_with(|| LockEntry {
                    mutex: Arc::default(),
                    users: 0,
                });
            e.users += 1;
            let user = LockUser {
                locks: self,
                volume_id: volume_id.to_string(),
            };
            (user, e.mutex.clone())
        };
        let guard = mutex.lock_owned().await;
        VolumeLockGuard {
            _guard: guard,
            _user: user,
        }
    }

    /// How many volumes have a lock entry (held or waited for).
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

/// Whether `alloc_id` may still run on its node: it exists and its client
/// has not reported it terminal (asked to stop is not enough: its task may
/// still use the volume).
fn alloc_live(t: &Tables, alloc_id: &str) -> bool {
    t.allocs
        .get(alloc_id)
        .is_some_and(|a| !a.client_status.is_terminal())
}

/// Where each plugin has a healthy node plugin on a ready node: the
/// distinct topologies of those node plugins (`None`: one without a
/// topology), by plugin ID; of `plugin_id` only when given (then from the
/// nodes that run it alone). One pass over the nodes serves every volume.
type NodePluginPlaces<'a> = HashMap<&'a str, BTreeSet<Option<&'a CsiTopology>>>;

fn node_plugin_places<'a>(t: &'a Tables, plugin_id: Option<&str>) -> NodePluginPlaces<'a> {
    let mut places: NodePluginPlaces<'a> = HashMap::new();
    let nodes: Box<dyn Iterator<Item = &'a Node>> = match plugin_id {
        Some(id) => Box::new(t.nodes_with_plugin(id)),
        None => Box::new(t.nodes.values()),
    };
    for n in nodes.filter(|n| n.status == NodeStatus::Ready) {
        for (id, p) in &n.csi_node_plugins {
            if p.healthy && plugin_id.is_none_or(|only| only == id) {
                places
                    .entry(id.as_str())
                    .or_default()
                    .insert(p.accessible_topology.as_ref());
            }
        }
    }
    places
}

/// A volume as the API shows it: secrets cleared, `schedulable` computed
/// (a ready node with a healthy node plugin from which it is reachable).
pub(crate) fn public_view(v: &CsiVolume, t: &Tables) -> CsiVolume {
    public_view_in(v, &node_plugin_places(t, Some(&v.plugin_id)))
}

fn public_view_in(v: &CsiVolume, places: &NodePluginPlaces<'_>) -> CsiVolume {
    let mut v = v.clone();
    v.secrets.clear();
    v.schedulable = places
        .get(v.plugin_id.as_str())
        .is_some_and(|at| at.iter().any(|here| v.reachable_from(*here)));
    v
}

/// Topologies as the agent protocol carries them.
pub(crate) fn topologies_pb(topologies: &[CsiTopology]) -> Vec<pb::Topology> {
    topologies
        .iter()
        .map(|t| pb::Topology {
            segments: t.segments.clone().into_iter().collect(),
        })
        .collect()
}

pub(crate) fn capability_pb(
    access: berth_structs::AccessMode,
    attach: berth_structs::AttachmentMode,
    mount: &berth_structs::CsiMountOptions,
) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_mode: access.as_str().to_string(),
        attachment_mode: attach.as_str().to_string(),
        fs_type: mount.fs_type.clone(),
        mount_flags: mount.mount_flags.clone(),
    }
}

impl Server {
    /// A ready, connected node running a healthy controller of `plugin_id`.
    pub(crate) fn controller_client(&self, plugin_id: &str) -> Result<String, ServerError> {
        self.controller_client_in(plugin_id, &[])
    }

    /// [`Server::controller_client`], preferring a node whose node plugin
    /// is in one of `required` (a controller there can create a volume
    /// reachable from it); any other one when none is.
    pub(crate) fn controller_client_in(
        &self,
        plugin_id: &str,
        required: &[CsiTopology],
    ) -> Result<String, ServerError> {
        let (candidates, in_topology) = self.store.read(|t| {
            let candidates = controller_nodes(t, plugin_id);
            let in_topology: Vec<String> = candidates
                .iter()
                .filter(|id| {
                    let here = t
                        .nodes
                        .get(id.as_str())
                        .and_then(|n| n.csi_node_plugins.get(plugin_id))
                        .and_then(|p| p.accessible_topology.as_ref());
                    here.is_some_and(|here| required.iter().any(|r| r.contains(here)))
                })
                .cloned()
                .collect();
            (candidates, in_topology)
        });
        in_topology
            .into_iter()
            .chain(candidates)
            .find(|n| self.calls.is_connected(n))
            .ok_or_else(|| {
                ServerError::Unavailable(format!(
                    "no connected client runs a healthy controller of CSI plugin {plugin_id:?}"
                ))
            })
    }

    /// How many volumes have a lock entry now (held or waited for); zero
    /// whenever no volume operation is running.
    pub fn volume_locks_in_use(&self) -> usize {
        self.volume_locks.len()
    }

    pub fn volumes(&self) -> Vec<CsiVolume> {
        self.store.read(|t| {
            let places = node_plugin_places(t, None);
            t.volumes
                .values()
                .map(|v| public_view_in(v, &places))
                .collect()
        })
    }

    /// A page of the volumes, as [`Self::volumes`] shows them.
    pub fn volumes_page(&self, page: crate::Page<'_>) -> crate::Paged<CsiVolume> {
        self.store.read(|t| {
            let places = node_plugin_places(t, None);
            page.of(&t.volumes, |v| public_view_in(v, &places))
        })
    }

    /// A volume by ID, or by a unique ID prefix.
    pub fn volume(&self, id: &str) -> Result<CsiVolume, ServerError> {
        self.store.read(|t| {
            crate::prefix::resolve(&t.volumes, id, crate::prefix::VOLUME, crate::prefix::key)?
                .map(|(_, v)| public_view(v, t))
                .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))
        })
    }

    /// The ID of the volume `id` names: itself, or the one volume whose ID
    /// starts with it.
    pub fn resolve_volume_id(&self, id: &str) -> Result<String, ServerError> {
        self.store.read(|t| {
            crate::prefix::resolve(&t.volumes, id, crate::prefix::VOLUME, crate::prefix::key)?
                .map(|(k, _)| k.clone())
                .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))
        })
    }

    /// Create a volume through a controller plugin (`CreateVolume`) and
    /// register it.
    pub async fn create_volume(&self, mut vol: CsiVolume) -> Result<CsiVolume, ServerError> {
        vol.validate(false)?;
        let _lock = self.volume_locks.lock(&vol.id).await;
        if let Some(old) = self.store.read(|t| t.volumes.get(&vol.id).cloned()) {
            // An existing volume: unchanged, grown, or a conflict.
            self.recreate_volume_locked(&old, &vol).await?;
            drop(_lock);
            return self.volume(&vol.id);
        }
        let controller =
            self.controller_client_in(&vol.plugin_id, &vol.requested_topologies.required)?;
        let supports = self.store.read(|t| {
            t.nodes
                .get(&controller)
                .and_then(|n| n.csi_controller_plugins.get(&vol.plugin_id))
                .is_some_and(|c| c.supports_create_delete)
        });
        if !supports {
            return Err(ServerError::BadRequest(format!(
                "CSI plugin {:?} does not support creating volumes",
                vol.plugin_id
            )));
        }
        let call = pb::server_call::Call::CreateVolume(pb::CreateVolume {
            plugin_id: vol.plugin_id.clone(),
            name: if vol.name.is_empty() {
                vol.id.clone()
            } else {
                vol.name.clone()
            },
            capacity_min: i64::try_from(vol.capacity_min.unwrap_or(0)).unwrap_or(i64::MAX),
            capacity_max: i64::try_from(vol.capacity_max.unwrap_or(0)).unwrap_or(i64::MAX),
            capabilities: vol
                .capabilities
                .iter()
                .map(|c| capability_pb(c.access_mode, c.attachment_mode, &vol.mount_options))
                .collect(),
            parameters: vol.parameters.clone().into_iter().collect(),
            secrets: vol.secrets.clone().into_iter().collect(),
            snapshot_id: vol.snapshot_id.clone(),
            clone_id: vol.clone_id.clone(),
            requisite: topologies_pb(&vol.requested_topologies.required),
            // CSI wants `preferred` within `requisite`: without preferred
            // topologies, the required ones are the preference.
            preferred: if vol.requested_topologies.preferred.is_empty() {
                topologies_pb(&vol.requested_topologies.required)
            } else {
                topologies_pb(&vol.requested_topologies.preferred)
            },
        });
        let reply = self
            .calls
            .call(&controller, call, self.config.client_call_timeout)
            .await
            .map_err(|e| match e {
                ServerError::Remote {
                    code: tonic::Code::ResourceExhausted,
                    message,
                } if !vol.requested_topologies.is_empty() => ServerError::Remote {
                    code: tonic::Code::ResourceExhausted,
                    message: format!(
                        "CSI plugin {:?} cannot create volume {:?} in the requested topology \
                         (required {}, preferred {}): {message}",
                        vol.plugin_id,
                        vol.id,
                        topologies_text(&vol.requested_topologies.required),
                        topologies_text(&vol.requested_topologies.preferred),
                    ),
                },
                e => e,
            })?;
        let pb::call_reply::Result::CreateVolume(created) = reply else {
            return Err(ServerError::Internal(format!(
                "node {controller} answered CreateVolume with another kind of reply"
            )));
        };
        vol.external_id = created.external_id;
        vol.capacity = u64::try_from(created.capacity_bytes).unwrap_or(0);
        vol.context = created.volume_context.into_iter().collect();
        vol.accessible_topology = created
            .accessible_topology
            .into_iter()
            .filter(|t| !t.segments.is_empty())
            .map(|t| CsiTopology::new(t.segments.into_iter().collect()))
            .collect();
        vol.read_claims.clear();
        vol.write_claims.clear();
        if vol.provider.is_empty() {
            vol.provider = self.plugin_provider(&vol.plugin_id);
        }
        let stored = vol.clone();
        self.store.write(|_, changes| {
            changes.push(Change::PutVolume(stored));
            Ok::<_, ServerError>(())
        })?;
        tracing::info!(volume_id = %vol.id, plugin_id = %vol.plugin_id, external_id = %vol.external_id, "volume created");
        drop(_lock);
        self.evaluate_blocked().await;
        self.volume(&vol.id)
    }

    fn plugin_provider(&self, plugin_id: &str) -> String {
        self.store.read(|t| {
            t.nodes
                .values()
                .flat_map(|n| {
                    n.csi_controller_plugins
                        .get(plugin_id)
                        .into_iter()
                        .chain(n.csi_node_plugins.get(plugin_id))
                })
                .map(|i| i.provider.clone())
                .find(|p| !p.is_empty())
                .unwrap_or_default()
        })
    }

    /// Register an existing volume. Re-registering may change it, but not
    /// in a way that contradicts its claims.
    pub async fn register_volume(&self, mut vol: CsiVolume) -> Result<CsiVolume, ServerError> {
        vol.validate(true)?;
        if self.plugin(&vol.plugin_id).is_err() {
            return Err(ServerError::BadRequest(format!(
                "no CSI plugin named {:?}: no node has fingerprinted it and no job runs it; \
                 run the plugin's job first (`berth job run`), wait until `berth plugin status {}` \
                 lists it, then register the volume",
                vol.plugin_id, vol.plugin_id
            )));
        }
        let provider = self.plugin_provider(&vol.plugin_id);
        let _lock = self.volume_locks.lock(&vol.id).await;
        self.store.write(|t, changes| {
            match t.volumes.get(&vol.id) {
                Some(old) => {
                    let claimed = old.claims().count();
                    if claimed > 0 {
                        if old.plugin_id != vol.plugin_id || old.external_id != vol.external_id {
                            return Err(ServerError::Conflict(format!(
                                "volume {:?} has {claimed} claims; its plugin_id and external_id cannot change",
                                vol.id
                            )));
                        }
                        if let Some(c) = old
                            .claims()
                            .find(|c| !vol.has_capability(c.access_mode, c.attachment_mode))
                        {
                            return Err(ServerError::Conflict(format!(
                                "volume {:?} is claimed as {}/{} by alloc {}; that capability cannot be removed",
                                vol.id, c.access_mode, c.attachment_mode, c.alloc_id
                            )));
                        }
                    }
                    vol.read_claims = old.read_claims.clone();
                    vol.write_claims = old.write_claims.clone();
                }
                None => {
                    vol.read_claims.clear();
                    vol.write_claims.clear();
                }
            }
            if vol.provider.is_empty() {
                vol.provider = provider;
            }
            // No plugin answers a registration: the volume is reachable
            // from where the operator requires it.
            vol.accessible_topology = vol.requested_topologies.required.clone();
            vol.schedulable = false;
            changes.push(Change::PutVolume(vol.clone()));
            Ok(())
        })?;
        tracing::info!(volume_id = %vol.id, plugin_id = %vol.plugin_id, "volume registered");
        drop(_lock);
        self.evaluate_blocked().await;
        self.volume(&vol.id)
    }

    /// Deregister a volume (the storage is kept). A claimed volume is
    /// refused unless `force`; with `force` the claims of allocs that are
    /// terminal (or gone) are released first (node and controller detach),
    /// and freed even when a detach fails (reported in the answer's
    /// warnings). Claims of live allocs are refused either way.
    pub async fn deregister_volume(
        &self,
        id: &str,
        force: bool,
    ) -> Result<VolumeRelease, ServerError> {
        let _lock = self.volume_locks.lock(id).await;
        let claims: Vec<(String, bool)> = self
            .store
            .read(|t| {
                t.volumes.get(id).map(|v| {
                    v.claims()
                        .map(|c| (c.alloc_id.clone(), alloc_live(t, &c.alloc_id)))
                        .collect()
                })
            })
            .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))?;
        let mut report = VolumeRelease {
            volume_id: id.to_string(),
            ..Default::default()
        };
        if !claims.is_empty() {
            let ids: Vec<&str> = claims.iter().map(|(a, _)| a.as_str()).collect();
            if !force {
                return Err(ServerError::Conflict(format!(
                    "volume {id:?} has {} claims (allocs {}); stop them first or deregister with force",
                    claims.len(),
                    ids.join(", ")
                )));
            }
            let live: Vec<&str> = claims
                .iter()
                .filter(|(_, live)| *live)
                .map(|(a, _)| a.as_str())
                .collect();
            if !live.is_empty() {
                return Err(ServerError::Conflict(format!(
                    "volume {id:?} is in use by allocs that have not stopped on their nodes ({}); stop them first",
                    live.join(", ")
                )));
            }
            for (alloc_id, _) in &claims {
                self.release_claim_locked(
                    id,
                    alloc_id,
                    &ReleaseOrigin::Operator,
                    Some(&mut report.warnings),
                )
                .await?;
                report.released.push(alloc_id.clone());
            }
        }
        self.store.write(|_, changes| {
            changes.push(Change::DeleteVolume(id.to_string()));
            Ok::<_, ServerError>(())
        })?;
        tracing::info!(
            volume_id = id,
            force,
            released = report.released.len(),
            warnings = report.warnings.len(),
            "volume deregistered"
        );
        drop(_lock);
        Ok(report)
    }

    /// Delete a volume through its controller plugin (`DeleteVolume`) and
    /// deregister it. A claimed volume is refused.
    pub async fn delete_volume(&self, id: &str) -> Result<(), ServerError> {
        let _lock = self.volume_locks.lock(id).await;
        let vol = self
            .store
            .read(|t| t.volumes.get(id).cloned())
            .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))?;
        let claims = vol.claims().count();
        if claims > 0 {
            return Err(ServerError::Conflict(format!(
                "volume {id:?} has {claims} claims; it cannot be deleted while in use"
            )));
        }
        let controller = self.controller_client(&vol.plugin_id)?;
        let call = pb::server_call::Call::DeleteVolume(pb::DeleteVolume {
            plugin_id: vol.plugin_id.clone(),
            external_id: vol.external_id.clone(),
            secrets: vol.secrets.clone().into_iter().collect(),
        });
        self.calls
            .call(&controller, call, self.config.client_call_timeout)
            .await?;
        self.store.write(|_, changes| {
            changes.push(Change::DeleteVolume(id.to_string()));
            Ok::<_, ServerError>(())
        })?;
        tracing::info!(volume_id = id, plugin_id = %vol.plugin_id, "volume deleted");
        drop(_lock);
        Ok(())
    }

    /// Release the claims of `volume_id` held on `node` (a node ID, name
    /// or unique ID prefix) by allocs that are terminal (or gone) — `volume
    /// detach`. The node is told to unmount; when it cannot (or cannot be
    /// reached), the claims are freed anyway and what failed is in the
    /// answer's warnings and a node event. A claim of a live alloc is
    /// refused. A node holding no claim of the volume is not an error: the
    /// answer releases nothing.
    pub async fn detach_volume(
        &self,
        volume_id: &str,
        node: &str,
    ) -> Result<VolumeRelease, ServerError> {
        let (node_id, node_name, claims) = self.store.read(|t| {
            let v = t
                .volumes
                .get(volume_id)
                .ok_or_else(|| ServerError::not_found(format!("volume {volume_id:?} not found")))?;
            // A claim may name a node that is gone (purged): its exact ID
            // still counts.
            let (node_id, node_name) = if v.claims().any(|c| c.node_id == node) {
                let name = t
                    .nodes
                    .get(node)
                    .map(|n| n.name.clone())
                    .unwrap_or_default();
                (node.to_string(), name)
            } else {
                let n = resolve_node(t, node)?;
                (n.id.clone(), n.name.clone())
            };
            let claims: Vec<(String, bool)> = v
                .claims()
                .filter(|c| c.node_id == node_id)
                .map(|c| (c.alloc_id.clone(), alloc_live(t, &c.alloc_id)))
                .collect();
            Ok::<_, ServerError>((node_id, node_name, claims))
        })?;
        if let Some((alloc, _)) = claims.iter().find(|(_, live)| *live) {
            return Err(ServerError::Conflict(format!(
                "volume {volume_id:?} is in use on node {node_id} by alloc {alloc}, which has not stopped on its node; stop it first"
            )));
        }
        let mut report = VolumeRelease {
            volume_id: volume_id.to_string(),
            node_id,
            node_name,
            ..Default::default()
        };
        let mut freed = false;
        for (alloc_id, _) in claims {
            let _lock = self.volume_locks.lock(volume_id).await;
            freed |= self
                .release_claim_locked(
                    volume_id,
                    &alloc_id,
                    &ReleaseOrigin::Operator,
                    Some(&mut report.warnings),
                )
                .await?;
            report.released.push(alloc_id);
        }
        tracing::info!(volume_id, node_id = %report.node_id, released = report.released.len(), warnings = report.warnings.len(), "volume detached");
        if freed {
            self.evaluate_blocked().await;
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_volume_is_schedulable_where_a_ready_node_has_a_healthy_plugin_that_reaches_it() {
        let zone = |z: &str| CsiTopology::new([("zone".to_string(), z.to_string())].into());
        let node = |id: &str, status, healthy, at: Option<CsiTopology>| berth_structs::Node {
            id: id.into(),
            status,
            csi_node_plugins: [(
                "hp".to_string(),
                berth_structs::CsiInfo {
                    plugin_id: "hp".into(),
                    healthy,
                    accessible_topology: at,
                    ..Default::default()
                },
            )]
            .into(),
            ..Default::default()
        };
        let vol = |id: &str, plugin: &str, at: Vec<CsiTopology>| CsiVolume {
            id: id.into(),
            plugin_id: plugin.into(),
            accessible_topology: at,
            secrets: [("token".to_string(), "s3cret".to_string())].into(),
            ..Default::default()
        };
        let t = Tables {
            nodes: [
                node("a", NodeStatus::Ready, true, Some(zone("a"))),
                node("b-down", NodeStatus::Down, true, Some(zone("b"))),
                node("c-sick", NodeStatus::Ready, false, Some(zone("c"))),
                node("none", NodeStatus::Ready, true, None),
            ]
            .into_iter()
            .map(|n| (n.id.clone(), n))
            .collect(),
            volumes: [
                vol("anywhere", "hp", vec![]),
                vol("in-a", "hp", vec![zone("a")]),
                vol("in-b-or-c", "hp", vec![zone("b"), zone("c")]),
                vol("other-plugin", "nfs", vec![]),
            ]
            .into_iter()
            .map(|v| (v.id.clone(), v))
            .collect(),
            ..Default::default()
        }
        .with_indexes();
        let places = node_plugin_places(&t, None);
        for (id, want) in [
            ("anywhere", true),
            ("in-a", true),
            ("in-b-or-c", false),
            ("other-plugin", false),
        ] {
            let v = &t.volumes[id];
            let listed = public_view_in(v, &places);
            let single = public_view(v, &t);
            assert_eq!(listed.schedulable, want, "{id} listed");
            assert_eq!(single.schedulable, want, "{id} alone");
            assert!(listed.secrets.is_empty() && single.secrets.is_empty());
        }
    }

    #[tokio::test]
    async fn volume_lock_entry_is_removed_by_the_last_holder_or_waiter() {
        let locks = VolumeLocks::default();
        {
            let _a = locks.lock("v1").await;
            let _b = locks.lock("v2").await;
            assert_eq!(locks.len(), 2);
        }
        assert_eq!(locks.len(), 0, "released locks leave no entry");

        // A waiter keeps the entry while the holder is gone, and is the
        // one to remove it.
        let held = locks.lock("v1").await;
        let waiter = locks.lock("v1");
        tokio::pin!(waiter);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut waiter)
                .await
                .is_err(),
            "the second locker waits"
        );
        drop(held);
        assert_eq!(locks.len(), 1);
        let second = waiter.await;
        assert_eq!(locks.len(), 1);
        drop(second);
        assert_eq!(locks.len(), 0);

        // A cancelled waiter gives its place back too.
        let held = locks.lock("v1").await;
        let cancelled = tokio::time::timeout(Duration::from_millis(20), locks.lock("v1")).await;
        assert!(cancelled.is_err());
        assert_eq!(locks.len(), 1);
        drop(held);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn volume_lock_serializes_holders_of_the_same_volume() {
        let locks = Arc::new(VolumeLocks::default());
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (locks, inside) = (locks.clone(), inside.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    let _g = locks.lock("v").await;
                    let n = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    assert_eq!(n, 0, "two holders of one volume's lock");
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(locks.len(), 0);
    }
}
