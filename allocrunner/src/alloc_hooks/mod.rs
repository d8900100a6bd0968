//! The alloc runner's hook chain. `prerun` runs in order before any task
//! starts; `postrun` runs in reverse once the tasks are done, for every hook
//! whose `prerun` was started (also the one that failed: each hook's
//! `postrun` undoes exactly what its `prerun` did).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use berth_csimanager::MountInfo;
use berth_structs::Allocation;
use tokio::sync::watch;

use crate::alloc_dir::AllocDir;
use crate::config::AllocRunnerConfig;
use crate::error::HookError;

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
    pub stop: watch::Receiver<bool>,
    /// Mounted CSI volumes by the name of the group's volume request; the
    /// task runners bind them into task dirs.
    pub mounts: Mutex<BTreeMap<String, MountInfo>>,
    /// The runner was restored after an agent restart: what the previous
    /// agent set up may still be in place.
    pub restoring: bool,
}

#[async_trait::async_trait]
pub trait AllocHook: Send {
    fn name(&self) -> &'static str;
    async fn prerun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError>;
    async fn postrun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError>;
}

/// The chain, in prerun order.
pub fn default_hooks() -> Vec<Box<dyn AllocHook>> {
    vec![Box::new(AllocDirHook), Box::new(CsiHook::default())]
}
