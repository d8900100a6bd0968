//! Task drivers: how a task's process is started, watched and stopped.
//!
//! A driver starts a task from a [`TaskSpec`] and hands back a
//! [`TaskHandle`]. A handle that can outlive the agent gives a
//! [`TaskHandleRecord`] to persist, and after a restart the driver
//! [`Driver::reattach`]es to it instead of starting the task again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::error::DriverError;

mod exec;
mod host_executors;
mod raw_exec;

pub use exec::ExecDriver;
pub use host_executors::{executors_outside, HostExecutor};

pub use raw_exec::{
    executor_version_line, ExecutorCommand, RawExecDriver, EXECUTOR_PROGRAM, EXECUTOR_START_TIMEOUT,
};

/// Everything a driver needs to start one task.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    pub alloc_id: String,
    pub task: String,
    /// Interpolated. A relative path with a `/` is relative to `task_dir`;
    /// a bare name is looked up in the task's `PATH`.
    pub command: String,
    pub args: Vec<String>,
    /// The whole environment of the task.
    pub env: BTreeMap<String, String>,
    /// The working directory.
    pub task_dir: PathBuf,
    /// Where the task's output goes: the executor writes `<stdout_path>.0`,
    /// `.1`, ..., continuing at the highest index there is and keeping
    /// the newest `logs.max_files` (see [`crate::logs`]).
    pub stdout_path: PathBuf,
    pub stderr_path: PathBuf,
    pub logs: crate::logs::LogRotation,
    /// Where the task's executor keeps its state and exit records; not
    /// below `task_dir`, so the task and its volume mounts never see it.
    pub executor_dir: PathBuf,
    /// What an `exec` task is held to (`raw_exec` ignores it).
    pub limits: TaskLimits,
    /// The `cgroup.procs` files the task joins before it execs (the `exec`
    /// driver sets them).
    pub cgroup_procs: Vec<PathBuf>,
    /// The task's namespaces, root and user (the `exec` driver sets them).
    pub isolation: Option<crate::isolation::Isolation>,
    /// The user the task asked to run as (its `user`); None: the
    /// driver's default.
    pub user: Option<String>,
    /// The group's disconnect window, which the executor holds the task
    /// to (see [`crate::lease`]).
    pub disconnect: Option<crate::lease::DisconnectWatch>,
}

impl TaskSpec {
    /// The alloc's shared dir (`alloc/`, beside the task dirs).
    pub fn alloc_shared_dir(&self) -> PathBuf {
        self.task_dir
            .parent()
            .map(|p| p.join("alloc"))
            .unwrap_or_default()
    }
}

/// The resources an `exec` task's cgroup holds it to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskLimits {
    pub cpu_mhz: u64,
    pub memory_mb: u64,
    /// Above `memory_mb`: the hard limit, `memory_mb` the soft one.
    pub memory_max_mb: u64,
    /// None: [`crate::cgroups::DEFAULT_PIDS_LIMIT`].
    pub pids: Option<u64>,
}

/// What the agent persists of a started task to find it again after a
/// restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskHandleRecord {
    pub driver: String,
    /// The executor's state directory ([`TaskSpec::executor_dir`]).
    pub executor_dir: PathBuf,
    pub executor_pid: u32,
    /// `/proc/<pid>/stat` start time of the executor: a pid whose start
    /// time differs is another process.
    pub executor_start_ticks: u64,
    pub task_pid: u32,
    pub pgid: i32,
    pub task_start_ticks: u64,
    pub started_at_ms: i64,
    /// The task's cgroup directories (an `exec` task).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroup: Vec<PathBuf>,
}

/// How a task's process ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExitResult {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The process could not be waited for.
    pub error: Option<String>,
    /// The kernel's OOM killer killed a process of the task, which was
    /// held to this many bytes.
    pub oom_killed: Option<u64>,
    /// The executor stopped the task: its group's disconnect window
    /// closed (see [`crate::lease`]).
    pub disconnected: bool,
}

impl ExitResult {
    pub fn successful(&self) -> bool {
        self.exit_code == Some(0) && self.signal.is_none() && self.error.is_none()
    }
}

