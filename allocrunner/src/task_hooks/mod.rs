//! The task runner's hook chain.
//!
//! `prestart` runs in order before each start of the task (so it must be
//! idempotent: a restarted task runs it again); `poststart` after each
//! start; `exited` after each exit; `stop` once, in reverse, when the task
//! is done for good, for every hook whose `prestart` was started.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_csimanager::MountInfo;
use berth_structs::{Allocation, Task};
use tokio::sync::mpsc;

use crate::alloc_dir::{AllocDir, TaskDir};
use crate::config::AllocRunnerConfig;
use crate::error::HookError;
use crate::state::TaskEvents;

mod plugin_supervisor;
mod task_dir;
mod volume_mounts;

pub use plugin_supervisor::{plugin_socket_path, PluginSupervisorHook, MAX_SOCKET_PATH_LEN};
pub use task_dir::TaskDirHook;
pub use volume_mounts::VolumeMountsHook;

/// What task hooks see.
pub struct TaskHookContext {
    pub config: Arc<AllocRunnerConfig>,
    pub alloc: Arc<Allocation>,
    pub task: Task,
    pub alloc_dir: AllocDir,
    pub task_dir: TaskDir,
    /// The task's environment so far; prestart hooks add to it. The task's
    /// own `env` block is laid over it after the hooks ran.
    pub env: BTreeMap<String, String>,
    /// The alloc's mounted CSI volumes by volume request name.
    pub mounts: Arc<BTreeMap<String, MountInfo>>,
    pub events: TaskEvents,
    /// True while the hooks run for a task that is being reattached after
    /// an agent restart rather than started: what the running task uses
    /// (its plugin socket, its bind mounts) must be kept, not made anew.
    pub restoring: bool,
}

/// Asks the task runner to kill the running task.
#[derive(Debug, Clone)]
pub struct KillRequest {
    /// Becomes the `Killing` event's message.
    pub reason: String,
    /// Restart afterwards per the restart policy (the kill counts as a
    /// failed exit); otherwise the task fails.
    pub restart: bool,
}

/// Handed to `poststart` hooks: lets background work ask for the task to be
/// killed.
#[derive(Debug, Clone)]
pub struct TaskControl {
    pub(crate) kill: mpsc::UnboundedSender<KillRequest>,
    pub pid: u32,
}

impl TaskControl {
    /// Whether the request reached the task runner (false once the task
    /// has exited).
    pub fn kill(&self, req: KillRequest) -> bool {
        self.kill.send(req).is_ok()
    }
}

#[async_trait::async_trait]
pub trait TaskHook: Send {
    fn name(&self) -> &'static str;

    async fn prestart(&mut self, _ctx: &mut TaskHookContext) -> Result<(), HookError> {
        Ok(())
    }

    async fn poststart(
        &mut self,
        _ctx: &TaskHookContext,
        _task: &TaskControl,
    ) -> Result<(), HookError> {
        Ok(())
    }

    async fn exited(&mut self, _ctx: &TaskHookContext) {}

    async fn stop(&mut self, _ctx: &TaskHookContext) -> Result<(), HookError> {
        Ok(())
    }
}

/// The chain for `task`, in prestart order.
pub fn hooks_for(task: &Task) -> Vec<Box<dyn TaskHook>> {
    let mut hooks: Vec<Box<dyn TaskHook>> = vec![Box::new(TaskDirHook)];
    if let Some(plugin) = &task.csi_plugin {
        hooks.push(Box::new(PluginSupervisorHook::new(plugin.clone())));
    }
    if !task.volume_mounts.is_empty() {
        hooks.push(Box::new(VolumeMountsHook::default()));
    }
    hooks
}
