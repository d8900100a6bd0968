//! CSI volumes on the servers: create, register, deregister, delete and
//! read (here), claims and their release (`claims.rs`), and the volume
//! watcher that frees claims nobody released (`watcher.rs`).
//!
//! Every operation that changes a volume's claims or talks to its plugin
//! holds the volume's lock, so a claim, an unpublish and a delete of the
//! same volume never interleave. Secrets are passed to plugins and never
//! returned by a read or logged.

pub(crate) mod claims;
pub(crate) mod expand;
pub(crate) mod snapshots;
mod watcher;

use berth_sync::MutexExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use berth_proto::berth::v1 as pb;
use berth_structs::{CsiTopology, CsiVolume, Node, NodeStatus};
use tokio::sync::OwnedMutexGuard;

pub use claims::{ClaimGrant, ReleaseOrigin, VolumeClaimRequest, FORCED_RELEASE_EVENT};
pub use snapshots::SnapshotRequest;
pub(crate) use watcher::{ReleaseClaim, VolumeWatcher};

use crate::state::Tables;

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
        self.locks.locked()
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
pub(crate) fn alloc_live(t: &Tables, alloc_id: &str) -> bool {
    t.allocs
        .get(alloc_id)
        .is_some_and(|a| !a.client_status.is_terminal())
}

/// Where each plugin has a healthy node plugin on a ready node: the
/// distinct topologies of those node plugins (`None`: one without a
/// topology), by plugin ID; of `plugin_id` only when given (then from the
/// nodes that run it alone). One pass over the nodes serves every volume.
pub(crate) type NodePluginPlaces<'a> = HashMap<&'a str, BTreeSet<Option<&'a CsiTopology>>>;

pub(crate) fn node_plugin_places<'a>(
    t: &'a Tables,
    plugin_id: Option<&str>,
) -> NodePluginPlaces<'a> {
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

pub(crate) fn public_view_in(v: &CsiVolume, places: &NodePluginPlaces<'_>) -> CsiVolume {
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
