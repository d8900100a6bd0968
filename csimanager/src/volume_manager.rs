//! The volume manager: stages and publishes volumes for allocs, counts usage
//! per volume on the node, undoes it all on unmount, and emits a `Storage`
//! node event for every mount and unmount.
//!
//! Paths (all host paths under `ManagerConfig::root_dir`; the registration's
//! `mount_root` is not used, because plugins run as host processes and see
//! these paths as they are):
//! - staging: `<root>/<plugin_id>/staging/<volume_id>/<usage>`
//! - publish target: `<root>/<plugin_id>/per-alloc/<alloc_id>/<volume_id>/<usage>`
//!
//! Rules kept here:
//! - One operation in flight per volume on the node ([`VolumeLocks`]).
//! - The usage (the alloc in the volume's [`VolumeStub`]) is persisted before
//!   `NodeStageVolume`, with `staged = true`, and given back if staging fails.
//! - Uncertain errors are retried with bounded backoff; a publish that finally
//!   fails is undone (unpublish, and unstage when it was the last user).
//! - An undo that fails leaves the stub recording what remains to be undone,
//!   so a later `unmount_volume` (or the manager's run loop) finishes it; an
//!   unmount reports an error while any undo of its usage is unfinished.
//! - A mount again for an alloc the stub already records (restore) never
//!   gives the usage back on failure: the alloc's target may be published.

mod mount;

use berth_sync::MutexExt;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::ExponentialBuilder;
use berth_proto::csi::v1 as csi;
use berth_structs::{AccessMode, AttachmentMode, CsiMountOptions, NodeEvent};
use tokio::sync::{watch, OwnedMutexGuard};
use tonic::Code;
use tracing::Instrument;

use crate::client::CsiClient;
use crate::error::CsiError;
use crate::sinks::{NodeEventSink, VolumeStateStore};
use crate::volume::{
    usage_name, ExpandRequest, MountInfo, MountRequest, UnmountRequest, VolumeStub,
};

/// How uncertain CSI calls are retried: exponential backoff from
/// `min_delay` to `max_delay`, at most `max_retries` retries, and no more
/// than `max_total_delay` spent sleeping between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub min_delay: Duration,
    pub max_delay: Duration,
    pub max_retries: usize,
    pub max_total_delay: Duration,
}

impl Default for RetryPolicy {
    /// Up to 4 retries (0.5 s, 1 s, 2 s, 4 s): with the call deadlines, an
    /// operation gives up well within half a minute.
    fn default() -> Self {
        RetryPolicy {
            min_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(5),
            max_retries: 4,
            max_total_delay: Duration::from_secs(20),
        }
    }
}

impl RetryPolicy {
    fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.max_retries)
            .with_total_delay(Some(self.max_total_delay))
    }
}

/// Per-volume async locks, keyed by plugin and volume. An entry lives only
/// while someone holds or waits for it.
#[derive(Default)]
struct VolumeLocks {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

pub(crate) struct VolumeLockGuard<'a> {
    locks: &'a VolumeLocks,
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl VolumeLocks {
    async fn lock(&self, plugin_id: &str, volume_id: &str) -> VolumeLockGuard<'_> {
        let key = format!("{plugin_id}/{volume_id}");
        let mutex = {
            let mut locks = self.locks.locked();
            locks.entry(key.clone()).or_default().clone()
        };
        let guard = mutex.lock_owned().await;
        VolumeLockGuard {
            locks: self,
            key,
            guard: Some(guard),
        }
    }
}

impl Drop for VolumeLockGuard<'_> {
    fn drop(&mut self) {
        let mut locks = self.locks.locks.locked();
        // Held by the map and by our guard only: nobody waits, forget it.
        // New waiters must take the map lock first, so this cannot race.
        if locks
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 2)
        {
            locks.remove(&self.key);
        }
        self.guard.take();
    }
}

