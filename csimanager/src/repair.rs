//! Live repair of lost CSI mounts.
//!
//! A node plugin that restarts (or dies and comes back) may take its
//! mounts with it: the staging mount and the per-alloc publish targets are
//! gone, or still listed but dead (`ENOTCONN`, `ESTALE`, `EIO`), while the
//! allocs that use them keep running. On every fingerprint round,
//! [`CsiManager::repair_lost_mounts`] looks at each volume usage of an alloc
//! that is being watched (its tasks run: see [`CsiManager::watch_repairs`]),
//! and once the volume's node plugin is healthy again it stages again (when
//! the staging mount is lost) and publishes again (a dead target is
//! detached first), with what the volume was mounted with: the stub's
//! [`crate::volume::MountContext`], and the secrets, which are kept in
//! memory only (never written down, never logged).
//!
//! Each repair takes the volume's operation lock, so it never races a
//! mount or unmount of the same volume. Every repair emits a `Storage` node
//! event (`Volume repaired`, or `Volume repair failed` with the error) and
//! is sent to the alloc's watchers, which bind the new target into their
//! task directories (or kill the task for a restart when the repair
//! failed). A failed repair is tried again on a later round, with backoff,
//! for as long as the alloc is watched.

use berth_sync::MutexExt;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use berth_proto::csi::v1 as csi;
use berth_structs::{AttachmentMode, CsiPluginType, NodeEvent};
use nix::errno::Errno;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use crate::client::CsiClient;
use crate::error::CsiError;
use crate::manager::CsiManager;
use crate::mountinfo;
use crate::volume::{MountContext, MountRequest, VolumeStub};
use crate::volume_manager::{create_dir_all, path_string, to_map, volume_capability};

/// The `Storage` node event of a lost mount made again.
pub const EVENT_VOLUME_REPAIRED: &str = "Volume repaired";
/// The `Storage` node event of a lost mount that could not be made again.
pub const EVENT_VOLUME_REPAIR_FAILED: &str = "Volume repair failed";

/// The longest wait between two repair attempts of the same volume.
const MAX_REPAIR_BACKOFF: Duration = Duration::from_secs(5 * 60);

/// Which mount of a volume usage was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostMount {
    /// The node's staging mount (`NodeStageVolume`).
    Staging,
    /// The alloc's publish target (`NodePublishVolume`).
    Publish,
}

impl LostMount {
    pub fn as_str(self) -> &'static str {
        match self {
            LostMount::Staging => "staging",
            LostMount::Publish => "publish",
        }
    }
}

/// What a repair did for one alloc's use of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRepair {
    pub alloc_id: String,
    pub plugin_id: String,
    pub volume_id: String,
    /// The alloc's publish target: the source its tasks bind.
    pub target: PathBuf,
    pub what: LostMount,
    /// The error when the repair failed (it is tried again later).
    pub error: Option<String>,
}

/// The repairs of one alloc, while its tasks run. Dropping it ends the
/// watch: the alloc's mounts are no longer repaired.
pub struct RepairWatch {
    alloc_id: String,
    id: u64,
    rx: mpsc::UnboundedReceiver<VolumeRepair>,
    repairs: Arc<Repairs>,
}

impl RepairWatch {
    /// The next repair of a volume of the alloc. Every repair of the
    /// alloc's volumes while the watch lives is handed on (a missed one
    /// would leave the task bound to the dead mount). Pends until one
    /// comes.
    pub async fn next(&mut self) -> Option<VolumeRepair> {
        self.rx.recv().await
    }
}

impl Drop for RepairWatch {
    fn drop(&mut self) {
        let mut watched = self.repairs.watched.locked();
        if let Some(watches) = watched.get_mut(&self.alloc_id) {
            watches.retain(|(id, _)| *id != self.id);
            if watches.is_empty() {
                watched.remove(&self.alloc_id);
            }
        }
    }
}

