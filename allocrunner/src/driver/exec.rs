//! `exec`: a task run as `raw_exec` runs it (under a per-task executor
//! that outlives the agent), held to its `resources` by a cgroup of its
//! own (see [`crate::cgroups`]): the executor joins the task to it before
//! it execs, so every process the task starts is held too; and kept from
//! the host by namespaces, a root of its own and a user that is not root
//! (see [`crate::isolation`]). A task the
//! kernel's OOM killer ended says so in its exit; whatever the task left
//! in its cgroup is killed when it stops or exits, and the cgroup goes
//! with it. After an agent restart the task's cgroup is found again from
//! its executor's record.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tracing::{debug, warn};

use super::{Driver, ExitResult, RawExecDriver, TaskHandle, TaskHandleRecord, TaskSpec};
use crate::cgroups::{Cgroups, Limits, TaskCgroup, DEFAULT_PIDS_LIMIT};
use crate::error::DriverError;
use crate::isolation::{Isolation, DEFAULT_USER, SYSTEM_DIRS};

/// How many passes a kill of what is left in a task's cgroup makes.
const KILL_PASSES: usize = 200;

#[derive(Debug, Clone)]
pub struct ExecDriver {
    inner: RawExecDriver,
    /// The host's cgroups, or why they cannot be used.
    cgroups: Result<Cgroups, String>,
    /// Who the tasks that name no user run as.
    user: String,
    /// The uids and gids its tasks may not run as.
    denied: crate::users::DeniedIds,
}

impl ExecDriver {
    /// Tasks run as `inner` runs them, in cgroups of the host's kind, as
    /// [`DEFAULT_USER`].
    pub fn new(inner: RawExecDriver) -> ExecDriver {
        let cgroups = Cgroups::detect();
        match &cgroups {
            Ok(c) => debug!(cgroup = c.version(), "exec tasks run in cgroups"),
            Err(why) => warn!("the exec driver cannot run tasks: {why}"),
        }
        ExecDriver::with_cgroups(inner, cgroups)
    }

    pub fn with_cgroups(inner: RawExecDriver, cgroups: Result<Cgroups, String>) -> ExecDriver {
        ExecDriver {
            inner,
            cgroups,
            user: DEFAULT_USER.into(),
            denied: crate::users::DeniedIds::not_root(),
        }
    }

    /// Its tasks may not run as the uids and gids of `denied` (uid 0
    /// unless set).
    pub fn denying(mut self, denied: crate::users::DeniedIds) -> ExecDriver {
        self.denied = denied;
        self
    }
}

/// The namespaces, root and user of `spec`'s task: its task dir as its
/// root, its alloc's shared dir at `/alloc`, the host's system dirs
/// read-only.
fn isolation_of(spec: &TaskSpec, user: &str) -> Isolation {
    let alloc_dir = spec.alloc_shared_dir();
    Isolation {
        root: spec.task_dir.clone(),
        alloc_dir,
        system_dirs: SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
        user: user.to_string(),
        hostname: spec.alloc_id.chars().take(8).collect(),
    }
}

fn limits_of(spec: &TaskSpec) -> Limits {
    Limits {
        memory: spec.limits.memory_mb.saturating_mul(1 << 20),
        memory_max: spec.limits.memory_max_mb.saturating_mul(1 << 20),
        cpu_mhz: spec.limits.cpu_mhz,
        pids: spec.limits.pids.unwrap_or(DEFAULT_PIDS_LIMIT),
    }
}

