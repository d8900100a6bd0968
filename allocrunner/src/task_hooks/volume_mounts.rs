//! Binds the alloc's mounted CSI volumes into the task directory.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use berth_csimanager::{LostMount, MountInfo};
use berth_structs::{check_destination, PropagationMode, VolumeMount};
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use tracing::{info, warn, Instrument};

use super::{KillRequest, TaskControl, TaskHook, TaskHookContext};
use crate::error::HookError;
use crate::state::TaskEvents;

/// For each `volume_mount` of the task, bind-mounts the volume's
/// [`MountInfo::source`] at `<task_dir>/<destination>` (read-only when the
/// mount or the volume is, with the mount's `propagation_mode`); unmounts
/// them when the task is done. A block volume's source is a device file,
/// bound onto a file at the destination. The mounts
/// stay across restarts of the task. While the task runs, a volume whose
/// lost mount csimanager made again is bound again (the task keeps
/// running); one that could not be made again kills the task for a restart
/// per its restart policy.
#[derive(Debug, Default)]
pub struct VolumeMountsHook {
    mounted: Vec<PathBuf>,
    /// Follows csimanager's repairs of the alloc's volumes while the task
    /// runs.
    repairs: Option<tokio::task::JoinHandle<()>>,
}

/// The task event of a lost volume mount made again and bound again.
pub const EVENT_VOLUME_REPAIRED: &str = "Volume Repaired";
/// The task event of a lost volume mount that could not be made again.
pub const EVENT_VOLUME_REPAIR_FAILED: &str = "Volume Repair Failed";

/// One `volume_mount` of the task, as bound.
#[derive(Debug, Clone)]
struct Bound {
    volume: String,
    target: PathBuf,
    info: MountInfo,
    read_only: bool,
    propagation: PropagationMode,
}

impl VolumeMountsHook {
    /// The targets this hook has mounted and not yet unmounted.
    pub fn mounted(&self) -> &[PathBuf] {
        &self.mounted
    }

    /// Mounts every one of `volume_mounts` below `task_dir` that is not
    /// mounted yet. On failure, what was mounted stays recorded for
    /// [`Self::unmount_all`].
    pub fn mount_all(
        &mut self,
        task_dir: &Path,
        volume_mounts: &[VolumeMount],
        mounts: &BTreeMap<String, MountInfo>,
    ) -> Result<(), HookError> {
        let root = task_dir
            .canonicalize()
            .map_err(|e| HookError::io("resolving task dir", task_dir, e))?;
        for m in volume_mounts {
            check_destination(&m.destination).map_err(|e| {
                HookError::Invalid(format!("volume_mount destination {:?} {e}", m.destination))
            })?;
            let info = mounts.get(&m.volume).ok_or_else(|| {
                HookError::Invalid(format!(
                    "volume_mount names volume {:?}, which is not mounted for this alloc",
                    m.volume
                ))
            })?;
            // A block volume is a device file: it is bound onto a file.
            let is_device = std::fs::metadata(&info.source).is_ok_and(|md| !md.is_dir());
            let read_only = m.read_only || info.read_only;
            if is_device && read_only && !info.read_only {
                // A read-only bind of a device file lets writes through.
                return Err(HookError::Invalid(format!(
                    "volume_mount of block volume {:?} is read-only but the volume is claimed \
                     writable: a read-only bind of a device does not stop writes to it",
                    m.volume
                )));
            }
            let target = make_path_inside(&root, &m.destination, is_device)?;
            if self.mounted.contains(&target) {
                continue;
            }
            if let Err((e, left_mounted)) =
                bind_into(&info.source, &target, read_only, m.propagation_mode)
            {
                if left_mounted {
                    self.mounted.push(target);
                }
                return Err(e);
            }
            info!(volume = %m.volume, target = %target.display(), read_only, propagation_mode = %m.propagation_mode, "bound volume into the task dir");
            self.mounted.push(target);
        }
        Ok(())
    }