/// When a volume whose repair failed is tried again.
struct Retry {
    next_at: Instant,
    delays: ExponentialBackoff,
}

/// One watch of an alloc's repairs: its ID and where its notices go.
type WatchSender = (u64, mpsc::UnboundedSender<VolumeRepair>);

/// What one alloc's mount of a volume was made with.
struct Remembered {
    secrets: BTreeMap<String, String>,
    /// The alloc's own mount options and contexts: its publish is made
    /// again with them, not with another alloc's.
    context: MountContext,
}

/// What the manager keeps for repairs; in memory only.
pub(crate) struct Repairs {
    /// What each alloc's mount was made with (its secrets among it), by
    /// stub key and alloc.
    secrets: Mutex<HashMap<(String, String), Remembered>>,
    /// Allocs whose mounts are repaired, with their watches (by ID): each
    /// hears of the alloc's repairs only.
    watched: Mutex<HashMap<String, Vec<WatchSender>>>,
    next_watch: std::sync::atomic::AtomicU64,
    /// Volumes (stub keys) whose last repair failed.
    retries: Mutex<HashMap<String, Retry>>,
    /// The first wait after a failed repair.
    min_backoff: Duration,
}

impl Repairs {
    pub(crate) fn new(min_backoff: Duration) -> Arc<Repairs> {
        Arc::new(Repairs {
            secrets: Mutex::default(),
            watched: Mutex::default(),
            next_watch: std::sync::atomic::AtomicU64::new(0),
            retries: Mutex::default(),
            min_backoff,
        })
    }

    /// Keeps what `req` was mounted with (its secrets too), for a repair.
    pub(crate) fn remember(&self, req: &MountRequest) {
        let key = (req.stub_key(), req.alloc_id.clone());
        self.secrets.locked().insert(
            key,
            Remembered {
                secrets: req.secrets.clone(),
                context: MountContext::of(req),
            },
        );
    }

    /// Forgets what is kept for the allocs no stub records any more.
    pub(crate) fn forget_unused(&self, stubs: &[VolumeStub]) {
        let used: HashSet<(String, String)> = stubs
            .iter()
            .flat_map(|s| s.allocs.keys().map(move |a| (s.key(), a.clone())))
            .collect();
        self.secrets.locked().retain(|k, _| used.contains(k));
        let keys: HashSet<String> = stubs.iter().map(VolumeStub::key).collect();
        self.retries.locked().retain(|k, _| keys.contains(k));
    }

    /// The secrets to stage or publish `stub` for `alloc_id` again with:
    /// that alloc's, else any other alloc's of the same usage.
    fn secrets_for(&self, stub: &VolumeStub, alloc_id: Option<&str>) -> BTreeMap<String, String> {
        let key = stub.key();
        let secrets = self.secrets.locked();
        alloc_id
            .and_then(|a| secrets.get(&(key.clone(), a.to_string())))
            .or_else(|| {
                stub.allocs
                    .keys()
                    .find_map(|a| secrets.get(&(key.clone(), a.clone())))
            })
            .map(|r| r.secrets.clone())
            .unwrap_or_default()
    }

    /// What to publish `stub` for `alloc_id` again with: what that alloc
    /// mounted it with, else what the stub records (what it was staged
    /// with).
    fn context_for(&self, stub: &VolumeStub, alloc_id: &str) -> MountContext {
        self.secrets
            .locked()
            .get(&(stub.key(), alloc_id.to_string()))
            .map_or_else(|| stub.mounted_with.clone(), |r| r.context.clone())
    }

    /// Starts a watch of `alloc_id`'s repairs.
    fn watch(self: &Arc<Self>, alloc_id: &str) -> RepairWatch {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = self
            .next_watch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.watched
            .locked()
            .entry(alloc_id.to_string())
            .or_default()
            .push((id, tx));
        RepairWatch {
            alloc_id: alloc_id.to_string(),
            id,
            rx,
            repairs: self.clone(),
        }
    }

