//! The agent's claim on its data dir: an exclusive `flock` on
//! `<data_dir>/agent.lock`, taken before any database is opened and held
//! for the agent's life. A second agent on the same data dir fails at once
//! and names the first one's pid; the lock of an agent that died is gone
//! with it (the kernel releases it), so a stale file never blocks. The file
//! is opened close-on-exec: the executors and tasks an agent starts do not
//! hold it, so they can outlive the agent without keeping the next one out.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// The lock file's name in the data dir.
pub const LOCK_FILE: &str = "agent.lock";

#[derive(Debug, thiserror::Error)]
pub enum DataDirLockError {
    #[error(
        "data dir {dir} is in use by another berth agent ({holder}); stop it or use another -data-dir"
    )]
    InUse { dir: String, holder: String },
    #[error("locking the data dir: {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Held for the agent's life; dropping it releases the data dir.
#[derive(Debug)]
pub struct DataDirLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl DataDirLock {
    /// Claims `data_dir` for this process, or says which agent has it.
    pub fn acquire(data_dir: &Path) -> Result<DataDirLock, DataDirLockError> {
        let path = data_dir.join(LOCK_FILE);
        let io = |source: std::io::Error| DataDirLockError::Io {
            path: path.display().to_string(),
            source,
        };
        // std opens files close-on-exec.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let holder = match holder_pid(&mut file) {
                    Some(pid) => format!("pid {pid}"),
                    None => "pid unknown".to_string(),
                };
                return Err(DataDirLockError::InUse {
                    dir: data_dir.display().to_string(),
                    holder,
                });
            }
            Err((_, errno)) => return Err(io(std::io::Error::from(errno))),
        };
        lock.set_len(0).map_err(io)?;
        lock.seek(SeekFrom::Start(0)).map_err(io)?;
        writeln!(lock, "{}", std::process::id()).map_err(io)?;
        Ok(DataDirLock { _lock: lock, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The pid the lock holder wrote, if it has written it yet.
fn holder_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.take(64).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_claim_names_the_holder_and_a_released_dir_can_be_claimed_again() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(first.path()).unwrap().trim(),
            std::process::id().to_string()
        );
        // flock conflicts between open files, also in one process.
        let err = DataDirLock::acquire(dir.path()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "data dir {} is in use by another berth agent (pid {}); \
                 stop it or use another -data-dir",
                dir.path().display(),
                std::process::id()
            )
        );
        drop(first);
        DataDirLock::acquire(dir.path()).expect("a released data dir can be claimed");
    }

    #[test]
    fn a_stale_lock_file_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "999999999\n").unwrap();
        let lock = DataDirLock::acquire(dir.path()).expect("nobody holds the lock");
        assert_eq!(
            std::fs::read_to_string(lock.path()).unwrap().trim(),
            std::process::id().to_string()
        );
    }

    #[test]
    fn processes_the_agent_starts_do_not_hold_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let lock = DataDirLock::acquire(dir.path()).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        drop(lock);
        let again = DataDirLock::acquire(dir.path());
        let _ = child.kill();
        let _ = child.wait();
        again.expect("a child of the agent must not keep the data dir locked");
    }
}
