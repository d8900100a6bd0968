//! berth-allocrunner: runs one allocation on this node.
//!
//! It owns the alloc runner and the task runners, their hook chains (alloc
//! dir, CSI volumes, task dir, plugin supervisor, volume mounts), the task
//! drivers (`raw_exec`), the per-task executor and the restart policy. An
//! [`AllocRunner`] takes an [`berth_structs::Allocation`], makes its
//! directories, claims and mounts its CSI volumes, runs its tasks, and
//! undoes it all when the alloc stops. It persists what a restarted agent
//! needs and picks running allocs up again ([`AllocRunner::restore`]).
//!
//! It knows nothing of the servers, the wire protocol, the state DB or the
//! HTTP API: the agent plugs in what it needs from above through
//! [`VolumeClaimer`] (CSI claims on the servers), [`AllocStateUpdater`]
//! (where alloc and task state changes go) and [`AllocStateStore`] (what
//! survives a restart). CSI calls go through `berth-csimanager`.

pub mod alloc_dir;
pub mod alloc_hooks;
pub mod alloc_runner;
pub mod cgroups;
pub mod claims;
pub mod config;
pub mod driver;
pub mod env;
pub mod error;
pub mod executor;
pub mod isolation;
pub mod lease;
pub mod logs;
pub mod restart;
pub mod state;
pub mod task_hooks;
pub mod task_ops;
mod task_runner;
mod usage;
pub mod users;

pub use alloc_dir::{AllocDir, TaskDir};
pub use alloc_runner::AllocRunner;
pub use claims::{ClaimError, ClaimGrant, ClaimRequest, VolumeClaimer};
pub use config::AllocRunnerConfig;
pub use driver::{
    Driver, ExecutorCommand, ExitResult, RawExecDriver, TaskHandle, TaskHandleRecord, TaskSpec,
};
pub use error::{AllocRunnerError, DriverError, HookError, StateError};
pub use state::{
    AllocStateStore, AllocStateUpdater, NoopStateStore, Persist, PersistedAllocState, RestoredAlloc,
};
pub use task_ops::{parse_signal, TaskOpError};
