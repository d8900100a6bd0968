//! Starting `berth` processes with the test binaries on PATH, and
//! killing one with everything it started and unmounting its mounts.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use berth_testutil::loops::loops_backed_under;
use berth_testutil::{bin_dir, binary, mounts_under, pids_mentioning};

/// Kills `child`, then every process that mentions `dir` (tasks outlive
/// their agent), and unmounts everything below `dir`.
pub(crate) fn kill_and_unmount(child: &mut Option<Child>, dir: &Path) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let shown = dir.display().to_string();
    for _ in 0..3 {
        for pid in pids_mentioning(&shown) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        for m in mounts_under(dir) {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        if mounts_under(dir).is_empty() && pids_mentioning(&shown).is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Image-backed volumes: their loop devices would outlive the test. A
    // device still held by a lazily unmounted filesystem is only marked to
    // be cleared, which the kernel does on its last close.
    for dev in loops_backed_under(dir) {
        // A loop device set up by `mount -o loop` clears itself when
        // unmounted: its detach may find it gone.
        let _ = Command::new("losetup")
            .arg("-d")
            .arg(&dev)
            .stderr(std::process::Stdio::null())
            .status();
    }
    remove_cgroups(&cgroup_parent_of(dir));
}

/// The cgroup parent of the agent whose temp dir is `dir`: one of its own
/// under `berth-e2e`, so that no other agent's start, which removes the
/// cgroups of allocs it does not know under its parent, touches its tasks.
pub fn cgroup_parent_of(dir: &Path) -> String {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("berth-e2e/{name}")
}

/// Removes the (emptied) cgroups under `parent` in every hierarchy, and
/// the parent.
fn remove_cgroups(parent: &str) {
    fn remove_tree(dir: &Path) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path());
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
    let mount = Path::new("/sys/fs/cgroup");
    for base in ["", "memory", "cpu", "cpuacct", "pids"] {
        remove_tree(&mount.join(base).join(parent));
    }
}

/// PATH for agents and the CLI: the workspace's binaries (the example
/// plugin) first.
pub(crate) fn path_with_bins() -> String {
    format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    )
}

/// Starts `PROGRAM agent ARGS...` (PROGRAM a `berth` binary) with the
/// workspace's binaries on `PATH`, its output appended to `log_path` (a
/// restarted agent's log follows the first one's).
pub(crate) fn spawn_agent(
    program: &Path,
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
) -> Result<Child> {
    spawn_program(program, args, path_env, log_path, &[])
}

/// [`spawn_agent`] with environment changes last: `(NAME, Some(value))`
/// sets NAME, `(NAME, None)` removes it (e.g. `BERTH_LOG`).
pub(crate) fn spawn_agent_with_env(
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
    env: &[(String, Option<String>)],
) -> Result<Child> {
    spawn_program(&binary("berth"), args, path_env, log_path, env)
}

pub(crate) fn spawn_program(
    program: &Path,
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
    env: &[(String, Option<String>)],
) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)?;
    let mut command = Command::new(program);
    command
        .arg("agent")
        .args(args)
        .env("PATH", path_env)
        .env("BERTH_LOG", "info,berth=debug");
    for (name, value) in env {
        match value {
            Some(v) => command.env(name, v),
            None => command.env_remove(name),
        };
    }
    command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting berth agent")
}
