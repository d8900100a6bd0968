//! The heartbeat lease: a small file in which the client records when it
//! last heard from the servers, on the boot clock, which every process on
//! the host reads alike (a wall-clock step moves neither end).
//!
//! A task whose group sets `disconnect { stop_on_client_after }` has its
//! executor hold it to that window ([`DisconnectWatch`]): once the lease is
//! that old, the executor stops the task (SIGTERM, then SIGKILL after its
//! kill timeout, as a stop by the agent does) and records why. It does so whether the agent
//! runs or not, so that an agent that is down when the window closes (it
//! crashed, it is being upgraded) never leaves running a workload the
//! servers replace elsewhere once the window and their heartbeat grace
//! have passed. Only a heartbeat (or registration) the servers answered
//! renews the lease; an agent's start does not.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The lease's file name, in the client's state directory.
pub const LEASE_FILE: &str = "heartbeat.lease";

/// Milliseconds since boot on CLOCK_BOOTTIME (which counts suspends too):
/// the same for every process on the host.
pub fn boot_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into `t`, which outlives the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut t) } != 0 {
        return 0;
    }
    (t.tv_sec as u64)
        .saturating_mul(1000)
        .saturating_add(t.tv_nsec as u64 / 1_000_000)
}

/// Records in `dir`'s lease that the servers answered now.
///
/// The lease is overwritten in place, never replaced: a full disk, which
/// has no room for a new file, still takes the overwrite of the one that
/// is there, and a task is not stopped for a full disk. The time is
/// written twice, in fixed width; a reader that catches the write half
/// done sees two different times and reads again later. Not synced: a
/// crash of the machine ends every task the lease guards.
pub fn renew(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let now = boot_ms();
    let record = format!("{now:020} {now:020}\n");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join(LEASE_FILE))?
        .write_all_at(record.as_bytes(), 0)
}

/// When (boot-clock ms) the lease at `path` was last renewed; None when
/// there is none or it cannot be read (or is being written).
pub fn renewed_at(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let (a, b) = text.trim_end().split_once(' ')?;
    let (a, b) = (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?);
    (a == b).then_some(a)
}

/// A task held to its group's disconnect window by its executor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisconnectWatch {
    /// The client's lease file.
    pub lease: PathBuf,
    /// `stop_on_client_after`.
    pub window_ms: u64,
    /// Between SIGTERM and SIGKILL.
    pub kill_timeout_ms: u64,
}

impl DisconnectWatch {
    /// How long until the window closes, as the lease says now; zero once
    /// it has. A lease that cannot be read says nothing: checked again a
    /// second later.
    pub fn left(&self) -> Duration {
        let Some(renewed) = renewed_at(&self.lease) else {
            return Duration::from_secs(1);
        };
        let end = renewed.saturating_add(self.window_ms);
        Duration::from_millis(end.saturating_sub(boot_ms()))
    }

    /// Whether the window has closed.
    pub fn closed(&self) -> bool {
        self.left().is_zero()
    }

    /// Why the task was stopped, for its events.
    pub fn reason(&self) -> String {
        format!(
            "the client has had no successful heartbeat for its group's disconnect \
             stop_on_client_after ({:?})",
            Duration::from_millis(self.window_ms)
        )
    }
}

/// The executor's side of a [`DisconnectWatch`]: whether it stopped the
/// task, and the gate its signals pass, closed once the task's leader is
/// reaped (its group id may be reused from then on).
#[derive(Default)]
pub(crate) struct WatchGate {
    reaped: std::sync::Mutex<bool>,
    fired: std::sync::atomic::AtomicBool,
}

impl WatchGate {
    /// Whether the watch stopped the task.
    pub(crate) fn fired(&self) -> bool {
        self.fired.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Closes the gate: the task's leader is about to be reaped.
    pub(crate) fn close(&self) {
        *self.reaped.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Signals the task's group unless the gate is closed.
    fn signal(&self, pgid: i32, signal: nix::sys::signal::Signal) {
        let reaped = self.reaped.lock().unwrap_or_else(|e| e.into_inner());
        if *reaped || pgid <= 1 {
            return;
        }
        self.fired.store(true, std::sync::atomic::Ordering::SeqCst);
        match nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => eprintln!("berth executor: sending {signal} to the task's group: {e}"),
        }
    }
}

/// Starts the thread that holds the task (process group `pgid`) to
/// `watch`: it sleeps until the window would close, reads the lease
/// again, and once it has closed sends SIGTERM, then SIGKILL after the
/// kill timeout. It ends with the executor.
pub(crate) fn spawn_watch(watch: DisconnectWatch, pgid: i32, gate: std::sync::Arc<WatchGate>) {
    let spawned = std::thread::Builder::new()
        .name("disconnect".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            loop {
                let left = watch.left();
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left);
            }
            eprintln!("berth executor: {}; stopping the task", watch.reason());
            gate.signal(pgid, nix::sys::signal::Signal::SIGTERM);
            std::thread::sleep(Duration::from_millis(watch.kill_timeout_ms));
            gate.signal(pgid, nix::sys::signal::Signal::SIGKILL);
        });
    if let Err(e) = spawned {
        eprintln!("berth executor: starting the disconnect watch: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewed_lease_leaves_the_window_open_and_an_old_one_closes_it() {
        let dir = tempfile::tempdir().unwrap();
        let watch = DisconnectWatch {
            lease: dir.path().join(LEASE_FILE),
            window_ms: 60_000,
            kill_timeout_ms: 1_000,
        };
        // No lease yet: nothing known, not closed.
        assert!(!watch.closed());
        renew(dir.path()).unwrap();
        let left = watch.left();
        assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60));
        let old = boot_ms().saturating_sub(61_000);
        std::fs::write(&watch.lease, format!("{old:020} {old:020}\n")).unwrap();
        assert!(watch.closed());
        // Half written: not read.
        std::fs::write(&watch.lease, format!("{old:020} {:020}\n", old + 1)).unwrap();
        assert_eq!(renewed_at(&watch.lease), None);
        assert!(!watch.closed());
    }
}