pub(crate) struct VolumeManager {
    root_dir: PathBuf,
    store: Arc<dyn VolumeStateStore>,
    events: Arc<dyn NodeEventSink>,
    /// By `VolumeStub::key`; mirrors the store.
    stubs: Mutex<BTreeMap<String, VolumeStub>>,
    locks: VolumeLocks,
    retry: Mutex<RetryPolicy>,
    /// Bumped on every change of `stubs`.
    changed: watch::Sender<u64>,
}

impl VolumeManager {
    pub(crate) fn new(
        root_dir: PathBuf,
        store: Arc<dyn VolumeStateStore>,
        events: Arc<dyn NodeEventSink>,
        stubs: Vec<VolumeStub>,
    ) -> VolumeManager {
        VolumeManager {
            root_dir,
            store,
            events,
            stubs: Mutex::new(stubs.into_iter().map(|s| (s.key(), s)).collect()),
            locks: VolumeLocks::default(),
            retry: Mutex::new(RetryPolicy::default()),
            changed: watch::Sender::new(0),
        }
    }

    /// A receiver whose value changes on every change of the usage stubs.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) fn set_retry_policy(&self, policy: RetryPolicy) {
        *self.retry.locked() = policy;
    }

    /// The usage stubs on this node.
    pub(crate) fn stubs(&self) -> Vec<VolumeStub> {
        self.lock_stubs().values().cloned().collect()
    }

    /// The usage stub under `key`, if any.
    pub(crate) fn stub(&self, key: &str) -> Option<VolumeStub> {
        self.lock_stubs().get(key).cloned()
    }

    /// Holds the volume's operation lock: no stage, publish, unpublish or
    /// unstage of it runs until the guard drops.
    pub(crate) async fn lock_volume(
        &self,
        plugin_id: &str,
        volume_id: &str,
    ) -> VolumeLockGuard<'_> {
        self.locks.lock(plugin_id, volume_id).await
    }

    /// The usage stubs `alloc_id` uses.
    pub(crate) fn stubs_of(&self, alloc_id: &str) -> Vec<VolumeStub> {
        self.lock_stubs()
            .values()
            .filter(|s| s.allocs.contains_key(alloc_id))
            .cloned()
            .collect()
    }

    /// The IDs of the volumes of `plugin_id` that still need the plugin to
    /// be unmounted from this node: staged or published for an alloc other
    /// than `except_alloc`, or left staged by an unfinished unstage.
    pub(crate) fn volumes_needing_plugin(
        &self,
        plugin_id: &str,
        except_alloc: &str,
    ) -> BTreeSet<String> {
        self.lock_stubs()
            .values()
            .filter(|s| s.plugin_id == plugin_id)
            .filter(|s| {
                s.allocs.keys().any(|a| a != except_alloc) || (s.allocs.is_empty() && s.staged)
            })
            .map(|s| s.volume_id.clone())
            .collect()
    }

    /// The usages no alloc uses any more that still wait for their undo
    /// (an unstage that failed).
    pub(crate) fn unused_stubs(&self) -> Vec<VolumeStub> {
        self.lock_stubs()
            .values()
            .filter(|s| s.allocs.is_empty())
            .cloned()
            .collect()
    }

    /// Whether `req.alloc_id` uses the volume with this usage, and whether
    /// the usage has an unfinished undo (no alloc uses it, still staged).
    pub(crate) fn unmount_work(&self, req: &UnmountRequest) -> (bool, bool) {
        let key = req.stub_key();
        self.lock_stubs().get(&key).map_or((false, false), |s| {
            (
                s.allocs.contains_key(&req.alloc_id),
                s.allocs.is_empty() && s.staged,
            )
        })
    }

    pub(crate) fn staging_path(
        &self,
        plugin_id: &str,
        volume_id: &str,
        access: AccessMode,
        attach: AttachmentMode,
        read_only: bool,
    ) -> PathBuf {
        self.root_dir
            .join(plugin_id)
            .join("staging")
            .join(volume_id)
            .join(usage_name(access, attach, read_only))
    }

    pub(crate) fn target_path(
        &self,
        plugin_id: &str,
        alloc_id: &str,
        volume_id: &str,
        access: AccessMode,
        attach: AttachmentMode,
        read_only: bool,
    ) -> PathBuf {
        self.root_dir
            .join(plugin_id)
            .join("per-alloc")
            .join(alloc_id)
            .join(volume_id)
            .join(usage_name(access, attach, read_only))
    }

    /// Stages (when the plugin supports it and the usage is not staged yet)
    /// and publishes `req.volume_id` for `req.alloc_id`.
    pub(crate) async fn mount_volume(
        &self,
        client: &CsiClient,
        supports_stage: bool,
        req: &MountRequest,
    ) -> Result<MountInfo, CsiError> {
        let span = tracing::info_span!(
            "mount_volume",
            plugin_id = %req.plugin_id,
            volume_id = %req.volume_id,
            alloc_id = %req.alloc_id,
        );
        let started = std::time::Instant::now();
        let result = async {
            validate_ids(
                &req.volume_id,
                &[
                    ("plugin ID", &req.plugin_id),
                    ("volume ID", &req.volume_id),
                    ("alloc ID", &req.alloc_id),
                ],
            )?;
            let _lock = self.locks.lock(&req.plugin_id, &req.volume_id).await;
            self.mount_locked(client, supports_stage, req).await
        }
        .instrument(span)
        .await;
        berth_metrics::observe_plugin_op(
            &berth_metrics::metrics().csi_mount_duration,
            &req.plugin_id,
            berth_metrics::Outcome::of(&result),
            started.elapsed(),
        );
        match &result {
            Ok(m) => {
                tracing::info!(plugin_id = %req.plugin_id, volume_id = %req.volume_id, alloc_id = %req.alloc_id, target = %m.source.display(), "volume mounted")
            }
            Err(e) => {
                tracing::warn!(plugin_id = %req.plugin_id, volume_id = %req.volume_id, alloc_id = %req.alloc_id, error = %e, "mounting volume failed")
            }
        }
        self.emit(
            "Mount volume",
            &req.volume_id,
            &req.alloc_id,
            result.as_ref().err(),
        );
        result
    }

    /// Unpublishes the alloc's target and, when it was the last user of the
    /// usage on the node, unstages. Idempotent.
    pub(crate) async fn unmount_volume(
        &self,
        client: Option<&CsiClient>,
        req: &UnmountRequest,
    ) -> Result<(), CsiError> {
        let span = tracing::info_span!(
            "unmount_volume",
            plugin_id = %req.plugin_id,
            volume_id = %req.volume_id,
            alloc_id = %req.alloc_id,
        );
        let started = std::time::Instant::now();
        let result = async {
            let _lock = self.locks.lock(&req.plugin_id, &req.volume_id).await;
            // No record of the alloc using the volume and no undo left:
            // nothing is mounted, so the unmount is done. Decided before the
            // IDs are checked, so that a claim on an ID that could never be
            // mounted here can still be released.
            if self.unmount_work(req) == (false, false) {
                tracing::debug!("no record of the volume for the alloc; nothing to unmount");
                return Ok(());
            }
            validate_ids(
                &req.volume_id,
                &[
                    ("plugin ID", &req.plugin_id),
                    ("volume ID", &req.volume_id),
                    ("alloc ID", &req.alloc_id),
                ],
            )?;
            let key = req.stub_key();
            self.release_usage(client, &key, &req.alloc_id).await
        }
        .instrument(span)
        .await;
        berth_metrics::observe_plugin_op(
            &berth_metrics::metrics().csi_unmount_duration,
            &req.plugin_id,
            berth_metrics::Outcome::of(&result),
            started.elapsed(),
        );
        match &result {
            Ok(()) => {
                tracing::info!(plugin_id = %req.plugin_id, volume_id = %req.volume_id, alloc_id = %req.alloc_id, "volume unmounted")
            }
            Err(e) => {
                tracing::warn!(plugin_id = %req.plugin_id, volume_id = %req.volume_id, alloc_id = %req.alloc_id, error = %e, "unmounting volume failed")
            }
        }
        self.emit(
            "Unmount volume",
            &req.volume_id,
            &req.alloc_id,
            result.as_ref().err(),
        );
        result
    }

    /// Grows the filesystem of a volume published here (`NodeExpandVolume`),
    /// once per node: through the publish target of one of `req.alloc_ids`
    /// (a writable usage first) and that usage's staging path when it is
    /// staged. Holds the volume's lock, so it never runs alongside a mount
    /// or an unmount of the volume. Answers the capacity the plugin
    /// reports (0 when it does not say).
    pub(crate) async fn expand_volume(
        &self,
        client: &CsiClient,
        req: &ExpandRequest,
    ) -> Result<i64, CsiError> {
        validate_ids(
            &req.volume_id,
            &[("plugin ID", &req.plugin_id), ("volume ID", &req.volume_id)],
        )?;
        let _lock = self.locks.lock(&req.plugin_id, &req.volume_id).await;
        let wanted = |alloc: &String| req.alloc_ids.is_empty() || req.alloc_ids.contains(alloc);
        let mut usages: Vec<VolumeStub> = self
            .lock_stubs()
            .values()
            .filter(|s| s.plugin_id == req.plugin_id && s.volume_id == req.volume_id)
            .filter(|s| s.allocs.keys().any(wanted))
            .cloned()
            .collect();
        usages.sort_by_key(|s| s.read_only || s.access_mode.is_reader_only());
        let found = usages.iter().find_map(|s| {
            s.allocs
                .iter()
                .find(|(a, _)| wanted(a))
                .map(|(_, t)| (s, t.clone()))
        });
        let Some((stub, target)) = found else {
            return Err(CsiError::Volume {
                volume_id: req.volume_id.clone(),
                message: format!(
                    "not published on this node for allocs {}; nothing to expand here",
                    req.alloc_ids.join(", ")
                ),
            });
        };
        let capacity_range =
            (req.capacity_min > 0 || req.capacity_max > 0).then_some(csi::CapacityRange {
                required_bytes: req.capacity_min,
                limit_bytes: req.capacity_max,
            });
        let expand = csi::NodeExpandVolumeRequest {
            volume_id: req.external_id.clone(),
            volume_path: path_string(&target)?,
            capacity_range,
            staging_target_path: if stub.staged {
                path_string(&stub.staging_path)?
            } else {
                String::new()
            },
            volume_capability: Some(volume_capability(
                req.access_mode,
                req.attachment_mode,
                &req.mount_options,
            )),
            secrets: to_map(&req.secrets),
        };
        let resp = self
            .with_retry("NodeExpandVolume", || async {
                client.node_expand_volume(expand.clone()).await
            })
            .await?;
        tracing::info!(plugin_id = %req.plugin_id, volume_id = %req.volume_id, capacity_bytes = resp.capacity_bytes, "volume expanded on the node");
        Ok(resp.capacity_bytes)
    }

    /// Finishes the undo of a usage that no alloc uses any more (an unstage
    /// that failed before). No event: no alloc asked for it.
    pub(crate) async fn reap_unused(
        &self,
        client: &CsiClient,
        stub: &VolumeStub,
    ) -> Result<(), CsiError> {
        let _lock = self.locks.lock(&stub.plugin_id, &stub.volume_id).await;
        self.release_usage(Some(client), &stub.key(), "").await
    }

    async fn mount_locked(
        &self,
        client: &CsiClient,
        supports_stage: bool,
        req: &MountRequest,
    ) -> Result<MountInfo, CsiError> {
        let plan = self.plan_mount(supports_stage, req).await;
        // Take the usage, durably, before any CSI call.
        self.take_usage(req, &plan)?;
        if plan.need_stage {
            self.stage_for_mount(client, req, &plan).await?;
        }
        self.publish_for_mount(client, req, &plan).await?;
        Ok(MountInfo {
            source: plan.target,
            read_only: plan.read_only,
        })
    }

    /// Gives back the usage taken for a stage that failed. `may_be_staged`:
    /// the volume may be staged anyway (uncertain error, or staged before),
    /// so when no alloc is left it is unstaged before the stub goes.
    async fn give_back_failed_stage(
        &self,
        client: &CsiClient,
        key: &str,
        alloc_id: &str,
        may_be_staged: bool,
    ) {
        let Some(mut stub) = self.lock_stubs().get(key).cloned() else {
            return;
        };
        stub.allocs.remove(alloc_id);
        if !stub.allocs.is_empty() {
            if let Err(e) = self.put_stub(&stub) {
                tracing::error!(error = %e, "giving back a volume usage failed");
            }
            return;
        }
        if may_be_staged {
            // Record that no alloc uses it, then undo the stage.
            if let Err(e) = self.put_stub(&stub) {
                tracing::error!(error = %e, "giving back a volume usage failed");
                return;
            }
            if let Err(e) = self.release_usage(Some(client), key, alloc_id).await {
                tracing::warn!(error = %e, "unstaging after a failed stage failed; the stub keeps it to undo");
            }
            return;
        }
        if let Err(e) = self.delete_stub(key) {
            tracing::error!(error = %e, "giving back a volume usage failed");
            return;
        }
        remove_empty_dirs(&stub.staging_path, &self.root_dir);
    }

    /// Unpublishes `alloc_id`'s target (if the stub records it), and when no
    /// alloc is left, unstages (if staged) and deletes the stub. Every step
    /// is persisted before the next CSI call.
    async fn release_usage(
        &self,
        client: Option<&CsiClient>,
        key: &str,
        alloc_id: &str,
    ) -> Result<(), CsiError> {
        let Some(mut stub) = self.lock_stubs().get(key).cloned() else {
            return Ok(());
        };
        let uses = stub.allocs.contains_key(alloc_id);
        let Some(client) = client else {
            // An undo that cannot be made without the plugin is not done:
            // the alloc's unpublish, or an unstage left unfinished (no alloc
            // uses the usage, still staged). Reporting success would let the
            // servers free the claim and detach a volume still staged here.
            // `CsiManager::run` also finishes such an unstage once the
            // plugin is back.
            if uses || (stub.allocs.is_empty() && stub.staged) {
                return Err(CsiError::PluginNotFound(stub.plugin_id.clone()));
            }
            if stub.allocs.is_empty() {
                self.delete_stub(key)?;
            }
            return Ok(());
        };

        if let Some(target) = stub.allocs.get(alloc_id).cloned() {
            let unpublish_req = csi::NodeUnpublishVolumeRequest {
                volume_id: stub.external_id.clone(),
                target_path: path_string(&target)?,
            };
            self.with_retry("NodeUnpublishVolume", || async {
                done_if_not_found(client.node_unpublish_volume(unpublish_req.clone()).await)
            })
            .await?;
            remove_empty_dirs(&target, &self.root_dir);
            stub.allocs.remove(alloc_id);
            // The last user of a staged usage: the usage is marked as
            // being unstaged in the same durable write (below); one that
            // was not staged goes with the record's removal.
            if !stub.allocs.is_empty() {
                self.put_stub(&stub)?;
            }
        }
        if !stub.allocs.is_empty() {
            return Ok(());
        }
        if stub.staged {
            // Marked before the call: a crash after the plugin unstaged
            // and before the record goes leaves a mark, not a record that
            // says staged (which, for a plugin whose stage mounts nothing,
            // nothing could disprove).
            if !stub.unstaging || uses {
                stub.unstaging = true;
                self.put_stub(&stub)?;
            }
            let unstage_req = csi::NodeUnstageVolumeRequest {
                volume_id: stub.external_id.clone(),
                staging_target_path: path_string(&stub.staging_path)?,
            };
            let unstaged = self
                .with_retry("NodeUnstageVolume", || async {
                    done_if_not_found(client.node_unstage_volume(unstage_req.clone()).await)
                })
                .await;
            // What remains to undo on failure, the unstage with no alloc
            // using it, is recorded already.
            unstaged?;
        }
        self.delete_stub(key)?;
        remove_empty_dirs(&stub.staging_path, &self.root_dir);
        Ok(())
    }

    /// Runs `call`, retrying uncertain errors per the retry policy.
    pub(crate) async fn with_retry<T, F, Fut>(
        &self,
        op: &'static str,
        call: F,
    ) -> Result<T, CsiError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, CsiError>>,
    {
        let policy = *self.retry.locked();
        crate::retry::retry_notify(
            policy.backoff(),
            call,
            CsiError::is_uncertain,
            |e: &CsiError, after: Duration| {
                tracing::warn!(op, error = %e, retry_in = ?after, "uncertain CSI error, retrying");
            },
        )
        .await
    }

    fn lock_stubs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, VolumeStub>> {
        self.stubs.locked()
    }

    /// Persists `stub`, then records it in memory.
    fn put_stub(&self, stub: &VolumeStub) -> Result<(), CsiError> {
        self.store.put_volume(stub).map_err(CsiError::Store)?;
        self.lock_stubs().insert(stub.key(), stub.clone());
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
        Ok(())
    }

    /// Drops `alloc_id` from the usage `key` without a CSI call; a usage
    /// left without allocs stays recorded while staged, for the unstage.
    /// How many allocs still use it.
    pub(crate) fn forget_alloc(&self, key: &str, alloc_id: &str) -> Result<usize, CsiError> {
        let Some(mut stub) = self.lock_stubs().get(key).cloned() else {
            return Ok(0);
        };
        if stub.allocs.remove(alloc_id).is_some() {
            if stub.allocs.is_empty() && !stub.staged {
                self.delete_stub(key)?;
            } else {
                self.put_stub(&stub)?;
            }
        }
        Ok(stub.allocs.len())
    }

    fn delete_stub(&self, key: &str) -> Result<(), CsiError> {
        self.store.delete_volume(key).map_err(CsiError::Store)?;
        self.lock_stubs().remove(key);
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
        Ok(())
    }

    fn emit(&self, message: &str, volume_id: &str, alloc_id: &str, error: Option<&CsiError>) {
        self.events.emit(
            NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, message)
                .with_detail("volume_id", volume_id)
                .with_detail("alloc_id", alloc_id)
                .with_detail("success", if error.is_none() { "true" } else { "false" })
                .with_detail("error", error.map(|e| e.to_string()).unwrap_or_default()),
        );
    }
}