    /// Takes over the bind mounts of `volume_mounts` already present below
    /// `task_dir` (made before an agent restart, still used by the task):
    /// they are kept and unmounted when the task is done. Missing ones are
    /// left for [`Self::mount_all`] to make.
    pub fn adopt_existing(
        &mut self,
        task_dir: &Path,
        volume_mounts: &[VolumeMount],
    ) -> Result<(), HookError> {
        let root = task_dir
            .canonicalize()
            .map_err(|e| HookError::io("resolving task dir", task_dir, e))?;
        let present = crate::alloc_dir::mounts_below(&root);
        for m in volume_mounts {
            if check_destination(&m.destination).is_err() {
                continue;
            }
            let target = lexical_join(&root, &m.destination);
            if present.contains(&target) && !self.mounted.contains(&target) {
                info!(volume = %m.volume, target = %target.display(), "kept the volume bound in the task dir");
                self.mounted.push(target);
            }
        }
        Ok(())
    }

    /// Stops following repairs and waits until the follower is gone: a
    /// rebind in progress finishes first, so nothing is bound into the
    /// task dir after this returns (an unmount right after would miss it).
    async fn stop_following_repairs(&mut self) {
        if let Some(r) = self.repairs.take() {
            r.abort();
            let _ = r.await;
        }
    }

    /// Unmounts every target this hook mounted, last first. Targets that
    /// cannot be unmounted stay recorded.
    pub fn unmount_all(&mut self) -> Result<(), HookError> {
        let mut errs = Vec::new();
        let mut left = Vec::new();
        while let Some(target) = self.mounted.pop() {
            match unmount(&target) {
                Ok(()) => info!(target = %target.display(), "unbound volume from the task dir"),
                Err(errno) => {
                    errs.push(HookError::Unbind {
                        target: target.clone(),
                        errno,
                    });
                    left.push(target);
                }
            }
        }
        left.reverse();
        self.mounted = left;
        HookError::from_many(errs)
    }
}

fn unmount(target: &Path) -> Result<(), Errno> {
    match umount2(target, MntFlags::empty()) {
        // Not a mount point (any more) or gone: nothing to undo.
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(Errno::EBUSY) => {
            warn!(target = %target.display(), "mount busy; detaching it");
            umount2(target, MntFlags::MNT_DETACH)
        }
        Err(e) => Err(e),
    }
}

/// Bind-mounts `source` at `target`, read-only when asked, with the
/// propagation asked for: `private` cuts the bind off from later mounts on
/// either side; `host-to-task` makes the source a shared mount (if it is
/// not one) and the bind its slave, so mounts made under the source later
/// show in the task dir; `bidirectional` makes both one shared peer group.
/// On failure the bind is undone; the flag says whether it could not be.
fn bind_into(
    source: &Path,
    target: &Path,
    read_only: bool,
    propagation: PropagationMode,
) -> Result<(), (HookError, bool)> {
    let bind_error = |errno| HookError::Bind {
        src: source.to_path_buf(),
        target: target.to_path_buf(),
        errno,
    };
    if propagation != PropagationMode::Private {
        make_shared(source, propagation).map_err(|e| (e, false))?;
    }
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|errno| (bind_error(errno), false))?;
    let finish = || -> Result<(), Errno> {
        if read_only {
            mount(
                None::<&str>,
                target,
                None::<&str>,
                MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
                None::<&str>,
            )?;
        }
        let flag = match propagation {
            PropagationMode::Private => MsFlags::MS_PRIVATE,
            PropagationMode::HostToTask => MsFlags::MS_SLAVE,
            PropagationMode::Bidirectional => MsFlags::MS_SHARED,
        };
        mount(None::<&str>, target, None::<&str>, flag, None::<&str>)
    };
    if let Err(errno) = finish() {
        // Never leave a writable or wrongly propagating bind behind.
        let left = match umount2(target, MntFlags::MNT_DETACH) {
            Ok(()) => false,
            Err(e) => {
                warn!(target = %target.display(), error = %e, "undoing a bind mount that could not be finished");
                true
            }
        };
        return Err((bind_error(errno), left));
    }
    Ok(())
}

/// Makes the mount at `source` a shared mount unless it is one already.
fn make_shared(source: &Path, propagation: PropagationMode) -> Result<(), HookError> {
    if mount_is_shared(source) {
        return Ok(());
    }
    mount(
        None::<&str>,
        source,
        None::<&str>,
        MsFlags::MS_SHARED,
        None::<&str>,
    )
    .map_err(|errno| {
        HookError::Invalid(format!(
            "propagation_mode {propagation} needs the volume's host path {} to be a mount point \
             that can be made shared: {errno}",
            source.display()
        ))
    })
}

