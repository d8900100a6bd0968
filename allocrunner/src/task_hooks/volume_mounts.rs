//! Binds the alloc's mounted CSI volumes into the task directory.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use berth_csimanager::{LostMount, MountInfo};
use berth_structs::{check_destination, VolumeMount};
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use tracing::{info, warn, Instrument};

use super::{KillRequest, TaskControl, TaskHook, TaskHookContext};
use crate::error::HookError;
use crate::state::TaskEvents;

/// For each `volume_mount` of the task, bind-mounts the volume's
/// [`MountInfo::source`] at `<task_dir>/<destination>` (read-only when the
/// mount or the volume is); unmounts them when the task is done. The mounts
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
            let target = make_dir_inside(&root, &m.destination)?;
            if self.mounted.contains(&target) {
                continue;
            }
            let read_only = m.read_only || info.read_only;
            mount(
                Some(&info.source),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|errno| HookError::Bind {
                src: info.source.clone(),
                target: target.clone(),
                errno,
            })?;
            if read_only {
                let remount = mount(
                    None::<&str>,
                    &target,
                    None::<&str>,
                    MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
                    None::<&str>,
                );
                if let Err(errno) = remount {
                    if let Err(e) = umount2(&target, MntFlags::MNT_DETACH) {
                        warn!(target = %target.display(), error = %e, "undoing a bind mount that could not be made read-only");
                        self.mounted.push(target.clone());
                    }
                    return Err(HookError::Bind {
                        src: info.source.clone(),
                        target,
                        errno,
                    });
                }
            }
            info!(volume = %m.volume, target = %target.display(), read_only, "bound volume into the task dir");
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

/// Makes `rel` (lexically normalized) below `root`, refusing to follow a
/// symlink or to leave `root`: the task owns its directory and could have
/// put a symlink where a mount should go.
fn make_dir_inside(root: &Path, rel: &str) -> Result<PathBuf, HookError> {
    let parts = normalized(rel)?;
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
        self.mount_all(&ctx.task_dir.dir, &ctx.task.volume_mounts, &ctx.mounts)
    }

    async fn poststart(
        &mut self,
        ctx: &TaskHookContext,
        task: &TaskControl,
    ) -> Result<(), HookError> {
        if let Some(r) = self.repairs.take() {
            r.abort();
        }
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
        if let Some(r) = self.repairs.take() {
            r.abort();
        }
    }

    async fn stop(&mut self, _ctx: &TaskHookContext) -> Result<(), HookError> {
        if let Some(r) = self.repairs.take() {
            r.abort();
        }
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
    match umount2(&b.target, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
        Err(errno) => {
            return Err(HookError::Unbind {
                target: b.target.clone(),
                errno,
            })
        }
    }
    let bind_error = |errno| HookError::Bind {
        src: b.info.source.clone(),
        target: b.target.clone(),
        errno,
    };
    mount(
        Some(&b.info.source),
        &b.target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(bind_error)?;
    if b.read_only {
        let remount = mount(
            None::<&str>,
            &b.target,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
            None::<&str>,
        );
        if let Err(errno) = remount {
            // Never leave a writable bind behind a read-only mount.
            let _ = umount2(&b.target, MntFlags::MNT_DETACH);
            return Err(bind_error(errno));
        }
    }
    info!(volume = %b.volume, target = %b.target.display(), "bound the repaired volume into the task dir");
    Ok(())
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
}