/// `NotFound` from an unpublish or unstage: the volume does not exist, so
/// nothing of it is published or staged.
fn done_if_not_found<T: Default>(r: Result<T, CsiError>) -> Result<T, CsiError> {
    match r {
        Err(CsiError::Final {
            code: Code::NotFound,
            op,
            message,
            ..
        }) => {
            tracing::info!(op, message = %message, "volume not found; treating as done");
            Ok(T::default())
        }
        other => other,
    }
}

/// The CSI volume capability for an access mode, attachment mode and mount
/// options.
pub fn volume_capability(
    access: AccessMode,
    attach: AttachmentMode,
    options: &CsiMountOptions,
) -> csi::VolumeCapability {
    use csi::volume_capability::access_mode::Mode;
    let mode = match access {
        AccessMode::SingleNodeReader => Mode::SingleNodeReaderOnly,
        AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        AccessMode::MultiNodeReader => Mode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
    };
    let access_type = match attach {
        AttachmentMode::FileSystem => {
            csi::volume_capability::AccessType::Mount(csi::volume_capability::MountVolume {
                fs_type: options.fs_type.clone(),
                mount_flags: options.mount_flags.clone(),
                volume_mount_group: String::new(),
            })
        }
        AttachmentMode::BlockDevice => {
            csi::volume_capability::AccessType::Block(csi::volume_capability::BlockVolume {})
        }
    };
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(access_type),
    }
}