/// Whether the topmost mount at `path` is in a shared peer group.
fn mount_is_shared(path: &Path) -> bool {
    path.canonicalize()
        .is_ok_and(|path| berth_csimanager::mountinfo::is_shared(&path))
}

/// Makes `rel` (lexically normalized) below `root`: directories, and the
/// last part a file when `file` (the mount point of a device). Refuses to
/// follow a symlink or to leave `root`: the task owns its directory and
/// could have put a symlink where a mount should go.
fn make_path_inside(root: &Path, rel: &str, file: bool) -> Result<PathBuf, HookError> {
    if !file {
        return make_dir_inside(root, rel);
    }
    let mut parts = normalized(rel)?;
    let Some(last) = parts.pop() else {
        return Err(HookError::Invalid(format!(
            "volume_mount destination {rel:?} names the task dir itself"
        )));
    };
    let parent = make_dir_inside_parts(root, rel, &parts)?;
    let path = parent.join(last);
    match std::fs::symlink_metadata(&path) {
        Ok(md) if md.file_type().is_symlink() => Err(HookError::Invalid(format!(
            "volume_mount destination {rel:?}: {} is a symlink",
            path.display()
        ))),
        Ok(md) if md.is_dir() => Err(HookError::Invalid(format!(
            "volume_mount destination {rel:?}: {} is a directory, but the volume is a block \
             device, bound onto a file",
            path.display()
        ))),
        Ok(_) => Ok(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| HookError::io("creating mount point", &path, e))?;
            Ok(path)
        }
        Err(e) => Err(HookError::io("inspecting mount point", &path, e)),
    }
}

/// Makes `rel` (lexically normalized) below `root`, refusing to follow a
/// symlink or to leave `root`: the task owns its directory and could have
/// put a symlink where a mount should go.
fn make_dir_inside(root: &Path, rel: &str) -> Result<PathBuf, HookError> {
    let parts = normalized(rel)?;
    make_dir_inside_parts(root, rel, &parts)
}

fn make_dir_inside_parts(
    root: &Path,
    rel: &str,
    parts: &[&std::ffi::OsStr],
) -> Result<PathBuf, HookError> {
    let mut path = root.to_path_buf();
    for p in parts {
        path.push(p);
        match std::fs::symlink_metadata(&path) {
            Ok(md) if md.file_type().is_symlink() => {
                return Err(HookError::Invalid(format!(
                    "volume_mount destination {rel:?}: {} is a symlink",
                    path.display()
                )))
            }
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(HookError::Invalid(format!(
                    "volume_mount destination {rel:?}: {} is not a directory",
                    path.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&path)
                    .map_err(|e| HookError::io("creating mount point", &path, e))?;
            }
            Err(e) => return Err(HookError::io("inspecting mount point", &path, e)),
        }
    }
    Ok(path)
}

/// `rel` lexically normalized below `root`, without touching the disk.
fn lexical_join(root: &Path, rel: &str) -> PathBuf {
    let mut path = root.to_path_buf();
    for p in normalized(rel).unwrap_or_default() {
        path.push(p);
    }
    path
}

/// The components of a relative `rel`, with `.` and `..` resolved.
fn normalized(rel: &str) -> Result<Vec<&std::ffi::OsStr>, HookError> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::ParentDir => {
                parts.pop();
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(HookError::Invalid(format!(
                    "volume_mount destination {rel:?} must be relative"
                )))
            }
        }
    }
    Ok(parts)
}