    /// Hands `repair` to the watches of its alloc (there may be none: the
    /// alloc's watch just ended).
    fn notify(&self, repair: VolumeRepair) {
        if let Some(watches) = self.watched.locked().get(&repair.alloc_id) {
            for (_, tx) in watches {
                let _ = tx.send(repair.clone());
            }
        }
    }

    fn watched_allocs(&self) -> HashSet<String> {
        self.watched.locked().keys().cloned().collect()
    }

    /// Whether a repair of the volume under `key` may be tried now.
    fn due(&self, key: &str) -> bool {
        self.retries
            .locked()
            .get(key)
            .is_none_or(|r| Instant::now() >= r.next_at)
    }

    fn succeeded(&self, key: &str) {
        self.retries.locked().remove(key);
    }

    /// Puts off the next repair of the volume under `key`, longer each time.
    fn failed(&self, key: &str) {
        let mut retries = self.retries.locked();
        let retry = retries.entry(key.to_string()).or_insert_with(|| Retry {
            next_at: Instant::now(),
            delays: ExponentialBuilder::default()
                .with_min_delay(self.min_backoff)
                .with_max_delay(MAX_REPAIR_BACKOFF)
                .without_max_times()
                .build(),
        });
        let wait = retry.delays.next().unwrap_or(MAX_REPAIR_BACKOFF);
        retry.next_at = Instant::now() + wait;
    }
}

impl CsiManager {
    /// Starts watching the repairs of `alloc_id`'s volumes: while a watch
    /// lives, lost mounts of the alloc are made again and reported to it.
    pub fn watch_repairs(&self, alloc_id: &str) -> RepairWatch {
        self.repairs.watch(alloc_id)
    }

    /// One repair round: for each volume usage of a watched alloc whose
    /// node plugin is healthy, stages again when the staging mount is lost
    /// and publishes again every watched alloc's lost target. See the
    /// module docs.
    pub async fn repair_lost_mounts(&self) {
        let stubs = self.volumes.stubs();
        self.repairs.forget_unused(&stubs);
        let watched = self.repairs.watched_allocs();
        let candidates: Vec<VolumeStub> = stubs
            .into_iter()
            .filter(|s| s.allocs.keys().any(|a| watched.contains(a)))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let mounts = mount_points().await;
        for stub in candidates {
            let key = stub.key();
            let Some(supports_stage) = self.node_plugin_ready(&stub.plugin_id) else {
                continue;
            };
            let lost = lost_mounts(&stub, supports_stage, &watched, &mounts).await;
            if lost.is_none() {
                self.repairs.succeeded(&key);
                continue;
            }
            if !self.repairs.due(&key) {
                continue;
            }
            let span = tracing::info_span!("repair_volume", plugin_id = %stub.plugin_id, volume_id = %stub.volume_id);
            if self
                .repair_volume(&stub.plugin_id, &stub.volume_id, &key, supports_stage)
                .instrument(span)
                .await
            {
                self.repairs.succeeded(&key);
            } else {
                self.repairs.failed(&key);
            }
        }
    }

    /// Whether `plugin_id`'s node service is registered healthy, and if so
    /// whether it stages.
    fn node_plugin_ready(&self, plugin_id: &str) -> Option<bool> {
        let entry = self.registry.entry(plugin_id)?;
        if entry.unhealthy.is_some() || entry.registration.plugin_type == CsiPluginType::Controller
        {
            return None;
        }
        let node = self.plugin_fingerprint(plugin_id)?.node?;
        node.healthy.then_some(node.supports_stage_unstage)
    }

