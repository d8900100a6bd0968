//! The alloc runner's hook chain. `prerun` runs in order before any task
//! starts; `postrun` runs in reverse once the tasks are done, for every hook
//! whose `prerun` was started (also the one that failed: each hook's
//! `postrun` undoes exactly what its `prerun` did). While the tasks run,
//! `update` hears of each newer version of the alloc, and once the alloc
//! is stopping `pre_kill` runs in order before its tasks are killed.
//! `destroy` runs in order when the alloc is destroyed, after `postrun`
//! (or instead of everything, for an alloc destroyed before it ran).

use berth_sync::Shutdown;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use berth_csimanager::MountInfo;
use berth_structs::{Allocation, TaskEvent};

use crate::alloc_dir::AllocDir;
use crate::config::AllocRunnerConfig;
use crate::error::{AllocRunnerError, HookError};
use crate::state::AllocState;

mod alloc_dir;
pub(crate) mod csi;

pub use alloc_dir::AllocDirHook;
pub use csi::CsiHook;

/// What alloc hooks see.
pub struct AllocHookContext {
    pub config: Arc<AllocRunnerConfig>,
    pub alloc: Arc<Allocation>,
    pub alloc_dir: AllocDir,
    /// Flips to true when the alloc is asked to stop; a hook that waits
    /// gives up with [`HookError::Stopped`].
    pub stop: Shutdown,
    /// Mounted CSI volumes by the name of the group's volume request; the
    /// task runners bind them into task dirs.
    pub mounts: Mutex<BTreeMap<String, MountInfo>>,
    /// The runner was restored after an agent restart: what the previous
    /// agent set up may still be in place.
    pub restoring: bool,
    /// Where task events go; none for a context made outside a runner.
    state: Option<Arc<AllocState>>,
}

impl AllocHookContext {
    /// A context for `alloc`, its dir under the config's alloc root, no
    /// volume mounted yet.
    pub fn new(
        config: Arc<AllocRunnerConfig>,
        alloc: Arc<Allocation>,
        stop: Shutdown,
        restoring: bool,
    ) -> AllocHookContext {
        AllocHookContext {
            alloc_dir: AllocDir::new(&config.alloc_root, &alloc.id),
            config,
            alloc,
            stop,
            mounts: Mutex::default(),
            restoring,
            state: None,
        }
    }

    /// The context of a runner: task events reach the alloc's state.
    pub(crate) fn with_state(mut self, state: Arc<AllocState>) -> AllocHookContext {
        self.state = Some(state);
        self
    }

    /// Records `event` for `task` of the alloc (nowhere for a context made
    /// outside a runner).
    pub fn task_event(&self, task: &str, event: TaskEvent) {
        if let Some(state) = &self.state {
            state.task_event(task, event);
        }
    }
}

#[async_trait::async_trait]
pub trait AllocHook: Send {
    fn name(&self) -> &'static str;
    async fn prerun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError>;
    async fn postrun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError>;

    /// The alloc is stopping: runs before its tasks are killed, which wait
    /// for it. The tasks keep running meanwhile.
    async fn pre_kill(&mut self, _ctx: &AllocHookContext) {}

    /// A newer version of the alloc came while its tasks run. `ctx.alloc`
    /// stays the version the lifecycle started with.
    async fn update(&mut self, _ctx: &AllocHookContext, _alloc: &Arc<Allocation>) {}

    /// The alloc is destroyed: its dir is gone, and its persisted records
    /// are deleted once every hook's `destroy` succeeded. The first error
    /// ends the destroy.
    async fn destroy(&mut self, _ctx: &AllocHookContext) -> Result<(), AllocRunnerError> {
        Ok(())
    }
}

/// The chain, in prerun order.
pub fn default_hooks() -> Vec<Box<dyn AllocHook>> {
    vec![Box::new(AllocDirHook), Box::new(CsiHook::default())]
}
