//! `raw_exec`: the task is a plain process on the host, in its own process
//! group, with the task dir as its working directory and its output
//! appended to the alloc's log files.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;
use tracing::{debug, warn};

use super::{Driver, ExitResult, TaskHandle, TaskSpec};
use crate::error::DriverError;

/// How long to wait for a process to go after SIGKILL before giving up on it.
const AFTER_SIGKILL: Duration = Duration::from_secs(30);

#[derive(Debug, Default, Clone)]
pub struct RawExecDriver {
    _private: (),
}

impl RawExecDriver {
    pub fn new() -> RawExecDriver {
        RawExecDriver::default()
    }
}

fn open_log(path: &Path) -> Result<std::fs::File, DriverError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|error| DriverError::Logs {
            path: path.to_path_buf(),
            error,
        })
}

/// A relative command with a `/` is relative to the task dir.
fn program_path(spec: &TaskSpec) -> PathBuf {
    let p = Path::new(&spec.command);
    if p.is_relative() && spec.command.contains('/') {
        spec.task_dir.join(p)
    } else {
        p.to_path_buf()
    }
}

#[async_trait::async_trait]
impl Driver for RawExecDriver {
    fn name(&self) -> &'static str {
        "raw_exec"
    }

    async fn start(&self, spec: &TaskSpec) -> Result<Arc<dyn TaskHandle>, DriverError> {
        let program = program_path(spec);
        if !spec.task_dir.is_dir() {
            return Err(DriverError::Spawn {
                command: spec.command.clone(),
                error: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("working directory {} is missing", spec.task_dir.display()),
                ),
            });
        }
        let stdout = open_log(&spec.stdout_path)?;
        let stderr = open_log(&spec.stderr_path)?;
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&spec.args)
            .env_clear()
            .envs(&spec.env)
            .current_dir(&spec.task_dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        let command = spec.command.clone();
        let mut child = cmd.spawn().map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => DriverError::CommandNotFound { command },
            std::io::ErrorKind::PermissionDenied => DriverError::PermissionDenied { command },
            _ => DriverError::Spawn { command, error },
        })?;
        let Some(pid) = child.id() else {
            return Err(DriverError::Spawn {
                command: spec.command.clone(),
                error: std::io::Error::other("the process exited before its pid was read"),
            });
        };
        debug!(alloc_id = %spec.alloc_id, task = %spec.task, pid, "started raw_exec task");
        let (tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => ExitResult {
                    exit_code: status.code(),
                    signal: status.signal(),
                    error: None,
                },
                Err(e) => ExitResult {
                    error: Some(format!("waiting for process {pid}: {e}")),
                    ..ExitResult::default()
                },
            };
            tx.send_replace(Some(exit));
        });
        Ok(Arc::new(RawExecHandle { pid, exit }))
    }
}

struct RawExecHandle {
    pid: u32,
    exit: watch::Receiver<Option<ExitResult>>,
}

impl RawExecHandle {
    fn pgid(&self) -> Pid {
        Pid::from_raw(self.pid as i32)
    }

    /// Kills what is left of the process group after its leader exited.
    fn kill_leftovers(&self) {
        match killpg(self.pgid(), Signal::SIGKILL) {
            Ok(()) => debug!(pgid = self.pid, "killed processes left in the task's group"),
            Err(Errno::ESRCH) => {}
            Err(e) => warn!(pgid = self.pid, error = %e, "killing the task's process group"),
        }
    }
}

#[async_trait::async_trait]
impl TaskHandle for RawExecHandle {
    fn pid(&self) -> u32 {
        self.pid
    }

    async fn wait(&self) -> ExitResult {
        let mut rx = self.exit.clone();
        let exit = rx
            .wait_for(|e| e.is_some())
            .await
            .map(|e| e.clone().unwrap_or_default());
        exit.unwrap_or_else(|_| ExitResult {
            error: Some("the process's waiter went away".into()),
            ..ExitResult::default()
        })
    }

    fn try_exit(&self) -> Option<ExitResult> {
        self.exit.borrow().clone()
    }

    fn signal(&self, signal: Signal) -> Result<(), DriverError> {
        match killpg(self.pgid(), signal) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(errno) => Err(DriverError::Signal {
                pgid: self.pid as i32,
                errno,
            }),
        }
    }

    async fn stop(&self, kill_timeout: Duration) -> ExitResult {
        if let Some(exit) = self.try_exit() {
            self.kill_leftovers();
            return exit;
        }
        if let Err(e) = self.signal(Signal::SIGTERM) {
            warn!(pid = self.pid, error = %e, "sending SIGTERM");
        }
        if let Ok(exit) = tokio::time::timeout(kill_timeout, self.wait()).await {
            self.kill_leftovers();
            return exit;
        }
        warn!(
            pid = self.pid,
            ?kill_timeout,
            "task did not exit after SIGTERM; sending SIGKILL"
        );
        if let Err(e) = self.signal(Signal::SIGKILL) {
            warn!(pid = self.pid, error = %e, "sending SIGKILL");
        }
        match tokio::time::timeout(AFTER_SIGKILL, self.wait()).await {
            Ok(exit) => {
                self.kill_leftovers();
                exit
            }
            Err(_) => ExitResult {
                error: Some(format!(
                    "process {} did not exit {AFTER_SIGKILL:?} after SIGKILL",
                    self.pid
                )),
                ..ExitResult::default()
            },
        }
    }
}
