//! Orphaned mounts: what is mounted below berth's roots at agent start
//! that no restored alloc owns (its alloc record was lost or quarantined,
//! or a crash came between a mount and its record). Each is removed and
//! reported as a `Storage` node event, `Orphaned mount removed`, with
//! details `path`, `volume_id` (when the path tells it), `how` (`plugin`:
//! through the volume's plugin; `unmount`: a lazy unmount) and `error`.
//!
//! What berth mounts, and how each is told apart by its path:
//! - staging: `<csi_root>/<plugin_id>/staging/<volume_id>/<usage>`
//! - publish: `<csi_root>/<plugin_id>/per-alloc/<alloc_id>/<volume_id>/<usage>`
//! - task volume mounts: `<alloc_root>/<alloc_id>/<task>/<destination>`
//!
//! The order matters. First the task volume mounts in the dirs of allocs
//! that were not restored are unmounted (they hold the volume, whatever
//! the plugin does). Then every usage a volume stub records for an alloc
//! that was not restored is released through its plugin, as the alloc's
//! own unmount would (unpublish, then unstage when it was the last user):
//! the stub knows the volume's external ID, without which no CSI call can
//! be made. The plugin is waited for, boundedly: plugins are restored
//! tasks themselves. Without the plugin, the publish target is unmounted
//! lazily and the usage forgotten; a staging mount left without users is
//! unmounted lazily too, and its stub stays, so that the manager's run
//! loop still calls `NodeUnstageVolume` once the plugin is back. Last,
//! mounts below the CSI root that no stub records (nothing knows their
//! external ID) are unmounted lazily. Mounts at or below a path a stub
//! records for a restored alloc are never touched, nor anything outside
//! the two roots.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use berth_structs::{CsiPluginType, NodeEvent};
use tokio::time::Instant;

use crate::manager::CsiManager;
use crate::mountinfo::{self, is_mount_point};
use crate::volume::{UnmountRequest, VolumeStub};

/// The node event message of a removed orphaned mount.
pub const EVENT_ORPHANED_MOUNT_REMOVED: &str = "Orphaned mount removed";

/// How an orphaned mount was removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovedHow {
    /// `NodeUnpublishVolume` / `NodeUnstageVolume` through the plugin.
    Plugin,
    /// `umount2(MNT_DETACH)`.
    Unmount,
}

impl RemovedHow {
    pub fn as_str(self) -> &'static str {
        match self {
            RemovedHow::Plugin => "plugin",
            RemovedHow::Unmount => "unmount",
        }
    }
}

/// One orphaned mount and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrphanRemoval {
    pub path: PathBuf,
    pub volume_id: Option<String>,
    pub how: RemovedHow,
    /// Why it is (or may be) still there.
    pub error: Option<String>,
}

impl OrphanRemoval {
    fn event(&self) -> NodeEvent {
        let mut e = NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, EVENT_ORPHANED_MOUNT_REMOVED)
            .with_detail("path", self.path.display().to_string());
        if let Some(v) = &self.volume_id {
            e = e.with_detail("volume_id", v.clone());
        }
        e.with_detail("how", self.how.as_str())
            .with_detail("error", self.error.clone().unwrap_or_default())
    }
}

/// What a path below the CSI root is, by berth's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CsiPath {
    Staging {
        plugin_id: String,
        volume_id: String,
    },
    Publish {
        plugin_id: String,
        alloc_id: String,
        volume_id: String,
    },
    /// Anything else (including paths outside the root).
    Other,
}

impl CsiPath {
    /// Classifies `path` (canonical) below `csi_root` (canonical).
    pub fn of(csi_root: &Path, path: &Path) -> CsiPath {
        let Some(parts) = plain_components(csi_root, path) else {
            return CsiPath::Other;
        };
        match parts.as_slice() {
            [plugin, "staging", volume, _usage] => CsiPath::Staging {
                plugin_id: plugin.to_string(),
                volume_id: volume.to_string(),
            },
            [plugin, "per-alloc", alloc, volume, _usage] => CsiPath::Publish {
                plugin_id: plugin.to_string(),
                alloc_id: alloc.to_string(),
                volume_id: volume.to_string(),
            },
            _ => CsiPath::Other,
        }
    }

    pub fn volume_id(&self) -> Option<String> {
        match self {
            CsiPath::Staging { volume_id, .. } | CsiPath::Publish { volume_id, .. } => {
                Some(volume_id.clone())
            }
            CsiPath::Other => None,
        }
    }
}

