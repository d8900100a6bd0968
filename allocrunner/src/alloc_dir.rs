//! The alloc directory:
//! `<alloc_root>/<alloc_id>/alloc/{data,logs,tmp}` shared by the tasks, and
//! `<alloc_root>/<alloc_id>/<task>/{local,secrets,tmp}` per task.
//!
//! Beside the alloc root, `<data_dir>/node_data/<job_id>/<group>/<task>`
//! is a task's node data dir (`BERTH_NODE_DATA_DIR`): shared by every alloc
//! of that job, group and task on the node, whatever its version, and never
//! removed with an alloc dir. A CSI plugin keeps its volumes there, so that
//! a new alloc of the plugin job finds the volumes of the old one.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::error::{AllocRunnerError, HookError};

/// The directory of one alloc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocDir {
    path: PathBuf,
}

/// The directory of one task of an alloc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskDir {
    /// `<alloc_dir>/<task>`: the task's working directory; volume mounts
    /// land below it.
    pub dir: PathBuf,
    pub local: PathBuf,
    /// Mode 0700.
    pub secrets: PathBuf,
    pub tmp: PathBuf,
}

impl AllocDir {
    pub fn new(alloc_root: &Path, alloc_id: &str) -> AllocDir {
        AllocDir {
            path: alloc_root.join(alloc_id),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `<alloc_dir>/alloc`, shared by the tasks (`BERTH_ALLOC_DIR`).
    pub fn shared_dir(&self) -> PathBuf {
        self.path.join("alloc")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.shared_dir().join("data")
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.shared_dir().join("logs")
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.shared_dir().join("tmp")
    }

    /// `<alloc_dir>/alloc/logs/<task>.stdout`: the task's stdout goes to
    /// `<task>.stdout.0`, `.1`, ... (see [`crate::logs`]).
    pub fn stdout_path(&self, task: &str) -> PathBuf {
        self.logs_dir()
            .join(crate::logs::log_base(task, crate::logs::LogStream::Stdout))
    }

    pub fn stderr_path(&self, task: &str) -> PathBuf {
        self.logs_dir()
            .join(crate::logs::log_base(task, crate::logs::LogStream::Stderr))
    }

    pub fn task_dir(&self, task: &str) -> TaskDir {
        let dir = self.path.join(task);
        TaskDir {
            local: dir.join("local"),
            secrets: dir.join("secrets"),
            tmp: dir.join("tmp"),
            dir,
        }
    }

    /// `<alloc_dir>/.executor/<task>`: the task's executor records; beside
    /// the task dir, not in it, so neither the task nor its volumes see it.
    pub fn executor_dir(&self, task: &str) -> PathBuf {
        self.path.join(EXECUTOR_DIR).join(task)
    }

    /// `<data_dir>/node_data/<job_id>/<group>/<task>`, where the alloc root
    /// is `<data_dir>/alloc`: the task's node data dir.
    pub fn node_data_dir(&self, job_id: &str, group: &str, task: &str) -> PathBuf {
        let alloc_root = self.path.parent().unwrap_or(&self.path);
        alloc_root
            .parent()
            .unwrap_or(alloc_root)
            .join(NODE_DATA_DIR)
            .join(job_id)
            .join(group)
            .join(task)
    }

    /// Makes the task's node data dir (mode 0700). Idempotent. The job ID,
    /// group and task names become path components: each must pass the
    /// name rule.
    pub fn build_node_data(
        &self,
        job_id: &str,
        group: &str,
        task: &str,
    ) -> Result<PathBuf, HookError> {
        for (field, name) in [
            ("job ID", job_id),
            ("group name", group),
            ("task name", task),
        ] {
            berth_structs::check_name(field, name)
                .map_err(|e| HookError::Invalid(e.to_string()))?;
        }
        let dir = self.node_data_dir(job_id, group, task);
        create_dir(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| HookError::io("restricting node data dir", &dir, e))?;
        Ok(dir)
    }

    /// Makes the alloc dir and the shared directories, mode 0750 (the
    /// agent's and its group's only). Idempotent: a directory that was
    /// there keeps its mode, which a driver may have opened to a task's
    /// user (a task that runs on across an agent restart must not lose
    /// its way in).
    pub fn build_shared(&self) -> Result<(), HookError> {
        let dirs = [
            self.path.clone(),
            self.shared_dir(),
            self.data_dir(),
            self.logs_dir(),
            self.tmp_dir(),
        ];
        let new: Vec<bool> = dirs.iter().map(|d| !d.exists()).collect();
        for d in [self.data_dir(), self.logs_dir(), self.tmp_dir()] {
            create_dir(&d)?;
        }
        for (d, _) in dirs.iter().zip(new).filter(|(_, new)| *new) {
            restrict(d, ALLOC_DIR_MODE)?;
        }
        Ok(())
    }

    /// Makes one task's directories. Idempotent. `task` must be a plain
    /// file name: it becomes a path component.
    pub fn build_task(&self, task: &str) -> Result<TaskDir, HookError> {
        check_task_name(task)?;
        let td = self.task_dir(task);
        let modes = [
            (&td.dir, ALLOC_DIR_MODE),
            (&td.local, ALLOC_DIR_MODE),
            (&td.tmp, ALLOC_DIR_MODE),
            (&td.secrets, 0o700),
        ];
        // Only the directories made now get their mode (see
        // [`Self::build_shared`]).
        let new: Vec<bool> = modes.iter().map(|(d, _)| !d.exists()).collect();
        for d in [&td.local, &td.secrets, &td.tmp] {
            create_dir(d)?;
        }
        for ((d, mode), _) in modes.iter().zip(new).filter(|(_, new)| *new) {
            restrict(d, *mode)?;
        }
        Ok(td)
    }

    /// Unmounts whatever is still mounted below the alloc dir (the task
    /// volume mounts berth made; lazily), then removes it. Refuses to
    /// remove anything while a mount remains, read from mountinfo right
    /// before: removing the dir through a live bind mount would delete a
    /// volume's data. The dir is then kept, and the caller tries again
    /// later.
    pub fn destroy(&self) -> Result<(), AllocRunnerError> {
        self.destroy_with(berth_csimanager::mountinfo::detach_all)
    }

    /// [`Self::destroy`] with `unmount` for each mount below the dir.
    fn destroy_with(
        &self,
        unmount: impl Fn(&Path) -> nix::Result<()>,
    ) -> Result<(), AllocRunnerError> {
        if !self.path.exists() {
            return Ok(());
        }
        let real = self.path.canonicalize().map_err(|e| AllocRunnerError::Io {
            what: "resolving alloc dir",
            path: self.path.clone(),
            error: e,
        })?;
        for m in mounts_below(&real) {
            warn!(mount = %m.display(), "unmounting what was left mounted in the alloc dir");
            if let Err(e) = unmount(&m) {
                warn!(mount = %m.display(), error = %e, "unmount failed");
            }
        }
        let left = mounts_below(&real);
        if !left.is_empty() {
            return Err(AllocRunnerError::StillMounted {
                path: self.path.clone(),
                mounts: left.iter().map(|m| m.display().to_string()).collect(),
            });
        }
        std::fs::remove_dir_all(&self.path).map_err(|e| AllocRunnerError::Io {
            what: "removing alloc dir",
            path: self.path.clone(),
            error: e,
        })?;
        info!(path = %self.path.display(), "removed alloc dir");
        Ok(())
    }
}

/// The directory of executor records below the alloc dir; no task may
/// have this name.
const EXECUTOR_DIR: &str = ".executor";

/// `<data_dir>/node_data`: the node data dirs of tasks, beside the alloc
/// root.
pub const NODE_DATA_DIR: &str = "node_data";

/// The mode of the alloc dir and the directories in it but `secrets`
/// (0700): tasks run as the agent's user and reach them; others do not.
pub const ALLOC_DIR_MODE: u32 = 0o750;

fn restrict(d: &Path, mode: u32) -> Result<(), HookError> {
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))
        .map_err(|e| HookError::io("setting the mode of", d, e))
}