#[async_trait::async_trait]
impl TaskHook for VolumeMountsHook {
    fn name(&self) -> &'static str {
        "volume_mounts"
    }

    async fn prestart(&mut self, ctx: &mut TaskHookContext) -> Result<(), HookError> {
        if ctx.restoring {
            self.adopt_existing(&ctx.task_dir.dir, &ctx.task.volume_mounts)?;
        }
        self.mount_all(&ctx.task_dir.dir, &ctx.task.volume_mounts, &ctx.mounts)?;
        give_writable_volumes_to(&ctx.task, &ctx.mounts);
        Ok(())
    }

    async fn poststart(
        &mut self,
        ctx: &TaskHookContext,
        task: &TaskControl,
    ) -> Result<(), HookError> {
        self.stop_following_repairs().await;
        let Ok(root) = ctx.task_dir.dir.canonicalize() else {
            return Ok(());
        };
        let bound: Vec<Bound> = ctx
            .task
            .volume_mounts
            .iter()
            .filter_map(|m| {
                let info = ctx.mounts.get(&m.volume)?.clone();
                Some(Bound {
                    volume: m.volume.clone(),
                    target: lexical_join(&root, &m.destination),
                    read_only: m.read_only || info.read_only,
                    propagation: m.propagation_mode,
                    info,
                })
            })
            .collect();
        if bound.is_empty() {
            return Ok(());
        }
        let watch = ctx.config.csi.watch_repairs(&ctx.alloc.id);
        let span =
            tracing::info_span!("volume_repairs", alloc_id = %ctx.alloc.id, task = %ctx.task.name);
        self.repairs = Some(tokio::spawn(
            follow_repairs(watch, bound, ctx.events.clone(), task.clone()).instrument(span),
        ));
        Ok(())
    }

    async fn exited(&mut self, _ctx: &TaskHookContext) {
        self.stop_following_repairs().await;
    }

    async fn stop(&mut self, _ctx: &TaskHookContext) -> Result<(), HookError> {
        self.stop_following_repairs().await;
        self.unmount_all()
    }
}

/// Until the task exits: binds each repaired volume of `bound` again (the
/// old bind shows the dead mount), with a task event; kills the task for a
/// restart when a repair failed or the new mount cannot be bound.
async fn follow_repairs(
    mut watch: berth_csimanager::RepairWatch,
    bound: Vec<Bound>,
    events: TaskEvents,
    task: TaskControl,
) {
    while let Some(repair) = watch.next().await {
        let mine: Vec<&Bound> = bound
            .iter()
            .filter(|b| b.info.source == repair.target)
            .collect();
        let Some(first) = mine.first() else {
            continue;
        };
        let what = repair.what.as_str();
        let failure = match &repair.error {
            Some(e) => Some(format!(
                "volume {:?} lost its {what} mount and it could not be made again: {e}",
                first.volume
            )),
            None if repair.what == LostMount::Publish => mine
                .iter()
                .find_map(|b| rebind(b).err())
                .map(|e| format!("volume {:?} was mounted again but could not be bound into the task dir: {e}", first.volume)),
            None => None,
        };
        match failure {
            None => {
                info!(volume = %first.volume, volume_id = %repair.volume_id, what, "volume mount repaired");
                events.emit(
                    EVENT_VOLUME_REPAIRED,
                    format!(
                        "volume {:?} lost its {what} mount; it is mounted again",
                        first.volume
                    ),
                );
            }
            Some(message) => {
                warn!(volume = %first.volume, volume_id = %repair.volume_id, error = %message, "volume repair failed; killing the task for a restart");
                events.emit(EVENT_VOLUME_REPAIR_FAILED, message.clone());
                task.kill(KillRequest {
                    reason: message,
                    restart: true,
                });
            }
        }
    }
}

/// Replaces the bind of `b` in the task dir with a bind of its (new)
/// source: the old one is detached lazily, so the task's open files on it
/// do not block it.
fn rebind(b: &Bound) -> Result<(), HookError> {
    berth_csimanager::mountinfo::detach_all(&b.target).map_err(|errno| HookError::Unbind {
        target: b.target.clone(),
        errno,
    })?;
    // The task owns its dir: it may have put a symlink where its mount was.
    if std::fs::symlink_metadata(&b.target).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(HookError::Invalid(format!(
            "volume_mount of volume {:?}: {} is a symlink; the repaired volume is not bound \
             through it",
            b.volume,
            b.target.display()
        )));
    }
    bind_into(&b.info.source, &b.target, b.read_only, b.propagation).map_err(|(e, _)| e)?;
    info!(volume = %b.volume, target = %b.target.display(), "bound the repaired volume into the task dir");
    Ok(())
}

