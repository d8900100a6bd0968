//! [`HostSandbox`]: the calling thread in a mount and network namespace of
//! its own, so that a test can run commands exactly as the README writes
//! them for a machine (`/etc/berth.d`, `/var/lib/...`, the default ports)
//! without touching the host's files or ports. The processes the thread
//! starts inherit the namespaces; on drop every process in them is killed,
//! the thread returns to the host's namespaces and the namespaces go, their
//! mounts with them.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

/// The calling thread in its own mount and network namespaces; see the
/// module docs. Only for the thread that made it (a test's own thread).
pub struct HostSandbox {
    host_mnt: File,
    host_net: File,
    /// Our mount namespace, as `/proc/PID/ns/mnt` shows it.
    ns_id: PathBuf,
    /// Mount points the sandbox made on the host, removed on drop.
    made: Vec<PathBuf>,
}

impl HostSandbox {
    /// Enters new namespaces in which each of `dirs` is an empty tmpfs
    /// (mode 0755; a missing dir is made on the host, and removed again
    /// on drop) and loopback is up.
    pub fn enter(dirs: &[&str]) -> Result<HostSandbox> {
        let host_mnt = File::open("/proc/thread-self/ns/mnt").context("opening the mount ns")?;
        let host_net = File::open("/proc/thread-self/ns/net").context("opening the net ns")?;
        let mut made = Vec::new();
        for dir in dirs {
            let path = Path::new(dir);
            if !path.exists() {
                std::fs::create_dir_all(path).with_context(|| format!("creating {dir}"))?;
                made.push(path.to_path_buf());
            }
        }
        unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET)
            .context("unshare(CLONE_NEWNS | CLONE_NEWNET)")?;
        let mut sandbox = HostSandbox {
            host_mnt,
            host_net,
            ns_id: std::fs::read_link("/proc/thread-self/ns/mnt")?,
            made,
        };
        // Nothing mounted here reaches the host.
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .context("making / private")?;
        for dir in dirs {
            mount(
                Some("tmpfs"),
                *dir,
                Some("tmpfs"),
                MsFlags::empty(),
                Some("mode=0755"),
            )
            .with_context(|| format!("mounting a tmpfs on {dir}"))?;
        }
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status();
        if !up.as_ref().is_ok_and(|s| s.success()) {
            sandbox.leave();
            bail!("ip link set lo up: {up:?}");
        }
        Ok(sandbox)
    }

    /// The processes in the sandbox's mount namespace, but this one.
    fn pids(&self) -> Vec<i32> {
        let me = std::process::id() as i32;
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| *pid != me)
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/mnt")).is_ok_and(|ns| ns == self.ns_id)
            })
            .collect()
    }

    fn leave(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() >= deadline {
                break;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Err(e) = setns(&self.host_mnt, CloneFlags::CLONE_NEWNS) {
            eprintln!("returning to the host's mount namespace: {e}");
        }
        if let Err(e) = setns(&self.host_net, CloneFlags::CLONE_NEWNET) {
            eprintln!("returning to the host's network namespace: {e}");
        }
        for dir in self.made.drain(..) {
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

impl Drop for HostSandbox {
    fn drop(&mut self) {
        self.leave();
    }
}