fn create_dir(d: &Path) -> Result<(), HookError> {
    std::fs::create_dir_all(d).map_err(|e| HookError::io("creating", d, e))
}

/// A task name becomes a directory name: it passes the name rule the
/// servers checked when the job arrived, and is none of the alloc dir's own
/// directories.
fn check_task_name(task: &str) -> Result<(), HookError> {
    berth_structs::check_name("task name", task).map_err(|e| HookError::Invalid(e.to_string()))?;
    if berth_structs::RESERVED_TASK_NAMES.contains(&task) || task == EXECUTOR_DIR {
        return Err(HookError::Invalid(format!(
            "task name {task:?} is reserved for the alloc dir's own use"
        )));
    }
    Ok(())
}

/// Mount points at or below `dir` (a canonical path), deepest first.
pub(crate) fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    berth_csimanager::mountinfo::mounts_at_or_below(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_testutil::bind_mount;

    #[test]
    fn alloc_dirs_are_0750_and_a_tasks_secrets_0700() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = AllocDir::new(&tmp.path().join("alloc"), "a1");
        dir.build_shared().unwrap();
        let td = dir.build_task("web").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        for d in [
            dir.path().to_path_buf(),
            dir.shared_dir(),
            dir.data_dir(),
            dir.logs_dir(),
            dir.tmp_dir(),
            td.dir.clone(),
            td.local.clone(),
            td.tmp.clone(),
        ] {
            assert_eq!(mode(&d), 0o750, "{}", d.display());
        }
        assert_eq!(mode(&td.secrets), 0o700);

        // A driver opened the task dir and the alloc dir to the task's
        // user; building again (an agent restart) keeps them open.
        for d in [dir.path(), td.dir.as_path()] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir.build_shared().unwrap();
        let again = dir.build_task("web").unwrap();
        assert_eq!(mode(dir.path()), 0o755);
        assert_eq!(mode(&again.dir), 0o755);
        assert_eq!(mode(&again.local), 0o750);
    }

    #[test]
    fn the_node_data_dir_is_private_checked_and_outlives_the_alloc_dir() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let alloc_root = tmp.path().join("alloc");
        let dir = AllocDir::new(&alloc_root, "a1");
        dir.build_shared().unwrap();
        let data = dir.build_node_data("job", "group", "task").unwrap();
        assert_eq!(data, tmp.path().join("node_data/job/group/task"));
        let mode = std::fs::metadata(&data).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(data.join("state.json"), "{}").unwrap();
        // Idempotent, and kept when the alloc dir goes.
        assert_eq!(dir.build_node_data("job", "group", "task").unwrap(), data);
        dir.destroy().unwrap();
        assert!(!dir.path().exists());
        assert!(data.join("state.json").is_file());
        // A later alloc of the same task finds it.
        let next = AllocDir::new(&alloc_root, "a2");
        assert_eq!(next.node_data_dir("job", "group", "task"), data);
        for (job, group, task) in [("../x", "g", "t"), ("j", "..", "t"), ("j", "g", "a/b")] {
            let e = next.build_node_data(job, group, task).unwrap_err();
            assert!(e.to_string().contains("is not allowed"), "{e}");
        }
        assert!(!tmp.path().join("x").exists());
    }

    /// Lazily unmounts everything below `dir` on drop, also when a test
    /// fails.
    struct Unmounted(PathBuf);

    impl Drop for Unmounted {
        fn drop(&mut self) {
            for m in mounts_below(&self.0) {
                let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }

    /// An alloc dir with a task whose `data` is a bind mount of a volume
    /// dir holding a file; the temp dir, the alloc dir and the volume dir.
    fn alloc_with_bound_volume() -> (tempfile::TempDir, Unmounted, AllocDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let guard = Unmounted(root.clone());
        let dir = AllocDir::new(&root.join("alloc"), "a1");
        dir.build_shared().unwrap();
        let td = dir.build_task("web").unwrap();
        let volume = root.join("volume");
        bind_mount(&volume, &td.dir.join("data"));
        std::fs::write(volume.join("precious"), "keep me").unwrap();
        assert!(td.dir.join("data/precious").is_file());
        (tmp, guard, dir, volume)
    }

    #[test]
    fn destroy_unmounts_a_bind_mount_below_and_keeps_the_volume_data() {
        let (_tmp, _guard, dir, volume) = alloc_with_bound_volume();
        dir.destroy().unwrap();
        assert!(!dir.path().exists());
        assert_eq!(
            std::fs::read_to_string(volume.join("precious")).unwrap(),
            "keep me"
        );
    }

    #[test]
    fn destroy_detaches_mounts_stacked_at_one_place_in_one_go() {
        let (_tmp, _guard, dir, volume) = alloc_with_bound_volume();
        // The same volume bound again over the first bind (a repaired
        // mount bound anew, say).
        let target = dir.path().canonicalize().unwrap().join("web/data");
        bind_mount(&volume, &target);
        dir.destroy().unwrap();
        assert!(!dir.path().exists());
        assert!(volume.join("precious").is_file());
    }

    #[test]
    fn destroy_keeps_the_dir_while_anything_stays_mounted_below() {
        let (_tmp, _guard, dir, volume) = alloc_with_bound_volume();
        let real = dir.path().canonicalize().unwrap();
        // An unmount that fails (say, the mount is busy and cannot go).
        let e = dir
            .destroy_with(|_| Err(nix::errno::Errno::EBUSY))
            .unwrap_err();
        match &e {
            AllocRunnerError::StillMounted { mounts, .. } => {
                assert_eq!(mounts, &[real.join("web/data").display().to_string()])
            }
            other => panic!("want StillMounted, got {other:?}"),
        }
        // Nothing was removed, through the mount or beside it.
        assert_eq!(
            std::fs::read_to_string(volume.join("precious")).unwrap(),
            "keep me"
        );
        assert!(dir.shared_dir().join("logs").is_dir());
        // The next try, with a working unmount, removes it.
        dir.destroy().unwrap();
        assert!(!dir.path().exists());
        assert!(volume.join("precious").is_file());
    }

    #[test]
    fn task_names_must_be_plain() {
        assert!(check_task_name("web").is_ok());
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "/x",
            "../x",
            "a b",
            "alloc",
            ".executor",
        ] {
            assert!(check_task_name(bad).is_err(), "{bad:?}");
        }
    }
}