    /// Repairs the usage under `key` under the volume's lock; whether all
    /// went well (or nothing was left to do).
    async fn repair_volume(
        &self,
        plugin_id: &str,
        volume_id: &str,
        key: &str,
        supports_stage: bool,
    ) -> bool {
        let _lock = self.volumes.lock_volume(plugin_id, volume_id).await;
        // Looked at again under the lock: a mount or unmount may have run.
        let Some(stub) = self.volumes.stub(key) else {
            return true;
        };
        let watched = self.repairs.watched_allocs();
        let mounts = mount_points().await;
        let Some(lost) = lost_mounts(&stub, supports_stage, &watched, &mounts).await else {
            return true;
        };
        let users: Vec<(String, PathBuf)> = stub
            .allocs
            .iter()
            .filter(|(a, _)| watched.contains(*a))
            .map(|(a, t)| (a.clone(), t.clone()))
            .collect();
        let client = match self.client(plugin_id).await {
            Ok(c) => c,
            Err(e) => {
                let what = if lost.staging {
                    LostMount::Staging
                } else {
                    LostMount::Publish
                };
                for (alloc_id, target) in &users {
                    self.report_repair(&stub, alloc_id, target, what, Some(&e));
                }
                return false;
            }
        };
        if lost.staging {
            let staged = self.stage_again(&client, &stub).await;
            for (alloc_id, target) in &users {
                self.report_repair(
                    &stub,
                    alloc_id,
                    target,
                    LostMount::Staging,
                    staged.as_ref().err(),
                );
            }
            if staged.is_err() {
                return false;
            }
        }
        let mut ok = true;
        for (alloc_id, target) in &lost.targets {
            let published = self
                .publish_again(&client, &stub, alloc_id, target, supports_stage)
                .await;
            self.report_repair(
                &stub,
                alloc_id,
                target,
                LostMount::Publish,
                published.as_ref().err(),
            );
            ok &= published.is_ok();
        }
        ok
    }

    async fn stage_again(&self, client: &CsiClient, stub: &VolumeStub) -> Result<(), CsiError> {
        let staging = stub.staging_path.clone();
        detach_dead_mount(&staging).await?;
        create_dir_all(&staging)?;
        let ctx = &stub.mounted_with;
        let req = csi::NodeStageVolumeRequest {
            volume_id: stub.external_id.clone(),
            publish_context: to_map(&ctx.publish_context),
            staging_target_path: path_string(&staging)?,
            volume_capability: Some(volume_capability(
                stub.access_mode,
                stub.attachment_mode,
                &ctx.mount_options,
            )),
            secrets: to_map(&self.repairs.secrets_for(stub, None)),
            volume_context: to_map(&ctx.volume_context),
        };
        self.volumes
            .with_retry("NodeStageVolume", || client.node_stage_volume(req.clone()))
            .await
            .map(|_| ())
    }

    async fn publish_again(
        &self,
        client: &CsiClient,
        stub: &VolumeStub,
        alloc_id: &str,
        target: &Path,
        supports_stage: bool,
    ) -> Result<(), CsiError> {
        detach_dead_mount(target).await?;
        match stub.attachment_mode {
            AttachmentMode::FileSystem => create_dir_all(target)?,
            AttachmentMode::BlockDevice => {
                if let Some(parent) = target.parent() {
                    create_dir_all(parent)?;
                }
            }
        }
        let ctx = &self.repairs.context_for(stub, alloc_id);
        let req = csi::NodePublishVolumeRequest {
            volume_id: stub.external_id.clone(),
            publish_context: to_map(&ctx.publish_context),
            staging_target_path: if supports_stage {
                path_string(&stub.staging_path)?
            } else {
                String::new()
            },
            target_path: path_string(target)?,
            volume_capability: Some(volume_capability(
                stub.access_mode,
                stub.attachment_mode,
                &ctx.mount_options,
            )),
            readonly: stub.read_only || stub.access_mode.is_reader_only(),
            secrets: to_map(&self.repairs.secrets_for(stub, Some(alloc_id))),
            volume_context: to_map(&ctx.volume_context),
        };
        self.volumes
            .with_retry("NodePublishVolume", || {
                client.node_publish_volume(req.clone())
            })
            .await
            .map(|_| ())
    }