#[async_trait::async_trait]
impl Driver for ExecDriver {
    fn name(&self) -> &'static str {
        "exec"
    }

    /// Healthy when raw_exec's executor is and the host has usable
    /// cgroups (of either version: the snapshot of a node is the same on
    /// both).
    fn fingerprint(&self) -> berth_structs::DriverInfo {
        match &self.cgroups {
            Err(why) => berth_structs::DriverInfo::unhealthy(why.clone()),
            Ok(_) => self.inner.fingerprint(),
        }
    }

    async fn start(&self, spec: &TaskSpec) -> Result<Arc<dyn TaskHandle>, DriverError> {
        let cgroups = self.cgroups.as_ref().map_err(|why| DriverError::Spawn {
            command: spec.command.clone(),
            error: std::io::Error::other(format!("the exec driver needs cgroups: {why}")),
        })?;
        let user = spec.user.clone().unwrap_or_else(|| self.user.clone());
        crate::users::allowed("exec", &user, &self.denied, &spec.command)?;
        let cgroup = cgroups
            .create(&spec.alloc_id, &spec.task, &limits_of(spec))
            .map_err(|error| DriverError::Spawn {
                command: spec.command.clone(),
                error: std::io::Error::new(
                    error.kind(),
                    format!("making the task's cgroup: {error}"),
                ),
            })?;
        let mut spec = spec.clone();
        spec.cgroup_procs = cgroup.procs_files();
        spec.isolation = Some(isolation_of(&spec, &user));
        match self.inner.start(&spec).await {
            Ok(inner) => Ok(Arc::new(ExecHandle::new(inner, cgroup))),
            Err(e) => {
                if let Err(error) = cgroup.remove() {
                    warn!(alloc_id = %spec.alloc_id, task = %spec.task, %error, "removing the cgroup of a task that did not start");
                }
                Err(e)
            }
        }
    }

    async fn reattach(
        &self,
        record: &TaskHandleRecord,
    ) -> Result<Arc<dyn TaskHandle>, DriverError> {
        let inner = self.inner.reattach(record).await?;
        let cgroup = TaskCgroup::from_dirs(record.cgroup.clone());
        debug!(pid = record.task_pid, cgroup = ?record.cgroup, "reattached to an exec task");
        Ok(Arc::new(ExecHandle::new(inner, cgroup)))
    }
}

/// A running `exec` task: raw_exec's handle, and the task's cgroup.
struct ExecHandle {
    inner: Arc<dyn TaskHandle>,
    cgroup: TaskCgroup,
    /// The task's exit, once it has exited and its cgroup is gone.
    ended: tokio::sync::OnceCell<ExitResult>,
}

impl ExecHandle {
    fn new(inner: Arc<dyn TaskHandle>, cgroup: TaskCgroup) -> ExecHandle {
        ExecHandle {
            inner,
            cgroup,
            ended: tokio::sync::OnceCell::new(),
        }
    }

    /// `exit` with what the cgroup says of it (an OOM kill), once the
    /// cgroup is emptied and removed.
    async fn finish(&self, mut exit: ExitResult) -> ExitResult {
        let cgroup = self.cgroup.clone();
        let finished = tokio::task::spawn_blocking(move || {
            let oom = (cgroup.oom_kills() > 0).then(|| cgroup.memory_limit().unwrap_or(0));
            if !cgroup.kill_all(KILL_PASSES) {
                warn!(cgroup = ?cgroup.dirs(), "processes are left in the task's cgroup");
            }
            if let Err(error) = cgroup.remove() {
                warn!(cgroup = ?cgroup.dirs(), %error, "removing the task's cgroup");
            }
            oom
        })
        .await;
        if let Ok(oom) = finished {
            exit.oom_killed = oom;
        }
        exit
    }
}

#[async_trait::async_trait]
impl TaskHandle for ExecHandle {
    fn pid(&self) -> u32 {
        self.inner.pid()
    }

    fn record(&self) -> Option<TaskHandleRecord> {
        self.inner.record()
    }

    async fn wait(&self) -> ExitResult {
        self.ended
            .get_or_init(|| async {
                let exit = self.inner.wait().await;
                self.finish(exit).await
            })
            .await
            .clone()
    }

    fn try_exit(&self) -> Option<ExitResult> {
        self.ended.get().cloned().or_else(|| self.inner.try_exit())
    }

    fn signal(&self, signal: Signal) -> Result<(), DriverError> {
        self.inner.signal(signal)
    }

    fn usage(&self) -> Option<(crate::cgroups::Usage, u64)> {
        if self.ended.get().is_some() {
            return None;
        }
        Some((self.cgroup.usage(), self.cgroup.memory_limit().unwrap_or(0)))
    }

    /// raw_exec's stop of the task's group, then whatever the task left
    /// in its cgroup (a process that left the group) is killed.
    async fn stop(&self, kill_timeout: Duration) -> ExitResult {
        let exit = self.inner.stop(kill_timeout).await;
        self.ended.get_or_init(|| self.finish(exit)).await.clone()
    }
}