impl std::fmt::Display for ExitResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.exit_code, self.signal, &self.error) {
            (_, _, Some(e)) => write!(f, "Error: {e}"),
            (_, Some(sig), _) => {
                let name = Signal::try_from(sig)
                    .map(|s| s.as_str())
                    .unwrap_or("unknown");
                write!(f, "Signal: {sig} ({name})")
            }
            (Some(code), None, _) => write!(f, "Exit Code: {code}"),
            (None, None, None) => f.write_str("exited"),
        }
    }
}

impl TaskHandleRecord {
    /// The record of the run an executor wrote in `executor_dir`, if it
    /// started its task. The executor writes it before the agent can
    /// persist the handle, so it also finds a task whose agent died in
    /// between.
    pub fn from_executor_dir(driver: &str, executor_dir: &Path) -> Option<TaskHandleRecord> {
        let state = crate::executor::read_record::<crate::executor::ExecutorState>(
            executor_dir,
            crate::executor::STATE_FILE,
        )
        .ok()??;
        Self::from_state(driver, executor_dir, &state)
    }

    /// The handle of a task its executor reports running; `None` when the
    /// executor could not start it.
    pub fn from_state(
        driver: &str,
        executor_dir: &Path,
        state: &crate::executor::ExecutorState,
    ) -> Option<TaskHandleRecord> {
        match state {
            crate::executor::ExecutorState::Running {
                executor_pid,
                executor_start_ticks,
                task_pid,
                pgid,
                task_start_ticks,
                started_at_ms,
                cgroup,
            } => Some(TaskHandleRecord {
                driver: driver.to_string(),
                executor_dir: executor_dir.to_path_buf(),
                executor_pid: *executor_pid,
                executor_start_ticks: *executor_start_ticks,
                task_pid: *task_pid,
                pgid: *pgid,
                task_start_ticks: *task_start_ticks,
                started_at_ms: *started_at_ms,
                cgroup: cgroup.clone(),
            }),
            crate::executor::ExecutorState::StartFailed { .. } => None,
        }
    }
}

/// Starts tasks.
#[async_trait::async_trait]
pub trait Driver: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether the driver can start tasks on this node now, and why not:
    /// what the node registers for it.
    fn fingerprint(&self) -> berth_structs::DriverInfo {
        berth_structs::DriverInfo::healthy("Healthy")
    }
    async fn start(&self, spec: &TaskSpec) -> Result<Arc<dyn TaskHandle>, DriverError>;
    /// A handle on a task started before the agent restarted. A task that
    /// is gone gives a handle that has exited (with its recorded exit when
    /// there is one); an error means the driver cannot tell.
    async fn reattach(
        &self,
        record: &TaskHandleRecord,
    ) -> Result<Arc<dyn TaskHandle>, DriverError> {
        Err(DriverError::Reattach {
            pid: record.task_pid,
            message: format!("driver {} cannot reattach to tasks", self.name()),
        })
    }
}

/// A started task.
#[async_trait::async_trait]
pub trait TaskHandle: Send + Sync {
    fn pid(&self) -> u32;
    /// What to persist to reattach after a restart; `None` for tasks that
    /// do not outlive the agent.
    fn record(&self) -> Option<TaskHandleRecord> {
        None
    }
    /// Waits until the process exits. Cancel-safe; may be called again and
    /// from several places.
    async fn wait(&self) -> ExitResult;
    /// The exit, if the process has exited.
    fn try_exit(&self) -> Option<ExitResult>;
    /// Signals the task's process group.
    fn signal(&self, signal: Signal) -> Result<(), DriverError>;
    /// What the task uses now, with its memory limit, where the driver
    /// measures it (an `exec` task's cgroup).
    fn usage(&self) -> Option<(crate::cgroups::Usage, u64)> {
        None
    }
    /// SIGTERM to the process group, SIGKILL after `kill_timeout`; returns
    /// once the process has exited and its group is gone.
    async fn stop(&self, kill_timeout: Duration) -> ExitResult;
}