    /// The node event, the log line and the notice to the alloc's
    /// watchers of one repair.
    fn report_repair(
        &self,
        stub: &VolumeStub,
        alloc_id: &str,
        target: &Path,
        what: LostMount,
        error: Option<&CsiError>,
    ) {
        let (plugin_id, volume_id) = (&stub.plugin_id, &stub.volume_id);
        let message = match error {
            None => {
                tracing::info!(%plugin_id, %volume_id, %alloc_id, what = what.as_str(), "repaired a lost volume mount");
                EVENT_VOLUME_REPAIRED
            }
            Some(e) => {
                tracing::warn!(%plugin_id, %volume_id, %alloc_id, what = what.as_str(), error = %e, "repairing a lost volume mount failed; trying again later");
                EVENT_VOLUME_REPAIR_FAILED
            }
        };
        let mut event = NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, message)
            .with_detail("volume_id", volume_id.as_str())
            .with_detail("alloc_id", alloc_id)
            .with_detail("what", what.as_str());
        if let Some(e) = error {
            event = event.with_detail("error", e.to_string());
        }
        self.events.emit(event);
        self.repairs.notify(VolumeRepair {
            alloc_id: alloc_id.to_string(),
            plugin_id: plugin_id.clone(),
            volume_id: volume_id.clone(),
            target: target.to_path_buf(),
            what,
            error: error.map(ToString::to_string),
        });
    }
}

/// What of a usage is lost: its staging mount, and the watched allocs'
/// publish targets.
struct Lost {
    staging: bool,
    targets: Vec<(String, PathBuf)>,
}

async fn lost_mounts(
    stub: &VolumeStub,
    supports_stage: bool,
    watched: &HashSet<String>,
    mounts: &HashSet<PathBuf>,
) -> Option<Lost> {
    // A stage that mounted nothing has no mount to lose.
    let staging = if supports_stage
        && stub.staged
        && !stub.unstaging
        && stub.staging_mounted != Some(false)
    {
        !staging_is_live(&stub.staging_path, stub.attachment_mode, mounts).await
    } else {
        false
    };
    let mut targets = Vec::new();
    for (alloc_id, target) in &stub.allocs {
        if watched.contains(alloc_id) && !mount_is_live(target, mounts).await {
            targets.push((alloc_id.clone(), target.clone()));
        }
    }
    (staging || !targets.is_empty()).then_some(Lost { staging, targets })
}