/// The UTF-8 components of `path` below `root`; `None` when it is not
/// below it (or is it).
fn plain_components<'a>(root: &Path, path: &'a Path) -> Option<Vec<&'a str>> {
    let rel = path.strip_prefix(root).ok()?;
    let parts: Option<Vec<&str>> = rel
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect();
    parts.filter(|p| !p.is_empty())
}

/// Mount points strictly below `dir`, deepest first.
fn mount_points_below(dir: &Path) -> Vec<PathBuf> {
    mountinfo::mounts_at_or_below(dir)
        .into_iter()
        .filter(|p| p != dir)
        .collect()
}

/// Unmounts `path` lazily (every mount stacked there) and removes its
/// mount point when it is an empty directory; the error, if the unmount
/// failed.
fn lazy_unmount(path: &Path) -> Option<String> {
    match mountinfo::detach_all(path) {
        Ok(()) => {
            // Never deletes data: only an empty directory goes.
            let _ = std::fs::remove_dir(path);
            None
        }
        Err(e) => Some(format!("unmounting {}: {e}", path.display())),
    }
}

/// A root as mountinfo shows paths below it (symlinks resolved); as given
/// when it does not exist.
fn canonical(root: &Path) -> PathBuf {
    root.canonicalize().unwrap_or_else(|_| root.to_path_buf())
}

impl CsiManager {
    /// Removes the mounts below the CSI root and `alloc_root` that none of
    /// `known_allocs` (the allocs restored at start) owns, waiting at most
    /// `plugin_wait` for the plugins it needs (see the module doc). Each
    /// is reported as a node event and in the answer. Run it once the
    /// restored allocs' runners are started and before new allocs arrive.
    pub async fn remove_orphaned_mounts(
        &self,
        alloc_root: &Path,
        known_allocs: &BTreeSet<String>,
        plugin_wait: Duration,
    ) -> Vec<OrphanRemoval> {
        let csi_root = canonical(&self.config().root_dir);
        let alloc_root = canonical(alloc_root);
        let deadline = Instant::now() + plugin_wait;
        let mut removed = Vec::new();

        // The task volume mounts of allocs that were not restored.
        for m in mount_points_below(&alloc_root) {
            let Some(parts) = plain_components(&alloc_root, &m) else {
                continue;
            };
            if known_allocs.contains(parts[0]) {
                continue;
            }
            tracing::warn!(path = %m.display(), alloc_id = parts[0], "unmounting an orphaned mount in the dir of an alloc that was not restored");
            removed.push(OrphanRemoval {
                error: lazy_unmount(&m),
                path: m,
                volume_id: None,
                how: RemovedHow::Unmount,
            });
        }

        // The usages recorded for allocs that were not restored.
        for stub in self.volume_stubs() {
            for (alloc_id, target) in &stub.allocs {
                if !known_allocs.contains(alloc_id) {
                    removed.extend(
                        self.release_orphaned_usage(&stub, alloc_id, target, deadline)
                            .await,
                    );
                }
            }
        }

        // Mounts below the CSI root that no record explains.
        let owned: Vec<PathBuf> = self
            .volume_stubs()
            .iter()
            .flat_map(|s| {
                std::iter::once(canonical(&s.staging_path))
                    .chain(s.allocs.values().map(|t| canonical(t)))
            })
            .collect();
        for m in mount_points_below(&csi_root) {
            if owned.iter().any(|o| m.starts_with(o)) {
                continue;
            }
            let volume_id = CsiPath::of(&csi_root, &m).volume_id();
            tracing::warn!(path = %m.display(), volume_id = ?volume_id, "unmounting an orphaned mount that no volume record explains");
            removed.push(OrphanRemoval {
                error: lazy_unmount(&m),
                path: m,
                volume_id,
                how: RemovedHow::Unmount,
            });
        }

        for r in &removed {
            match &r.error {
                None => {
                    tracing::info!(path = %r.path.display(), volume_id = ?r.volume_id, how = r.how.as_str(), "removed an orphaned mount")
                }
                Some(e) => {
                    tracing::warn!(path = %r.path.display(), volume_id = ?r.volume_id, how = r.how.as_str(), error = %e, "removing an orphaned mount failed")
                }
            }
            self.emit_event(r.event());
        }
        removed
    }