/// Plugin, volume and alloc IDs become path components: each must pass the
/// name rule that the servers checked when the job or volume arrived.
fn validate_ids(volume_id: &str, ids: &[(&'static str, &str)]) -> Result<(), CsiError> {
    for (field, id) in ids {
        berth_structs::check_name(field, id).map_err(|e| CsiError::Volume {
            volume_id: volume_id.to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(())
}

pub(crate) fn to_map(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

pub(crate) fn path_string(p: &Path) -> Result<String, CsiError> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| CsiError::Io(format!("path {} is not UTF-8", p.display())))
}

pub(crate) fn create_dir_all(p: &Path) -> Result<(), CsiError> {
    std::fs::create_dir_all(p).map_err(|e| CsiError::Io(format!("creating {}: {e}", p.display())))
}

/// Removes `path` and its parents up to (not including) `root`, stopping at
/// the first that is not empty (or is still a mount point). One already
/// gone (a plugin removes its mount points on unpublish and unstage) is
/// passed over to its parent.
fn remove_empty_dirs(path: &Path, root: &Path) {
    let mut dir = Some(path);
    while let Some(d) = dir {
        if d == root || !d.starts_with(root) {
            break;
        }
        match std::fs::remove_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => break,
        }
        dir = d.parent();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_escape_a_path_are_refused() {
        for bad in ["", ".", "..", "a/b", "a\0b", "../../escape", "a b"] {
            let e = validate_ids("v", &[("volume ID", bad)]).unwrap_err();
            assert!(e.to_string().contains("volume ID"), "{bad:?}: {e}");
        }
        assert!(validate_ids("v", &[("volume ID", "vol[0]"), ("alloc ID", "8c2f-11")]).is_ok());
    }

    #[test]
    fn capability_carries_mode_and_mount_options() {
        let cap = volume_capability(
            AccessMode::MultiNodeReader,
            AttachmentMode::FileSystem,
            &CsiMountOptions {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into()],
            },
        );
        assert_eq!(
            cap.access_mode.unwrap().mode,
            csi::volume_capability::access_mode::Mode::MultiNodeReaderOnly as i32
        );
        match cap.access_type {
            Some(csi::volume_capability::AccessType::Mount(m)) => {
                assert_eq!(m.fs_type, "ext4");
                assert_eq!(m.mount_flags, vec!["noatime".to_string()]);
            }
            other => panic!("want a mount access type, got {other:?}"),
        }
        let block = volume_capability(
            AccessMode::SingleNodeWriter,
            AttachmentMode::BlockDevice,
            &CsiMountOptions::default(),
        );
        assert!(matches!(
            block.access_type,
            Some(csi::volume_capability::AccessType::Block(_))
        ));
    }

    #[tokio::test]
    async fn volume_lock_serializes_and_forgets_unused_entries() {
        let locks = VolumeLocks::default();
        let g = locks.lock("p", "v").await;
        let second = locks.lock("p", "v");
        tokio::pin!(second);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut second)
                .await
                .is_err(),
            "a second lock on the same volume must wait"
        );
        // Another volume is not blocked.
        drop(locks.lock("p", "other").await);
        drop(g);
        drop(second.await);
        assert!(locks.locks.lock().unwrap().is_empty());
    }
}