/// Makes the root of each volume `task` mounts writable its user's, when
/// the task does not run as root and the root is root's (as a plugin
/// makes a new volume): an `exec` task (`nobody` unless it names a user)
/// can then write the volume it claimed for writing. Only the root dir
/// changes hands, and only from root: what a user already owns stays as
/// it is.
fn give_writable_volumes_to(task: &berth_structs::Task, mounts: &BTreeMap<String, MountInfo>) {
    use std::os::unix::fs::MetadataExt;
    let user = match (task.user.as_str(), task.driver.as_str()) {
        ("", "exec") => crate::isolation::DEFAULT_USER,
        ("", _) => return,
        (user, _) => user,
    };
    let Ok((uid, gid)) = crate::isolation::resolve_user(user) else {
        return; // The driver refuses the task, naming the user.
    };
    if uid == 0 {
        return;
    }
    for m in task.volume_mounts.iter().filter(|m| !m.read_only) {
        let Some(info) = mounts.get(&m.volume).filter(|i| !i.read_only) else {
            continue;
        };
        let root_owned =
            std::fs::metadata(&info.source).is_ok_and(|md| md.is_dir() && md.uid() == 0);
        if !root_owned {
            continue;
        }
        match nix::unistd::chown(
            &info.source,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        ) {
            Ok(()) => info!(volume = %m.volume, user, uid, "the volume's root is the task user's"),
            Err(e) => {
                warn!(volume = %m.volume, user, error = %e, "giving the volume's root to the task's user failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_made_inside_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let p = make_dir_inside(&root, "a/../b/c").unwrap();
        assert_eq!(p, root.join("b/c"));
        assert!(p.is_dir());
        std::os::unix::fs::symlink("/etc", root.join("evil")).unwrap();
        assert!(make_dir_inside(&root, "evil/x").is_err());
        assert!(!Path::new("/etc/x").exists());
    }

    /// A temp dir with a tmpfs mounted at `<root>/volume` (the volume's host
    /// path, a mount point as a publish target is) and a task dir; every
    /// mount below it is undone when the fixture is dropped.
    struct Fixture {
        root: PathBuf,
        _cleanup: berth_testutil::MountCleanup,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().canonicalize().unwrap();
            let cleanup = berth_testutil::MountCleanup(root.clone());
            for d in ["volume", "task"] {
                std::fs::create_dir(root.join(d)).unwrap();
            }
            tmpfs(&root.join("volume"));
            std::fs::create_dir(root.join("volume/sub")).unwrap();
            Fixture {
                root,
                _cleanup: cleanup,
                _dir: dir,
            }
        }

        fn bind(&self, mode: PropagationMode) -> VolumeMountsHook {
            let mounts = BTreeMap::from([(
                "vol".to_string(),
                MountInfo {
                    source: self.root.join("volume"),
                    read_only: false,
                },
            )]);
            let mut hook = VolumeMountsHook::default();
            hook.mount_all(
                &self.root.join("task"),
                &[VolumeMount {
                    volume: "vol".into(),
                    destination: "data".into(),
                    read_only: false,
                    propagation_mode: mode,
                }],
                &mounts,
            )
            .unwrap();
            hook
        }
    }

    fn tmpfs(at: &Path) {
        mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
    }

    fn is_mount_point(path: &Path) -> bool {
        crate::alloc_dir::mounts_below(path).contains(&path.to_path_buf())
    }

    #[test]
    fn host_to_task_shows_a_later_mount_under_the_source_in_the_task_dir() {
        let f = Fixture::new();
        let mut hook = f.bind(PropagationMode::HostToTask);
        assert!(
            mount_is_shared(&f.root.join("volume")),
            "the source was made shared"
        );
        tmpfs(&f.root.join("volume/sub"));
        std::fs::write(f.root.join("volume/sub/later"), "x").unwrap();
        let seen = f.root.join("task/data/sub");
        assert!(is_mount_point(&seen), "the later mount propagated");
        assert_eq!(std::fs::read_to_string(seen.join("later")).unwrap(), "x");
        // Nothing flows back: a mount in the task dir stays there.
        std::fs::create_dir(f.root.join("volume/back")).unwrap();
        tmpfs(&f.root.join("task/data/back"));
        assert!(!is_mount_point(&f.root.join("volume/back")));
        umount2(&f.root.join("task/data/back"), MntFlags::MNT_DETACH).unwrap();
        hook.unmount_all().unwrap();
    }

    #[test]
    fn private_keeps_later_mounts_out_of_the_task_dir() {
        let f = Fixture::new();
        // Even a shared source does not reach a private bind.
        mount(
            None::<&str>,
            &f.root.join("volume"),
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .unwrap();
        let mut hook = f.bind(PropagationMode::Private);
        tmpfs(&f.root.join("volume/sub"));
        assert!(!is_mount_point(&f.root.join("task/data/sub")));
        hook.unmount_all().unwrap();
    }

    #[test]
    fn bidirectional_shows_mounts_both_ways() {
        let f = Fixture::new();
        let mut hook = f.bind(PropagationMode::Bidirectional);
        tmpfs(&f.root.join("volume/sub"));
        assert!(is_mount_point(&f.root.join("task/data/sub")));
        std::fs::create_dir(f.root.join("volume/back")).unwrap();
        tmpfs(&f.root.join("task/data/back"));
        assert!(
            is_mount_point(&f.root.join("volume/back")),
            "the task's mount reached the host"
        );
        umount2(&f.root.join("task/data/back"), MntFlags::MNT_DETACH).unwrap();
        hook.unmount_all().unwrap();
    }

    #[test]
    fn a_repaired_volume_is_never_bound_through_a_symlink_the_task_left() {
        let f = Fixture::new();
        let mut hook = f.bind(PropagationMode::Private);
        let target = f.root.join("task/data");
        // The bind is gone (the repair detaches it) and the task put a
        // symlink to a host dir in its place.
        umount2(&target, MntFlags::MNT_DETACH).unwrap();
        std::fs::remove_dir(&target).unwrap();
        let host = f.root.join("host");
        std::fs::create_dir(&host).unwrap();
        std::os::unix::fs::symlink(&host, &target).unwrap();
        let b = Bound {
            volume: "vol".into(),
            target: target.clone(),
            info: MountInfo {
                source: f.root.join("volume"),
                read_only: false,
            },
            read_only: false,
            propagation: PropagationMode::Private,
        };
        let err = rebind(&b).unwrap_err();
        assert!(err.to_string().contains("is a symlink"), "{err}");
        assert!(!is_mount_point(&host), "nothing was bound through the link");
        hook.mounted.clear();
    }

    #[test]
    fn a_device_file_source_is_bound_onto_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let _cleanup = berth_testutil::MountCleanup(root.clone());
        // Stands in for a published block device: any file is bound the
        // same way.
        let device = root.join("device");
        std::fs::write(&device, "bytes").unwrap();
        std::fs::create_dir(root.join("task")).unwrap();
        let mounts = BTreeMap::from([(
            "disk".to_string(),
            MountInfo {
                source: device.clone(),
                read_only: false,
            },
        )]);
        let mut hook = VolumeMountsHook::default();
        let mount_of = |destination: &str| VolumeMount {
            volume: "disk".into(),
            destination: destination.into(),
            read_only: false,
            propagation_mode: PropagationMode::Private,
        };
        hook.mount_all(&root.join("task"), &[mount_of("dev/disk")], &mounts)
            .unwrap();
        let target = root.join("task/dev/disk");
        assert!(target.is_file() && is_mount_point(&target));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "bytes");
        std::fs::write(&target, "written").unwrap();
        assert_eq!(std::fs::read_to_string(&device).unwrap(), "written");
        // A read-only mount of a writable device is refused.
        let mut ro = mount_of("ro-disk");
        ro.read_only = true;
        let err = hook
            .mount_all(&root.join("task"), &[ro], &mounts)
            .unwrap_err();
        assert!(err.to_string().contains("does not stop writes"), "{err}");
        // A directory where the device should go is refused, naming why.
        std::fs::create_dir(root.join("task/taken")).unwrap();
        let err = hook
            .mount_all(&root.join("task"), &[mount_of("taken")], &mounts)
            .unwrap_err();
        assert!(err.to_string().contains("block device"), "{err}");
        hook.unmount_all().unwrap();
        assert!(!is_mount_point(&target));
    }
}