    /// Releases `alloc_id`'s usage of `stub` through the plugin, as its
    /// unmount would; without the plugin (by `deadline`), unmounts lazily
    /// and forgets the usage. What was mounted and is gone (or not).
    async fn release_orphaned_usage(
        &self,
        stub: &VolumeStub,
        alloc_id: &str,
        target: &Path,
        deadline: Instant,
    ) -> Vec<OrphanRemoval> {
        let staging = stub.staging_path.clone();
        let mounted_before: Vec<PathBuf> = [target, staging.as_path()]
            .into_iter()
            .map(canonical)
            .filter(|p| is_mount_point(p))
            .collect();
        let report = |how: RemovedHow, error: Option<String>, paths: &[PathBuf]| {
            paths
                .iter()
                .map(|p| OrphanRemoval {
                    path: p.clone(),
                    volume_id: Some(stub.volume_id.clone()),
                    how,
                    error: error.clone(),
                })
                .collect::<Vec<_>>()
        };
        tracing::warn!(plugin_id = %stub.plugin_id, volume_id = %stub.volume_id, alloc_id, "releasing the volume usage of an alloc that was not restored");
        let plugin_error = if self.wait_for_node_plugin(&stub.plugin_id, deadline).await {
            let req = UnmountRequest::for_stub(stub, alloc_id);
            match self.unmount_volume(req).await {
                Ok(()) => {
                    let gone: Vec<PathBuf> = mounted_before
                        .iter()
                        .filter(|p| !is_mount_point(p))
                        .cloned()
                        .collect();
                    return report(RemovedHow::Plugin, None, &gone);
                }
                Err(e) => e.to_string(),
            }
        } else {
            format!("plugin {} did not register in time", stub.plugin_id)
        };
        // Without the plugin: the target goes lazily, and with it the
        // usage; a staging mount with no user left goes lazily too, its
        // stub kept for the unstage once the plugin is back. Under the
        // volume's lock: a restored alloc may be mounting the same volume
        // (its stub changing), or a late plugin unstaging it.
        let _lock = self
            .volumes
            .lock_volume(&stub.plugin_id, &stub.volume_id)
            .await;
        let mut out = Vec::new();
        let target_c = canonical(target);
        if is_mount_point(&target_c) {
            let unmount_error = lazy_unmount(&target_c);
            out.push(OrphanRemoval {
                path: target_c,
                volume_id: Some(stub.volume_id.clone()),
                how: RemovedHow::Unmount,
                error: Some(match unmount_error {
                    Some(u) => format!("{plugin_error}; {u}"),
                    None => format!("not through the plugin: {plugin_error}"),
                }),
            });
        }
        let left_users = match self.forget_volume_usage(&stub.key(), alloc_id) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(volume_id = %stub.volume_id, alloc_id, error = %e, "forgetting an orphaned volume usage failed");
                return out;
            }
        };
        let staging_c = canonical(&staging);
        if left_users == 0 && is_mount_point(&staging_c) {
            let unmount_error = lazy_unmount(&staging_c);
            out.push(OrphanRemoval {
                path: staging_c,
                volume_id: Some(stub.volume_id.clone()),
                how: RemovedHow::Unmount,
                error: Some(match unmount_error {
                    Some(u) => format!("{plugin_error}; {u}"),
                    None => format!("not through the plugin: {plugin_error}"),
                }),
            });
        }
        out
    }

    /// Waits until a healthy node instance of `plugin_id` is registered, or
    /// `deadline` passes; whether one is.
    async fn wait_for_node_plugin(&self, plugin_id: &str, deadline: Instant) -> bool {
        let mut changes = self.registry().subscribe();
        loop {
            changes.borrow_and_update();
            let serves = self.registry().entry(plugin_id).is_some_and(|e| {
                e.unhealthy.is_none() && e.registration.plugin_type != CsiPluginType::Controller
            });
            if serves {
                return true;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_told_apart_by_the_layout() {
        let root = Path::new("/d/client/csi");
        assert_eq!(
            CsiPath::of(
                root,
                Path::new("/d/client/csi/hostpath/staging/data/single-node-writer-file-system")
            ),
            CsiPath::Staging {
                plugin_id: "hostpath".into(),
                volume_id: "data".into()
            }
        );
        assert_eq!(
            CsiPath::of(
                root,
                Path::new(
                    "/d/client/csi/hostpath/per-alloc/a1/data[0]/single-node-writer-file-system"
                )
            ),
            CsiPath::Publish {
                plugin_id: "hostpath".into(),
                alloc_id: "a1".into(),
                volume_id: "data[0]".into()
            }
        );
        for other in [
            "/d/client/csi",
            "/d/client/csi/hostpath",
            "/d/client/csi/hostpath/staging/data",
            "/d/client/csi/hostpath/elsewhere/a/b/c",
            "/d/client/csi/hostpath/per-alloc/a1/data/u/deeper",
            "/elsewhere/hostpath/staging/data/u",
        ] {
            assert_eq!(
                CsiPath::of(root, Path::new(other)),
                CsiPath::Other,
                "{other}"
            );
        }
        assert_eq!(CsiPath::Other.volume_id(), None);
    }

    struct Quiet;

    impl crate::sinks::NodeEventSink for Quiet {
        fn emit(&self, _: NodeEvent) {}
    }

    #[async_trait::async_trait]
    impl crate::sinks::FingerprintSink for Quiet {
        async fn update_plugins(
            &self,
            _: std::collections::BTreeMap<String, berth_structs::CsiInfo>,
            _: std::collections::BTreeMap<String, berth_structs::CsiInfo>,
        ) {
        }
    }

    #[tokio::test]
    async fn a_usage_forgotten_without_the_plugin_waits_for_the_volume_lock() {
        use berth_structs::{AccessMode, AttachmentMode};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let store = crate::testing::MemStore::default();
        let stub = VolumeStub {
            plugin_id: "hostpath".into(),
            volume_id: "data".into(),
            external_id: "ext-data".into(),
            access_mode: AccessMode::MultiNodeReader,
            attachment_mode: AttachmentMode::FileSystem,
            read_only: true,
            staging_path: root.join("csi/hostpath/staging/data/u"),
            staged: true,
            staging_mounted: None,
            unstaging: false,
            allocs: [
                (
                    "gone".to_string(),
                    root.join("csi/hostpath/per-alloc/gone/data/u"),
                ),
                (
                    "kept".to_string(),
                    root.join("csi/hostpath/per-alloc/kept/data/u"),
                ),
            ]
            .into(),
            mounted_with: Default::default(),
        };
        crate::sinks::VolumeStateStore::put_volume(&store, &stub).unwrap();
        let manager = CsiManager::new(
            crate::ManagerConfig {
                root_dir: root.join("csi"),
                node_id: "n1".into(),
                call_timeout: Duration::from_secs(1),
                fingerprint_interval: Duration::from_secs(30),
            },
            crate::PluginRegistry::new(),
            std::sync::Arc::new(store),
            std::sync::Arc::new(Quiet),
            std::sync::Arc::new(Quiet),
        )
        .unwrap();
        // A mount or unmount of the volume (for the restored alloc) is in
        // flight: its record must not change under it.
        let busy = manager.volumes.lock_volume("hostpath", "data").await;
        let cleanup = {
            let manager = manager.clone();
            let alloc_root = root.join("alloc");
            tokio::spawn(async move {
                manager
                    .remove_orphaned_mounts(
                        &alloc_root,
                        &["kept".to_string()].into(),
                        Duration::ZERO,
                    )
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !cleanup.is_finished(),
            "the orphan release waits for the volume lock"
        );
        assert!(manager.volume_stubs()[0].allocs.contains_key("gone"));
        drop(busy);
        tokio::time::timeout(Duration::from_secs(5), cleanup)
            .await
            .expect("done once the lock is free")
            .unwrap();
        let left = manager.volume_stubs();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].allocs.keys().collect::<Vec<_>>(), vec!["kept"]);
    }

    #[test]
    fn events_carry_path_volume_how_and_error() {
        let r = OrphanRemoval {
            path: "/d/x".into(),
            volume_id: Some("data".into()),
            how: RemovedHow::Plugin,
            error: None,
        };
        let e = r.event();
        assert_eq!(e.subsystem, NodeEvent::SUBSYSTEM_STORAGE);
        assert_eq!(e.message, EVENT_ORPHANED_MOUNT_REMOVED);
        assert_eq!(e.details["path"], "/d/x");
        assert_eq!(e.details["volume_id"], "data");
        assert_eq!(e.details["how"], "plugin");
        assert_eq!(e.details["error"], "");
        let e = OrphanRemoval {
            volume_id: None,
            how: RemovedHow::Unmount,
            error: Some("busy".into()),
            ..r
        }
        .event();
        assert!(!e.details.contains_key("volume_id"));
        assert_eq!(e.details["how"], "unmount");
        assert_eq!(e.details["error"], "busy");
    }
}