/// How long a mount may take to answer `stat`. One that takes longer (a
/// hard NFS mount whose server is away, say) is left alone for the round,
/// so that a round never hangs on it.
const MOUNT_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `path` is a mount point (in `mounts`, by the path mountinfo
/// shows: symlinks above it resolved) that answers: `stat` on a mount
/// whose backing went away fails with `ENOTCONN`, `ESTALE` or `EIO`.
pub async fn mount_is_live(path: &Path, mounts: &HashSet<PathBuf>) -> bool {
    if !mounts.contains(path) && !mounts.contains(&as_mountinfo_shows(path)) {
        return false;
    }
    let p = path.to_path_buf();
    answers_within(path, MOUNT_ANSWER_TIMEOUT, move || {
        nix::sys::stat::stat(&p).map(|_| ())
    })
    .await
}

/// Whether the staging of a usage at `staging` is there and answers. A
/// filesystem volume is staged as a mount at the staging path. A block
/// volume is staged as a device that the plugin binds inside the staging
/// directory (`hostpath-plugin` at `<staging>/device`, other plugins under
/// their own names): a live mount at or below the staging path.
pub(crate) async fn staging_is_live(
    staging: &Path,
    attach: AttachmentMode,
    mounts: &HashSet<PathBuf>,
) -> bool {
    match attach {
        AttachmentMode::FileSystem => mount_is_live(staging, mounts).await,
        AttachmentMode::BlockDevice => {
            let shown = as_mountinfo_shows(staging);
            let below: Vec<&PathBuf> = mounts
                .iter()
                .filter(|m| m.starts_with(staging) || m.starts_with(&shown))
                .collect();
            for m in below {
                if mount_is_live(m, mounts).await {
                    return true;
                }
            }
            false
        }
    }
}

/// `path` with its parent resolved, as mountinfo lists mount points. The
/// last part is not resolved: it may be a dead mount that fails `stat`.
fn as_mountinfo_shows(path: &Path) -> PathBuf {
    match (path.parent().map(Path::canonicalize), path.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => path.to_path_buf(),
    }
}

/// Runs `stat` off the async threads (a dead mount may be slow to answer);
/// whether the mount at `path` answered as a live one. Past `limit` it is
/// taken as live: it is not known dead, and the next round looks again.
async fn answers_within(
    path: &Path,
    limit: Duration,
    stat: impl FnOnce() -> nix::Result<()> + Send + 'static,
) -> bool {
    match tokio::time::timeout(limit, tokio::task::spawn_blocking(stat)).await {
        Ok(Ok(Ok(()))) => true,
        Ok(Ok(Err(Errno::ENOTCONN | Errno::ESTALE | Errno::EIO))) => false,
        // Any other failure (permissions, say) is not a dead mount.
        Ok(Ok(Err(_))) | Ok(Err(_)) => true,
        Err(_) => {
            tracing::warn!(path = %path.display(), waited = ?limit, "a volume mount does not answer; not repairing it this round");
            true
        }
    }
}

/// The mount points of this mount namespace, read off the async threads.
pub async fn mount_points() -> HashSet<PathBuf> {
    tokio::task::spawn_blocking(|| mountinfo::mount_points().into_iter().collect())
        .await
        .unwrap_or_default()
}

/// Detaches whatever is mounted at `path` (a dead mount), lazily: users
/// of the old mount keep it until they let go. Nothing mounted is fine.
pub(crate) async fn detach_dead_mount(path: &Path) -> Result<(), CsiError> {
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        mountinfo::detach_all(&p)
            .map_err(|e| CsiError::Io(format!("detaching the dead mount at {}: {e}", p.display())))
    })
    .await
    .map_err(|e| CsiError::Io(format!("detaching a dead mount: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_mount_that_does_not_answer_is_left_alone_without_hanging_the_round() {
        let (release, parked) = std::sync::mpsc::channel::<()>();
        let started = std::time::Instant::now();
        let live = answers_within(Path::new("/hung"), Duration::from_millis(50), move || {
            // A stat stuck in the kernel, until the test lets go.
            let _ = parked.recv();
            Err(Errno::EIO)
        })
        .await;
        assert!(live, "a mount not known dead is not repaired");
        assert!(started.elapsed() < Duration::from_secs(5));
        release.send(()).unwrap();
        assert!(
            !answers_within(Path::new("/dead"), Duration::from_secs(5), || Err(
                Errno::ENOTCONN
            ))
            .await
        );
        assert!(answers_within(Path::new("/ok"), Duration::from_secs(5), || Ok(())).await);
        assert!(
            answers_within(Path::new("/denied"), Duration::from_secs(5), || Err(
                Errno::EACCES
            ))
            .await
        );
    }

    #[test]
    fn a_mount_point_is_found_by_the_path_mountinfo_shows() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::os::unix::fs::symlink(&real, real.join("link")).unwrap();
        let via_link = real.join("link").join("target");
        assert_eq!(as_mountinfo_shows(&via_link), real.join("target"));
        assert_eq!(as_mountinfo_shows(Path::new("/")), PathBuf::from("/"));
    }

    fn repair_of(alloc_id: &str, volume_id: &str) -> VolumeRepair {
        VolumeRepair {
            alloc_id: alloc_id.into(),
            plugin_id: "hostpath".into(),
            volume_id: volume_id.into(),
            target: PathBuf::from(format!("/csi/{alloc_id}/{volume_id}")),
            what: LostMount::Publish,
            error: None,
        }
    }

    #[tokio::test]
    async fn a_watch_hears_every_repair_of_its_alloc_however_many_others_are_repaired() {
        let repairs = Repairs::new(Duration::from_secs(1));
        let mut mine = repairs.watch("a1");
        let mut other = repairs.watch("a2");
        let mut second_task = repairs.watch("a1");
        repairs.notify(repair_of("a1", "first"));
        // A plugin restart on a busy node: many other allocs' volumes are
        // repaired before this alloc's tasks get to look.
        for i in 0..1000 {
            repairs.notify(repair_of("a2", &format!("v{i}")));
        }
        repairs.notify(repair_of("a1", "last"));
        for watch in [&mut mine, &mut second_task] {
            for want in ["first", "last"] {
                let got = tokio::time::timeout(Duration::from_secs(5), watch.next())
                    .await
                    .expect("the alloc's repair is handed on")
                    .unwrap();
                assert_eq!(
                    (got.alloc_id.as_str(), got.volume_id.as_str()),
                    ("a1", want)
                );
            }
        }
        assert_eq!(other.next().await.unwrap().volume_id, "v0");
        // A watch that ends stops being watched; the alloc stays watched
        // while another of its watches lives.
        drop(mine);
        assert!(repairs.watched_allocs().contains("a1"));
        drop(second_task);
        assert!(!repairs.watched_allocs().contains("a1"));
        repairs.notify(repair_of("a1", "unheard"));
        drop(other);
        assert!(repairs.watched_allocs().is_empty());
    }

    #[test]
    fn a_publish_is_made_again_with_its_own_allocs_mount_options() {
        use berth_structs::{AccessMode, AttachmentMode, CsiMountOptions};
        let repairs = Repairs::new(Duration::from_secs(1));
        let req = |alloc_id: &str, flags: &[&str]| MountRequest {
            plugin_id: "hostpath".into(),
            volume_id: "data".into(),
            external_id: "ext".into(),
            alloc_id: alloc_id.into(),
            access_mode: AccessMode::MultiNodeMultiWriter,
            attachment_mode: AttachmentMode::FileSystem,
            read_only: false,
            mount_options: CsiMountOptions {
                fs_type: String::new(),
                mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            },
            publish_context: BTreeMap::new(),
            volume_context: BTreeMap::new(),
            secrets: BTreeMap::from([("token".to_string(), format!("{alloc_id}-secret"))]),
        };
        let (a, b) = (req("a", &["noexec"]), req("b", &[]));
        repairs.remember(&a);
        repairs.remember(&b);
        let stub = VolumeStub {
            plugin_id: "hostpath".into(),
            volume_id: "data".into(),
            external_id: "ext".into(),
            access_mode: AccessMode::MultiNodeMultiWriter,
            attachment_mode: AttachmentMode::FileSystem,
            read_only: false,
            staging_path: "/csi/staging".into(),
            staged: true,
            staging_mounted: None,
            unstaging: false,
            allocs: [
                ("a".to_string(), "/csi/a".into()),
                ("b".to_string(), "/csi/b".into()),
            ]
            .into(),
            mounted_with: MountContext::of(&a),
        };
        assert_eq!(
            repairs.context_for(&stub, "a").mount_options.mount_flags,
            ["noexec"]
        );
        assert!(repairs
            .context_for(&stub, "b")
            .mount_options
            .mount_flags
            .is_empty());
        assert_eq!(repairs.secrets_for(&stub, Some("b"))["token"], "b-secret");
        // Nothing remembered (not mounted since the agent started): what
        // the stub records.
        assert_eq!(repairs.context_for(&stub, "c"), stub.mounted_with);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_repairs_back_off_and_a_success_clears_it() {
        let repairs = Repairs::new(Duration::from_secs(2));
        assert!(repairs.due("k"));
        repairs.failed("k");
        assert!(!repairs.due("k"));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(repairs.due("k"));
        repairs.failed("k");
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(!repairs.due("k"), "the second wait is longer");
        repairs.succeeded("k");
        assert!(repairs.due("k"));
    }
}
